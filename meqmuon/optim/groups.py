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

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .structure import Route, declared_view
from .views import Layout, group_layout, layout_of

KINDS = ("hidden", "embedding", "head", "vector")

# Module names (last component) treated as an output head when the model has no HF
# ``get_output_embeddings``. Deliberately short: a wrong guess would silently change the algorithm. ``output``
# only as a child of the model itself: torchtitan's decoders up to 0.2 (``self.output = nn.Linear(dim, vocab)``).
HEAD_NAME_PATTERN = re.compile(r"(^|\.)(lm_head|head|classifier|output_layer|score|fc_out)$|^output$")


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


def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module, nn.Module | None]]:
    """Parameter id -> (module name, the module holding it directly, that module's parent)."""
    parents: dict[int, nn.Module] = {}
    owners: dict[int, tuple[str, nn.Module, nn.Module | None]] = {}
    for mname, module in model.named_modules():
        for child in module.children():
            parents.setdefault(id(child), module)
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), (mname, module, parents.get(id(module))))
    return owners


def _roles(model: nn.Module, owners: dict) -> tuple[set[int], set[int], nn.Module | None]:
    """Ids of the embedding and head tensors, and the HF output-embedding module if any."""
    embedding_ids: set[int] = set()
    head_ids: set[int] = set()
    emb_module = _hf_module(model, "get_input_embeddings")
    if emb_module is not None:
        # recurse: ViT's input embedding is a module whose patch projection is a child Conv2d
        embedding_ids.update(id(p) for p in emb_module.parameters() if p.ndim >= 2)
    for module in model.modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            embedding_ids.add(id(module.weight))
    # An input projection of an embeddings module (CLIP's vision patch convolution, as ViT's, which
    # get_input_embeddings() returns): the model's input layer, not a hidden map.
    embedding_ids.update(pid for pid, (_, module, parent) in owners.items()
                         if isinstance(module, nn.modules.conv._ConvNd | nn.Linear) and parent is not None
                         and type(parent).__name__.endswith("Embeddings") and module.weight is not None
                         and id(module.weight) == pid)

    out_module = _hf_module(model, "get_output_embeddings")
    if out_module is not None:
        head_ids.update(id(p) for p in out_module.parameters(recurse=False) if p.ndim >= 2)
    else:
        for mname, module in model.named_modules():
            if mname and HEAD_NAME_PATTERN.search(mname):
                head_ids.update(id(p) for p in module.parameters(recurse=False) if p.ndim >= 2)

    return embedding_ids, head_ids, out_module


def classify_parameters(model: nn.Module) -> dict[str, Any]:
    """Assign every trainable parameter of ``model`` a kind and a matrix view (``views.py``).

    Returns a dict with ``kinds`` (param name -> kind, first name of each unique tensor, in
    ``named_parameters`` order), ``params`` (name -> tensor), ``tied`` (names of embedding
    tensors that are also the output head), ``views``, ``splits``, ``folds`` and ``interleaved`` (name
    -> the matrix view read from the model's structure, :mod:`meqmuon.optim.structure`), ``notes``
    (name -> why a tensor the model uses as several blocks is kept whole) and ``headless`` (the model
    declares no output head).

    Beyond role: a >=2-D tensor whose matrices have one row or one column is a vector in disguise
    (Qwen2-MoE's ``shared_expert_gate`` ``(1, d)``, ViT's ``cls_token`` ``(1, 1, d)``): row or column
    normalising it would be a sign update, so it is a ``vector``. A learned table stored with leading
    singleton dims (ViT's ``position_embeddings`` ``(1, N, d)``) is an ``embedding``, viewed stacked.
    """
    named = dict(model.named_parameters())  # de-duplicates tied tensors, keeps the first name
    by_id = {id(p): n for n, p in named.items()}
    owners = _owners(model)

    embedding_ids, head_ids, out_module = _roles(model, owners)
    kinds: dict[str, str] = {}
    views: dict[str, str] = {}
    splits: dict[str, tuple[int, ...] | None] = {}
    folds: dict[str, int | None] = {}
    interleaved: dict[str, bool] = {}
    notes: dict[str, str] = {}
    tied: list[str] = []
    for name, p in named.items():
        if not p.requires_grad:
            continue
        pid = id(p)
        route = Route()
        if p.ndim >= 2:
            mname, module, parent = owners[pid]
            route = declared_view(mname, module, parent, name.rsplit(".", 1)[-1], p)
        view, split, fold = route.view, route.split, route.folds
        if pid in embedding_ids:
            kind = "embedding"
            if pid in head_ids:
                tied.append(name)
        elif pid in head_ids:
            kind = "head"
        elif p.ndim < 2:
            kind = "vector"
        elif route.kind is not None:
            kind = route.kind
        else:
            layout = layout_of(p.shape, view, split, name, fold)
            if min(layout.rows, layout.cols) == 1:
                kind, view, split, fold = "vector", "matrix", None, None
            elif view == "stacked" and math.prod(layout.batch) == 1 and not type(owners[pid][1]).__name__.endswith(
                    "Experts"):
                kind = "embedding"
            else:
                kind = "hidden"
        if kind in ("embedding", "head") and view == "vectors":
            view = "matrix"
        kinds[name], views[name], splits[name], folds[name] = kind, view, split, fold
        interleaved[name] = route.interleaved and split is not None
        if route.note:
            notes[name] = route.note
    assert len(by_id) == len(named)  # each unique tensor has exactly one name here
    headless = out_module is None and not head_ids and _declares_no_head(model)
    return {"kinds": kinds, "params": named, "tied": tied, "views": views, "splits": splits, "folds": folds,
            "interleaved": interleaved, "notes": notes, "headless": headless}


