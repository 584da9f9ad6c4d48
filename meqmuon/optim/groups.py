"""Role-based parameter routing: which update rule a parameter gets depends on its role, not its shape.

Routing by shape alone (``p.ndim == 2`` goes to Muon) is a known bug in this field: it sends the
token embedding and the LM head through Newton-Schulz (see the microsoft/dion README, "checking
``p.ndim == 2`` is not sufficient", and NVIDIA/Megatron-LM#4642). The paper distinguishes four kinds
(section 3.2):

``hidden``     >=2-D weights inside the network body (q/k/v/o, gate/up/down, convolutions)
``embedding``  input token embeddings (every ``nn.Embedding``; HF ``get_input_embeddings()``)
``head``       the output LM head / classifier (HF ``get_output_embeddings()``, else by name)
``vector``     1-D (and 0-D) parameters: norm gains, biases

A tied embedding/head tensor appears once, as ``embedding``, and its group says ``tied=True``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

KINDS = ("hidden", "embedding", "head", "vector")

# Module names (last component) treated as an output head when the model has no HF
# ``get_output_embeddings``. Deliberately short: a wrong guess would silently change the algorithm.
HEAD_NAME_PATTERN = re.compile(r"(^|\.)(lm_head|head|classifier|output_layer|score|fc_out)$")


def _hf_module(model: nn.Module, getter_name: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` / ``get_output_embeddings()`` where the model has them."""
    getter = getattr(model, getter_name, None)
    if callable(getter):
        try:
            module = getter()
        except NotImplementedError:
            module = None
        if isinstance(module, nn.Module):
            return module
    return None


def classify_parameters(model: nn.Module) -> dict[str, Any]:
    """Assign every trainable parameter of ``model`` a kind.

    Returns a dict with ``kinds`` (param name -> kind, first name of each unique tensor, in
    ``named_parameters`` order), ``params`` (name -> tensor) and ``tied`` (names of embedding
    tensors that are also the output head).
    """
    named = dict(model.named_parameters())  # de-duplicates tied tensors, keeps the first name
    by_id = {id(p): n for n, p in named.items()}

    embedding_ids: set[int] = set()
    head_ids: set[int] = set()
    emb_module = _hf_module(model, "get_input_embeddings")
    if emb_module is not None:
        embedding_ids.update(id(p) for p in emb_module.parameters(recurse=False) if p.ndim >= 2)
    for module in model.modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            embedding_ids.add(id(module.weight))

    out_module = _hf_module(model, "get_output_embeddings")
    if out_module is not None:
        head_ids.update(id(p) for p in out_module.parameters(recurse=False) if p.ndim >= 2)
    else:
        for mname, module in model.named_modules():
            if mname and HEAD_NAME_PATTERN.search(mname):
                head_ids.update(id(p) for p in module.parameters(recurse=False) if p.ndim >= 2)

    kinds: dict[str, str] = {}
    tied: list[str] = []
    for name, p in named.items():
        if not p.requires_grad:
            continue
        pid = id(p)
        if pid in embedding_ids:
            kinds[name] = "embedding"
            if pid in head_ids:
                tied.append(name)
        elif pid in head_ids:
            kinds[name] = "head"
        elif p.ndim >= 2:
            kinds[name] = "hidden"
        else:
            kinds[name] = "vector"
    assert len(by_id) == len(named)  # each unique tensor has exactly one name here
    return {"kinds": kinds, "params": named, "tied": tied}


def _per_kind(value: float | Mapping[str, float] | None, kind: str, what: str) -> float | None:
    if value is None or isinstance(value, int | float):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - set(KINDS)
        if unknown:
            raise ValueError(f"param_groups: {what} has unknown kinds {sorted(unknown)}; valid kinds: {KINDS}")
        return value.get(kind)
    raise TypeError(f"param_groups: {what} must be a float or a mapping kind -> float, got {type(value).__name__}")


def param_groups(
    model: nn.Module,
    *,
    lr: float | Mapping[str, float] | None = None,
    weight_decay: float | Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Route every trainable parameter of ``model`` into one group per kind.

    Args:
        model: any ``nn.Module``; HF models are recognised through ``get_input_embeddings`` /
            ``get_output_embeddings``, others through ``nn.Embedding`` and head names
            (``lm_head``, ``head``, ``classifier``, ``output_layer``, ``score``, ``fc_out``).
        lr: optional learning rate written into every group, or a mapping kind -> lr.
        weight_decay: same, for weight decay.

    Returns:
        Non-empty groups in the order hidden, embedding, head, vector. Each has ``params``,
        ``names`` (fully qualified), ``kind`` and ``tied`` (True only for an embedding group holding
        a tensor shared with the output head). Frozen parameters are skipped.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module`` (e.g. ``model.parameters()``).
        ValueError: if some trainable parameter would land in no group or in two.
    """
    if not isinstance(model, nn.Module):
        what = type(model).__name__
        raise TypeError(f"param_groups() takes an nn.Module (it needs parameter names and module types to route by "
                        f"role); got {'an' if what[:1].lower() in 'aeiou' else 'a'} {what}: pass the model itself")
    info = classify_parameters(model)
    groups: dict[str, dict[str, Any]] = {k: {"params": [], "names": [], "kind": k, "tied": False} for k in KINDS}
    for name, kind in info["kinds"].items():
        groups[kind]["params"].append(info["params"][name])
        groups[kind]["names"].append(name)
    if info["tied"]:
        groups["embedding"]["tied"] = True
        groups["embedding"]["tied_names"] = list(info["tied"])

    # Coverage check: every unique trainable tensor exactly once.
    seen: dict[int, str] = {}
    for g in groups.values():
        for name, p in zip(g["names"], g["params"], strict=True):
            if id(p) in seen:
                raise ValueError(f"param_groups: parameter {name!r} was routed twice (also as {seen[id(p)]!r})")
            seen[id(p)] = name
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for i, n in trainable.items() if i not in seen]
    if missing:
        raise ValueError(f"param_groups: trainable parameters not routed to any group: {missing}")

    out = []
    for kind in KINDS:
        g = groups[kind]
        if not g["params"]:
            continue
        group_lr = _per_kind(lr, kind, "lr")
        group_wd = _per_kind(weight_decay, kind, "weight_decay")
        if group_lr is not None:
            g["lr"] = group_lr
        if group_wd is not None:
            g["weight_decay"] = group_wd
        out.append(g)
    return out


def describe_groups(groups: Iterable[Mapping[str, Any]]) -> str:
    """A readable markdown table of parameter groups: kind, tensors, elements, example names."""
    rows = ["| kind | tensors | elements | tied | example names |", "|---|---:|---:|---|---|"]
    total_tensors = total_elements = 0
    for g in groups:
        params = list(g["params"])
        names = list(g.get("names", []))
        n_el = sum(p.numel() for p in params)
        total_tensors += len(params)
        total_elements += n_el
        examples = ", ".join(names[:3]) + (f", ... (+{len(names) - 3})" if len(names) > 3 else "")
        rows.append(
            f"| {g.get('kind', '?')} | {len(params)} | {n_el:,} | {'yes' if g.get('tied') else 'no'} | {examples} |"
        )
    rows.append(f"| total | {total_tensors} | {total_elements:,} | | |")
    return "\n".join(rows)


def infer_kind(p: torch.Tensor) -> str:
    """Shape-only fallback for groups passed without ``kind``: >=2-D is hidden, else vector."""
    return "hidden" if p.ndim >= 2 else "vector"
