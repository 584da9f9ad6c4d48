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

from .views import Layout, group_layout, layout_of

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


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``pytorch_utils.Conv1D`` (GPT-2 family), a ``Linear`` stored ``(in, out)``;
    recognised by name and attribute so that the core never imports transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _experts_view(module: nn.Module, pname: str, p: torch.Tensor) -> tuple[str, tuple[int, ...] | None, str]:
    """View, split and note of a 3-D expert tensor of a transformers-5 ``*Experts`` module.

    ``(E, out, in)`` storage (``F.linear(x, W[e])``, 57 of transformers 5's expert modules) is read
    from the shapes: ``down_proj`` ``(E, d, I)`` and ``gate_up_proj`` ``(E, 2I, d)``, whose two halves
    are gate and up (``.chunk(2, dim=-1)``). Transposed ``(E, in, out)`` storage (GPT-OSS, Llama 4,
    Aria) is viewed transposed and not split: GPT-OSS interleaves gate and up, so halves would be wrong.
    """
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.ndim == down.ndim == 3):
        return "stacked", None, ""
    if gate_up.shape[-1] == down.shape[-2]:  # (E, 2I, d) and (E, d, I): stored (out, in)
        if pname == "gate_up_proj" and gate_up.shape[-2] == 2 * down.shape[-1]:
            half = down.shape[-1]
            return "stacked", (half, half), ""
        return "stacked", None, ""
    if gate_up.shape[-2] == down.shape[-1]:  # (E, d, 2I) and (E, I, d): stored (in, out)
        note = "gate/up layout not read (may interleave): kept whole" if pname == "gate_up_proj" else ""
        return "stacked-transposed", None, note
    return "stacked", None, ""


#: Fused projections whose layout is read from the model: ``(parent class, module name) -> blocks``.
#: Only these are split; other fused names are kept whole and listed in :func:`describe_groups`.
def _phi3_qkv(attn: nn.Module) -> tuple[int, ...]:
    q = attn.config.num_attention_heads * attn.head_dim
    kv = attn.num_key_value_heads * attn.head_dim
    return (q, kv, kv)