def _declares_no_head(model: nn.Module) -> bool:
    """A transformers model whose ``get_output_embeddings()`` answers ``None``: it has no LM head (CLIP's
    towers end in projections; an encoder's in its pooler), so a missing head is no surprise."""
    getter = getattr(model, "get_output_embeddings", None)
    if not callable(getter):
        return False
    try:
        return getter() is None
    except NotImplementedError:
        return False


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
    split_fused: bool = True,
    kinds: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Route every trainable parameter of ``model`` into one group per kind.

    Args:
        model: any ``nn.Module``; HF models are recognised through ``get_input_embeddings`` /
            ``get_output_embeddings``, others through ``nn.Embedding`` and head names
            (``lm_head``, ``head``, ``classifier``, ``output_layer``, ``score``, ``fc_out``; ``output`` as a
            child of the model, torchtitan's decoders up to 0.2).
        lr: optional learning rate written into every group, or a mapping kind -> lr.
        weight_decay: same, for weight decay.
        split_fused: split fused projections whose layout is read from the model
            (:data:`meqmuon.optim.structure.FUSED_LAYOUTS`: Phi3, GPT-2, DBRX, ModernBERT, Mamba,
            Mamba2, MLA; experts' ``gate_up_proj`` halves) into their blocks, so that the model
            trains as its unfused twin (docs/algorithm.md, "Routing").
        kinds: overrides of the routing, regex on the parameter name -> kind (``re.search``; the
            first pattern that matches wins), e.g. ``{r"A_log$": "hidden"}`` to orthogonalise Mamba's
            ``A_log`` after all, or ``{r"patch_embedding": "hidden"}``. A tensor moved out of the
            ``vector`` kind loses a ``"vectors"`` view (it is one matrix again).

    Returns:
        Non-empty groups in the order hidden, embedding, head, vector. Each has ``params``,
        ``names`` (fully qualified), ``kind``, ``tied`` (True only for an embedding group holding
        a tensor shared with the output head), and per parameter its matrix view (``views``) and
        row split (``splits``; see :mod:`meqmuon.optim.views`), and ``folds`` where a 2-D tensor
        holds experts along its rows (DBRX). Tensors kept whole although the model uses them as
        several blocks are listed in ``notes`` (name -> why); ``headless`` marks an embedding group of
        a model that declares no output head (``get_output_embeddings()`` is ``None``: CLIP).
        Frozen parameters are skipped.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module`` (e.g. ``model.parameters()``).
        ValueError: if some trainable parameter would land in no group or in two.
    """
    if not isinstance(model, nn.Module):
        what = type(model).__name__
        raise TypeError(f"param_groups() takes an nn.Module (it needs parameter names and module types to route by "
                        f"role); got {'an' if what[:1].lower() in 'aeiou' else 'a'} {what}: pass the model itself")
    info = classify_parameters(model)
    _override_kinds(info, kinds or {})
    groups = _fill_groups(info, split_fused)

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


def _override_kinds(info: dict[str, Any], kinds: Mapping[str, str]) -> None:
    """Apply ``param_groups(kinds=...)`` to the classification ``info`` in place."""
    for pattern, kind in kinds.items():
        if kind not in KINDS:
            raise ValueError(f"param_groups: kinds[{pattern!r}] = {kind!r} is not one of {KINDS}")
        if not any(re.search(pattern, n) for n in info["kinds"]):
            raise ValueError(f"param_groups: kinds pattern {pattern!r} matches no trainable parameter")
    for name in info["kinds"]:
        kind = next((k for rx, k in kinds.items() if re.search(rx, name)), None)
        if kind is None:
            continue
        p = info["params"][name]
        if kind != "vector" and p.ndim < 2:
            raise ValueError(f"param_groups: {name} of shape {tuple(p.shape)} cannot be routed as {kind!r}")
        info["kinds"][name] = kind
        if kind != "vector" and info["views"][name] == "vectors":
            info["views"][name] = "matrix"
        if name in info["tied"] and kind != "embedding":
            info["tied"].remove(name)


def _fill_groups(info: dict[str, Any], split_fused: bool) -> dict[str, dict[str, Any]]:
    """One group per kind from the classification ``info``, with per-parameter views and splits."""
    groups: dict[str, dict[str, Any]] = {
        k: {"params": [], "names": [], "kind": k, "tied": False, "views": [], "splits": []} for k in KINDS
    }
    for name, kind in info["kinds"].items():
        g = groups[kind]
        g["params"].append(info["params"][name])
        g["names"].append(name)
        g["views"].append(info["views"][name])
        split = info["splits"][name]
        g["splits"].append(split if split_fused else None)
        note = info["notes"].get(name)
        if split is not None and not split_fused:
            note = f"blocks {split} read from the model; kept whole (split_fused=False)"
        if note:
            g.setdefault("notes", {})[name] = note
    # Keys only where some tensor folds experts or interleaves its blocks: other models' groups are as before.
    for key, absent in (("folds", None), ("interleaved", False)):
        for name, value in info[key].items():
            if value != absent and (key == "folds" or split_fused):
                g = groups[info["kinds"][name]]
                g.setdefault(key, [absent] * len(g["params"]))[g["names"].index(name)] = value
    if info["headless"]:
        groups["embedding"]["headless"] = True
    if info["tied"]:
        groups["embedding"]["tied"] = True
        groups["embedding"]["tied_names"] = list(info["tied"])
    return groups


def describe_groups(groups: Iterable[Mapping[str, Any]]) -> str:
    """A markdown table of parameter groups, one row per kind, then every >=2-D tensor whose matrices
    are not the tensor itself (stacked, transposed, split), each with its shape and view, e.g.
    ``experts.down_proj (8, 512, 1376) -> 8 x 512x1376``; then fused tensors kept whole, and a warning
    when a model with an embedding has no recognised output head."""
    rows = ["| kind | tensors | elements | tied | example names |", "|---|---:|---:|---|---|"]
    views, notes = [], []
    total_tensors = total_elements = 0
    kinds = set()
    tied = False
    for g in groups:
        params = list(g["params"])
        names = list(g.get("names", [])) or [f"params[{i}]" for i in range(len(params))]
        n_el = sum(p.numel() for p in params)
        total_tensors += len(params)
        total_elements += n_el
        kinds.add(g.get("kind"))
        tied = tied or bool(g.get("tied")) or bool(g.get("headless"))
        examples = ", ".join(names[:3]) + (f", ... (+{len(names) - 3})" if len(names) > 3 else "")
        rows.append(
            f"| {g.get('kind', '?')} | {len(params)} | {n_el:,} | {'yes' if g.get('tied') else 'no'} | {examples} |"
        )
        for i, (name, p) in enumerate(zip(names, params, strict=True)):
            layout = group_layout(g, i, p.shape, name)
            if p.ndim >= 2 and not layout.whole:
                views.append(f"- {name} {tuple(p.shape)} {describe_view(layout)}")
        notes += [f"- {name}: {why}" for name, why in g.get("notes", {}).items()]
    rows.append(f"| total | {total_tensors} | {total_elements:,} | | |")
    if views:
        rows += ["", "Matrix views (rows are output features):", *views]
    if notes:
        rows += ["", "Fused tensors kept whole:", *notes]
    if "embedding" in kinds and "head" not in kinds and not tied:
        rows += ["", "Warning: the model has an input embedding but no recognised output head; an LM head or "
                 "classifier not named lm_head/head/classifier/output_layer/score/fc_out (or output, a child of the "
                 "model) is routed as hidden."]
    return "\n".join(rows)


def describe_view(layout: Layout) -> str:
    """``Conv1D -> 2304x768, split 3`` / ``-> 8 x 1376x512``: the matrices a view gives."""
    batch = " x ".join(map(str, layout.batch))
    source = {"transposed": "Conv1D ", "stacked-transposed": "stored (in, out) "}.get(layout.view, "")
    if layout.folded:
        source = f"{layout.batch[0]} experts folded into rows, each {source or 'stored (out, in) '}"
    if layout.view == "vectors":
        return f"-> {batch} vectors of {layout.cols}"
    text = f"{source}-> {batch + ' x ' if batch else ''}{layout.rows}x{layout.cols}"
    if layout.split:
        text += f", split {len(layout.blocks)} {tuple(layout.blocks)}"
        text += " interleaved" if layout.interleaved else ""
    return text


def infer_kind(p: torch.Tensor) -> str:
    """Shape-only fallback for groups passed without ``kind``: >=2-D is hidden, else vector."""
    return "hidden" if p.ndim >= 2 else "vector"
