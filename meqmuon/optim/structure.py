"""What a model's structure says about how a tensor is used: expert stacks, folded experts, per-expert
biases and fused projections, read from module classes, their attributes and the model's config.

:func:`meqmuon.param_groups` asks :func:`declared_view` for the matrix view of every >=2-D tensor
(``views.py``). Each layout here is read from the model, never from a parameter name alone; where a
tensor is known to be used as several blocks but its layout cannot be read, it is kept whole and the
reason is returned, which :func:`meqmuon.describe_groups` lists under "Kept whole". The tables name
the transformers source that fixes each layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn


class Route(NamedTuple):
    """The view of one tensor: ``kind`` overrides the role-based kind where not ``None``; ``note``
    says why a tensor used as several blocks is kept whole."""

    view: str = "matrix"
    split: tuple[int, ...] | None = None
    folds: int | None = None
    note: str = ""
    kind: str | None = None
    interleaved: bool = False


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``pytorch_utils.Conv1D`` (GPT-2 family), a ``Linear`` stored ``(in, out)``;
    recognised by name and attribute so that the core never imports transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


# ---- experts -------------------------------------------------------------------------------------

#: Undecorated transformers-5 expert classes whose fused ``gate_up_proj`` is contiguous gate | up
#: (transformers' ``@use_experts_implementation`` classes say it in ``is_concatenated``).
#: Llama 4: ``Llama4TextExperts.forward`` does ``gate, up = gate_up.chunk(2, dim=-1)``.
CONCATENATED_GATE_UP = frozenset({"Llama4TextExperts"})


def _is_experts(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Experts")


#: Experts modules whose fused gate/up tensor interleaves gate and up rows, under another name than
#: ``gate_up_proj``: class -> its name. torchtitan's GPT-OSS (``models/gpt_oss/moe.py``): ``mlp1_weight_EGD``
#: ``(E, 2F, D)``, used ``x @ w[e].T``, then ``swiglu``: ``x[..., ::2], x[..., 1::2]``.
INTERLEAVED_GATE_UP = {"GptOssGroupedExperts": "mlp1_weight_EGD"}


def _experts_count(module: nn.Module) -> int | None:
    """The number of experts an experts module holds: the leading dim of its 3-D expert tensors
    (transformers' ``gate_up_proj``, ``down_proj``, ``up_proj``; else any 3-D parameter of its own, as
    torchtitan's ``w1_EFD`` or ``mlp1_weight_EGD``)."""
    for attr in ("gate_up_proj", "down_proj", "up_proj"):
        t = getattr(module, attr, None)
        if isinstance(t, torch.Tensor) and t.ndim == 3:
            return t.shape[0]
    sizes = {p.shape[0] for p in module.parameters(recurse=False) if p.ndim == 3}
    return sizes.pop() if len(sizes) == 1 else None


def _experts_route(module: nn.Module, pname: str, p: torch.Tensor) -> Route:
    """A tensor of a transformers-5 ``*Experts`` module.

    ``(E, out, in)`` storage (``F.linear(x, W[e])``) or ``(E, in, out)`` (``x @ W[e]``; GPT-OSS, Llama
    4, Aria) is read from the module's ``is_transposed`` (``@use_experts_implementation``) where it
    has one, else from the shapes of ``gate_up_proj`` ``(E, 2I, d)`` and ``down_proj`` ``(E, d, I)``.
    ``gate_up_proj`` is split in halves where gate and up are contiguous (``is_concatenated``, or
    :data:`CONCATENATED_GATE_UP`), in alternate rows where they interleave (GPT-OSS's
    ``is_concatenated=False``: ``gate_up[..., ::2]``, ``gate_up[..., 1::2]``). A 2-D ``(E, k)``
    tensor is one bias vector per expert (GPT-OSS's ``gate_up_proj_bias``, ``down_proj_bias``).
    """
    experts = _experts_count(module)
    if p.ndim == 2 and experts is not None and p.shape[0] == experts and "bias" in pname:
        note = ("each expert's gate and up biases in one vector (the vector rule's RMS spans both)"
                if pname.startswith(("gate_up", "mlp1")) else "")
        return Route("vectors", note=note, kind="vector")
    if p.ndim < 3:
        return Route()
    if INTERLEAVED_GATE_UP.get(type(module).__name__) == pname and p.shape[-2] % 2 == 0:
        return Route("stacked", (p.shape[-2] // 2,) * 2, interleaved=True)
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    transposed = getattr(module, "is_transposed", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.ndim == down.ndim == 3):
        return Route("stacked-transposed" if transposed else "stacked")  # e.g. has_gate=False: up_proj, down_proj
    if transposed is None:
        if gate_up.shape[-1] == down.shape[-2]:  # (E, 2I, d) and (E, d, I): stored (out, in)
            transposed = False
        elif gate_up.shape[-2] == down.shape[-1]:  # (E, d, 2I) and (E, I, d): stored (in, out)
            transposed = True
        else:
            return Route("stacked")
    view = "stacked-transposed" if transposed else "stacked"
    if pname != "gate_up_proj":
        return Route(view)
    rows = gate_up.shape[-1] if transposed else gate_up.shape[-2]
    concatenated = getattr(module, "is_concatenated", None)
    owner = type(module).__name__
    if concatenated is None and (not transposed or owner in CONCATENATED_GATE_UP):
        concatenated = True  # (E, 2I, d) halves: transformers 5's default layout (``.chunk(2, dim=-1)``)
    if concatenated and rows % 2 == 0:
        return Route(view, (rows // 2, rows // 2))
    if concatenated is False and rows % 2 == 0:
        return Route(view, (rows // 2, rows // 2), interleaved=True)
    return Route(view, note=f"gate/up layout of {owner} not read: kept whole")


#: Experts folded into 2-D ``(E * rows, cols)`` tensors: class -> view of each tensor's per-expert
#: blocks. DBRX (``DbrxExpertGLU.forward``): ``x.matmul(w1[e].T)``, ``x.matmul(v1[e].T)`` (blocks stored
#: ``(out, in)``) and ``h.matmul(w2[e])`` (stored ``(in, out)``), ``w*.view(-1, ffn, d)[e]``.
FOLDED_EXPERTS: dict[str, dict[str, str]] = {
    "DbrxExpertGLU": {"w1": "stacked", "v1": "stacked", "w2": "stacked-transposed"},
}
_EXPERT_COUNT = ("moe_num_experts", "num_experts", "num_local_experts")
_EXPERT_ROWS = ("ffn_hidden_size", "expert_dim", "intermediate_size")


def _first_int(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _folded_route(module: nn.Module, pname: str, p: torch.Tensor) -> Route | None:
    """A 2-D tensor of a module that states a number of experts ``E`` and an expert size ``f``
    (attributes from its config) whose rows are ``E * f``: the experts folded into one tensor."""
    experts, rows = _first_int(module, _EXPERT_COUNT), _first_int(module, _EXPERT_ROWS)
    if experts is None or rows is None or experts < 2 or p.ndim != 2 or p.shape[0] != experts * rows:
        return None
    view = FOLDED_EXPERTS.get(type(module).__name__, {}).get(pname)
    if view is None:
        return Route(note=f"{experts} experts folded into its rows; orientation in {type(module).__name__} "
                          "not read: kept whole")
    return Route(view, folds=experts)


# ---- fused projections ---------------------------------------------------------------------------


def _halves(parent: nn.Module, rows: int) -> tuple[int, ...]:
    return (rows // 2, rows // 2)


def _phi3_qkv(attn: nn.Module, rows: int) -> tuple[int, ...]:
    q = attn.config.num_attention_heads * attn.head_dim
    kv = attn.num_key_value_heads * attn.head_dim
    return (q, kv, kv)


def _gqa_qkv(attn: nn.Module, rows: int) -> tuple[int, ...]:
    kv = attn.num_key_value_heads * attn.head_dim
    return (attn.num_heads * attn.head_dim, kv, kv)


def _three(parent: nn.Module, rows: int) -> tuple[int, ...]:
    return (rows // 3,) * 3


def _mamba_x_proj(mixer: nn.Module, rows: int) -> tuple[int, ...]:
    return (mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size)


def _mamba2_in_proj(mixer: nn.Module, rows: int) -> tuple[int, ...]:
    inner, groups = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
    mlp = (rows - 2 * inner - 2 * groups - mixer.num_heads) // 2  # Mamba2's optional MLP part
    return tuple(b for b in (mlp, mlp, inner, inner, groups, groups, mixer.num_heads) if b)


def _mamba2_conv(mixer: nn.Module, rows: int) -> tuple[int, ...]:
    groups = mixer.n_groups * mixer.ssm_state_size
    return (mixer.intermediate_size, groups, groups)


#: Fused projections whose layout is read from the model: ``(parent class, module name) -> blocks``
#: as a function of the parent and the rows. Each is contiguous row blocks in the model's forward:
#: Phi3 ``qkv_proj`` (q, k, v by its head counts) and ``gate_up_proj`` (``chunk(2)``); GPT-2 ``c_attn``
#: (q, k, v of ``split_size``); DBRX ``Wqkv`` (``split([d, kv, kv])``); ModernBERT ``Wqkv``
#: (``view(..., 3, -1, head_dim)``) and ``Wi`` (``chunk(2)``); Mamba, Falcon-Mamba and Jamba ``in_proj``
#: (``chunk(2)``: x, z) and ``x_proj`` (``split([rank, N, N])``: dt, B, C); Mamba2 ``in_proj`` (z, x, B,
#: C, dt) and its depthwise ``conv1d`` channels (x, B, C); DeepSeek V2/V3 (MLA) ``kv_a_proj_with_mqa``
#: (``split([kv_lora_rank, qk_rope_head_dim])``).
FUSED_LAYOUTS: dict[tuple[str, str], Callable[[nn.Module, int], tuple[int, ...]]] = {
    ("Phi3Attention", "qkv_proj"): _phi3_qkv,
    ("Phi3MLP", "gate_up_proj"): _halves,
    ("GPT2Attention", "c_attn"): lambda parent, rows: (parent.split_size,) * (rows // parent.split_size),
    ("DbrxAttention", "Wqkv"): _gqa_qkv,
    ("ModernBertAttention", "Wqkv"): _three,
    ("ModernBertMLP", "Wi"): _halves,
    ("MambaMixer", "in_proj"): _halves,
    ("MambaMixer", "x_proj"): _mamba_x_proj,
    ("FalconMambaMixer", "in_proj"): _halves,
    ("FalconMambaMixer", "x_proj"): _mamba_x_proj,
    ("JambaMambaMixer", "in_proj"): _halves,
    ("JambaMambaMixer", "x_proj"): _mamba_x_proj,
    ("Mamba2Mixer", "in_proj"): _mamba2_in_proj,
    ("Mamba2Mixer", "conv1d"): _mamba2_conv,
    ("DeepseekV2Attention", "kv_a_proj_with_mqa"): lambda a, rows: (a.kv_lora_rank, a.qk_rope_head_dim),
    ("DeepseekV3Attention", "kv_a_proj_with_mqa"): lambda a, rows: (a.kv_lora_rank, a.qk_rope_head_dim),
    # Granite MoE's shared / dense GLU and JetMoE: ``input_linear(x).chunk(2, dim=-1)``; JetMoE's
    # ``kv_proj(x).chunk(2, dim=-1)``; its attention experts' (MoA) input_linear is one block.
    **{(c, "input_linear"): _halves for c in ("GraniteMoeSharedMLP", "GraniteMoeHybridMLP", "GraniteMoeSWAMLP",
                                              "JetMoeMoE")},
    ("JetMoeAttention", "kv_proj"): _halves,
    ("JetMoeMoA", "input_linear"): lambda parent, rows: (rows,),
    # Qwen3-Next's Gated-DeltaNet (``Qwen3NextGatedDeltaNet.forward``): its depthwise ``conv1d`` runs over
    # ``cat((query, key, value), -1)``, split back by ``torch.split(..., [key_dim, key_dim, value_dim])``.
    ("Qwen3NextGatedDeltaNet", "conv1d"): lambda m, rows: (m.key_dim, m.key_dim, m.value_dim),
}


def _qwen3_next_qkvz(m: nn.Module) -> str:
    r = m.num_v_heads // m.num_k_heads
    return (f"q, k, v, z interleaved per key head ({m.num_k_heads} groups of {m.head_k_dim}, {m.head_k_dim}, "
            f"{r * m.head_v_dim}, {r * m.head_v_dim} rows; fix_query_key_value_ordering): no row view gives a "
            "block, kept whole")


def _qwen3_next_ba(m: nn.Module) -> str:
    r = m.num_v_heads // m.num_k_heads
    return (f"b, a interleaved per key head ({m.num_k_heads} groups of {r}, {r} rows; "
            "fix_query_key_value_ordering): no row view gives a block, kept whole")


def _torchtitan_wqkv(m: nn.Module) -> str:
    r, hd = m.heads_per_kv, m.head_dim
    n_kv = m.wqkv.weight.shape[0] // ((r + 2) * hd)
    return (f"q, k, v interleaved per KV head ({n_kv} groups of {r * hd}, {hd}, {hd} rows; torchtitan's "
            "FusedQKVLinear): no row view gives wq, wk, wv, kept whole (docs/torchtitan.md; fuse_qkv=False trains "
            "as the unfused model)")


def _gated_query(m: nn.Module) -> str:
    return (f"query and output gate interleaved per head ({m.config.num_attention_heads} heads of {m.head_dim}, "
            f"{m.head_dim} rows; view(..., -1, 2 * head_dim).chunk(2)): no row view gives a block, kept whole")


#: Fused projections whose blocks alternate per head (group) in runs of unequal or several rows: no
#: strided view of the rows gives one block (``views.py`` cuts runs, or single rows in turn), so they
#: stay whole and :func:`meqmuon.describe_groups` lists them with their layout. ``(parent class, module
#: name) -> the note``. Qwen3-Next (transformers ``models/qwen3_next/modeling_qwen3_next.py``): the
#: Gated-DeltaNet's ``in_proj_qkvz`` and ``in_proj_ba``, and the gated attention's ``q_proj``. torchtitan's
#: ``wqkv`` (``models/common/attention.py``, ``FusedQKVLinear``; ``AllGatherFusedQKVLinear`` its subclass in
#: ``dist_gemm.py``): rows ``(n_kv, heads_per_kv + 2, head_dim)``, each KV group's q heads, then its k and v.
INTERLEAVED_BLOCKS: dict[tuple[str, str], Callable[[nn.Module], str]] = {
    ("Qwen3NextGatedDeltaNet", "in_proj_qkvz"): _qwen3_next_qkvz,
    ("Qwen3NextGatedDeltaNet", "in_proj_ba"): _qwen3_next_ba,
    ("Qwen3NextAttention", "q_proj"): _gated_query,
    ("FusedQKVLinear", "wqkv"): _torchtitan_wqkv,
    ("AllGatherFusedQKVLinear", "wqkv"): _torchtitan_wqkv,
}
#: Names of projections known to be fused, for the modules whose layout is not in
#: :data:`FUSED_LAYOUTS` (GPT-NeoX and Falcon interleave q, k, v per head; Baichuan's ``W_pack``,
#: MLA, Mamba-style mixers and GLU inputs of other families; torchtitan's ``wqkv`` elsewhere and its MLA
#: ``wkv_a``, ``split([kv_lora_rank, qk_rope_head_dim])`` in ``models/deepseek_v3/model.py``): kept whole and listed.
FUSED_NAMES = re.compile(
    r"(^|\.)(qkv_proj|query_key_value|c_attn|gate_up_proj|W_pack|Wqkv|wqkv|qkv|in_proj|x_proj|kv_a_proj_with_mqa"
    r"|wkv_a|Wi|input_linear|wi_gate_up)$")


def _fused_route(mname: str, parent: nn.Module | None, view: str, rows: int) -> Route:
    leaf = mname.rsplit(".", 1)[-1]
    layout = FUSED_LAYOUTS.get((type(parent).__name__, leaf)) if parent is not None else None
    interleaved = INTERLEAVED_BLOCKS.get((type(parent).__name__, leaf)) if parent is not None else None
    if interleaved is not None:
        return Route(view, note=interleaved(parent))
    if layout is not None:
        blocks = tuple(layout(parent, rows))
        if sum(blocks) == rows:  # one block: read, and not fused
            return Route(view, blocks if len(blocks) > 1 else None)
    if FUSED_NAMES.search(mname):
        owner = type(parent).__name__ if parent is not None else "?"
        return Route(view, note=f"fused layout of {owner} not read: kept whole")
    return Route(view)


def _mha_route(module: nn.Module, pname: str, p: torch.Tensor) -> Route:
    """``nn.MultiheadAttention``'s ``in_proj_weight`` ``(3E, E)``: q, k, v contiguous (its forward
    chunks it in three) when q, k, v share the embedding size."""
    if pname == "in_proj_weight" and module._qkv_same_embed_dim:
        return Route("matrix", (module.embed_dim,) * 3)
    return Route()


# ---- everything ------------------------------------------------------------------------------------

#: Mamba-family mixers (``MambaMixer``, ``Mamba2Mixer``, ``JambaMambaMixer``, ...) hold the SSM state
#: matrix as ``A_log`` (``A = -exp(A_log)``, one decay per channel and state): a table of elementwise
#: parameters, not a linear map. The families' own training code keeps it out of the matrix rules
#: (state-spaces/mamba marks ``A_log`` and ``D`` ``_no_weight_decay`` and trains them with AdamW).
SSM_STATE = re.compile(r"Mixer$")


def declared_view(mname: str, module: nn.Module, parent: nn.Module | None, pname: str,
                  p: torch.Tensor) -> Route:
    """The declared view of a >=2-D parameter ``pname`` of ``module`` (named ``mname``)."""
    if pname == "A_log" and SSM_STATE.search(type(module).__name__):
        return Route(kind="vector")
    if isinstance(module, nn.MultiheadAttention):
        return _mha_route(module, pname, p)
    if _is_experts(module):
        route = _experts_route(module, pname, p)
        if p.ndim >= 3 and route.split is None and not route.note:  # a fused stack (JetMoE's input_linear)
            rows = p.shape[-1] if route.view == "stacked-transposed" else p.shape[-2]
            route = _fused_route(mname, parent, route.view, rows)
        return route
    folded = _folded_route(module, pname, p)
    if folded is not None:
        return folded
    if isinstance(module, nn.modules.conv._ConvNd):
        return _fused_route(mname, parent, "matrix", p.shape[0])
    if is_conv1d(module):
        return _fused_route(mname, parent, "transposed", p.shape[1])
    if p.ndim >= 3:
        return Route("stacked")
    return _fused_route(mname, parent, "matrix", p.shape[0])