def _halves(rows: int) -> tuple[int, int]:
    return (rows // 2, rows // 2)


FUSED_LAYOUTS: dict[tuple[str, str], Any] = {
    ("Phi3Attention", "qkv_proj"): lambda parent, rows: _phi3_qkv(parent),
    ("Phi3MLP", "gate_up_proj"): lambda parent, rows: _halves(rows),
    # GPT-2 self-attention: c_attn is Conv1D(3d) split as q, k, v; cross-attention's is (k, v).
    ("GPT2Attention", "c_attn"): lambda parent, rows: (parent.split_size,) * (rows // parent.split_size),
}
#: Names of fused projections whose layout is not read (GPT-NeoX and Falcon interleave per head).
FUSED_NAMES = re.compile(r"(^|\.)(qkv_proj|query_key_value|c_attn|gate_up_proj|W_pack|Wqkv|qkv)$")


def _matrix_view(mname: str, module: nn.Module, parent: nn.Module | None, pname: str,
                 p: torch.Tensor) -> tuple[str, tuple[int, ...] | None, str]:
    """The declared view, split and a note (why a fused tensor is kept whole) of a >=2-D parameter."""
    leaf = mname.rsplit(".", 1)[-1]
    if isinstance(module, nn.modules.conv._ConvNd):
        return "matrix", None, ""
    if _is_conv1d(module):
        view, rows = "transposed", p.shape[1]
    elif p.ndim >= 3:
        if type(module).__name__.endswith("Experts"):
            return _experts_view(module, pname, p)
        return "stacked", None, ""
    else:
        view, rows = "matrix", p.shape[0]
    layout = FUSED_LAYOUTS.get((type(parent).__name__, leaf)) if parent is not None else None
    if layout is not None:
        blocks = tuple(layout(parent, rows))
        if sum(blocks) == rows and len(blocks) > 1:
            return view, blocks, ""
    if FUSED_NAMES.search(mname):
        owner = type(parent).__name__ if parent is not None else "?"
        return view, None, f"fused layout of {owner} not read: kept whole"
    return view, None, ""


def classify_parameters(model: nn.Module) -> dict[str, Any]:
    """Assign every trainable parameter of ``model`` a kind and a matrix view (``views.py``).

    Returns a dict with ``kinds`` (param name -> kind, first name of each unique tensor, in
    ``named_parameters`` order), ``params`` (name -> tensor), ``tied`` (names of embedding
    tensors that are also the output head), ``views`` and ``splits`` (name -> view, split) and
    ``notes`` (name -> why a fused projection is kept whole).

    Beyond role: a >=2-D tensor whose matrices have one row or one column is a vector in disguise
    (Qwen2-MoE's ``shared_expert_gate`` ``(1, d)``, ViT's ``cls_token`` ``(1, 1, d)``): row or column
    normalising it would be a sign update, so it is a ``vector``. A learned table stored with leading
    singleton dims (ViT's ``position_embeddings`` ``(1, N, d)``) is an ``embedding``, viewed stacked.
    """
    named = dict(model.named_parameters())  # de-duplicates tied tensors, keeps the first name
    by_id = {id(p): n for n, p in named.items()}
    owners = _owners(model)

    embedding_ids: set[int] = set()
    head_ids: set[int] = set()
    emb_module = _hf_module(model, "get_input_embeddings")
    if emb_module is not None:
        # recurse: ViT's input embedding is a module whose patch projection is a child Conv2d
        embedding_ids.update(id(p) for p in emb_module.parameters() if p.ndim >= 2)
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
    views: dict[str, str] = {}
    splits: dict[str, tuple[int, ...] | None] = {}
    notes: dict[str, str] = {}
    tied: list[str] = []
    for name, p in named.items():
        if not p.requires_grad:
            continue
        pid = id(p)
        view, split, note = "matrix", None, ""
        if p.ndim >= 2:
            mname, module, parent = owners[pid]
            view, split, note = _matrix_view(mname, module, parent, name.rsplit(".", 1)[-1], p)
        if pid in embedding_ids:
            kind = "embedding"
            if pid in head_ids:
                tied.append(name)
        elif pid in head_ids:
            kind = "head"
        elif p.ndim < 2:
            kind = "vector"
        else:
            layout = layout_of(p.shape, view, split, name)
            if min(layout.rows, layout.cols) == 1:
                kind, view, split = "vector", "matrix", None
            elif view == "stacked" and math.prod(layout.batch) == 1 and not type(owners[pid][1]).__name__.endswith(
                    "Experts"):
                kind = "embedding"
            else:
                kind = "hidden"
        kinds[name], views[name], splits[name] = kind, view, split
        if note:
            notes[name] = note
    assert len(by_id) == len(named)  # each unique tensor has exactly one name here
    return {"kinds": kinds, "params": named, "tied": tied, "views": views, "splits": splits, "notes": notes}


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
) -> list[dict[str, Any]]:
    """Route every trainable parameter of ``model`` into one group per kind.

    Args:
        model: any ``nn.Module``; HF models are recognised through ``get_input_embeddings`` /
            ``get_output_embeddings``, others through ``nn.Embedding`` and head names
            (``lm_head``, ``head``, ``classifier``, ``output_layer``, ``score``, ``fc_out``).
        lr: optional learning rate written into every group, or a mapping kind -> lr.
        weight_decay: same, for weight decay.
        split_fused: split fused projections whose layout is read from the model (Phi3's
            ``qkv_proj`` and ``gate_up_proj``, GPT-2's ``c_attn``, MoE experts' ``gate_up_proj``) into
            their blocks, so that the model trains as its unfused twin (docs/algorithm.md, "Routing").

    Returns:
        Non-empty groups in the order hidden, embedding, head, vector. Each has ``params``,
        ``names`` (fully qualified), ``kind``, ``tied`` (True only for an embedding group holding
        a tensor shared with the output head), and per parameter its matrix view (``views``) and
        row split (``splits``; see :mod:`meqmuon.optim.views`). Fused tensors kept whole are listed
        in ``notes`` (name -> why). Frozen parameters are skipped.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module`` (e.g. ``model.parameters()``).
        ValueError: if some trainable parameter would land in no group or in two.
    """
    if not isinstance(model, nn.Module):
        what = type(model).__name__
        raise TypeError(f"param_groups() takes an nn.Module (it needs parameter names and module types to route by "
                        f"role); got {'an' if what[:1].lower() in 'aeiou' else 'a'} {what}: pass the model itself")
    info = classify_parameters(model)
    groups: dict[str, dict[str, Any]] = {
        k: {"params": [], "names": [], "kind": k, "tied": False, "views": [], "splits": []} for k in KINDS
    }
    for name, kind in info["kinds"].items():
        g = groups[kind]
        g["params"].append(info["params"][name])
        g["names"].append(name)
        g["views"].append(info["views"][name])
        g["splits"].append(info["splits"][name] if split_fused else None)
        if name in info["notes"]:
            g.setdefault("notes", {})[name] = info["notes"][name]
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
        tied = tied or bool(g.get("tied"))
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
                 "classifier not named lm_head/head/classifier/output_layer/score/fc_out is routed as hidden."]
    return "\n".join(rows)


def describe_view(layout: Layout) -> str:
    """``Conv1D -> 2304x768, split 3`` / ``-> 8 x 1376x512``: the matrices a view gives."""
    batch = " x ".join(map(str, layout.batch))
    source = {"transposed": "Conv1D ", "stacked-transposed": "stored (in, out) "}.get(layout.view, "")
    text = f"{source}-> {batch + ' x ' if batch else ''}{layout.rows}x{layout.cols}"
    if layout.split:
        text += f", split {len(layout.blocks)} {tuple(layout.blocks)}"
    return text


def infer_kind(p: torch.Tensor) -> str:
    """Shape-only fallback for groups passed without ``kind``: >=2-D is hidden, else vector."""
    return "hidden" if p.ndim >= 2 else "vector"
