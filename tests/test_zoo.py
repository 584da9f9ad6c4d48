"""A transformers zoo: tiny random-init models of the kinds users train.

Dense (Llama, Mistral, Qwen2, Gemma2 tied, OPT tied with learned positions), fused (Phi3, GPT-2,
ModernBERT, DBRX split; GPT-NeoX, Falcon kept whole), Qwen3-Next (Gated-DeltaNet: conv1d split, in_proj_qkvz /
in_proj_ba and the gated q_proj kept whole and listed), MoE (Mixtral, Qwen2-MoE, Qwen3-MoE; DBRX with
experts folded into 2-D tensors, GPT-OSS with per-expert biases, Llama 4 with (in, out) experts),
encoder (BERT, ModernBERT), encoder-decoder (T5), vision (ViT), vision-language (CLIP, 0-D
``logit_scale``), state-space (Mamba, Mamba2), hybrid linear attention (Qwen3-Next): 23 architectures; the
factories are in ``tests/zoo.py``. No downloads. An architecture the installed transformers lacks is skipped.

- Routing: every trainable tensor lands in exactly one group of :func:`meqmuon.param_groups`, with the
  kind, view, split (and folds) of the per-architecture table below (regex on the HF parameter name
  -> ``(kind, view, split[, folds])``; every parameter must match exactly one regex and every regex
  some parameter, so a new or renamed parameter fails). A failure prints the whole actual routing.
- Fused tensors: every tensor a model uses as several blocks (``FUSED``) is split, or kept whole and
  listed with its reason under "Fused tensors kept whole" by ``describe_groups`` (GPT-NeoX's and
  Falcon's ``query_key_value`` interleave q, k, v per head); nothing
  else is listed, and no model that declares no head (CLIP) is warned about a missing one.
- View exactness: the views read from DBRX (folded experts, both orientations), GPT-OSS (per-expert
  bias vectors, (in, out) experts, gate / up in alternate rows), Llama 4 (gate | up halves) and
  ModernBERT (q | k | v) equal the blocks held as separate parameters to 1e-5 with float32
  Newton-Schulz, per-tensor and batched, and block 0's update moves by < 1e-6 when only block 1's
  gradient changes.
- Training: meqmuon, muon, normuon and muoneq-r take 10 steps on a fixed batch, per-tensor and
  batched (``foreach=False/True``): losses finite and falling, no NaN in the parameters, and the two
  step implementations follow the same loss trajectory.
"""

from __future__ import annotations

import copy
import functools
import math
import re

import pytest
import torch

pytest.importorskip("transformers")

# tests/capabilities.py and tests/zoo.py (pytest puts tests/ on sys.path)
from capabilities import ONE_PER_HIDDEN_RULE  # noqa: E402
from zoo import ZOO, Missing  # noqa: E402

import meqmuon  # noqa: E402
from meqmuon.optim.factory import build_optimizer  # noqa: E402

# --------------------------------------------------------------------------------------- tables

# (kind, view, split). ``view``: "matrix" = one (shape[0], prod(rest)) matrix (2-D weights,
# convolution kernels, and every vector-kind tensor); "stacked" = a batch of matrices over the
# leading dims (MoE experts (E, out, in)); "transposed" = GPT-2 Conv1D weight stored (in, out);
# "stacked-transposed". ``split``: None or the row-block sizes of the (transposed) matrix.
VECTOR = ("vector", "matrix", None)
HIDDEN = ("hidden", "matrix", None)
EMBEDDING = ("embedding", "matrix", None)
HEAD = ("head", "matrix", None)

ATTENTION = r"self_attn\.(q|k|v|o)_proj\.weight$"
NORM = r"norm\.weight$"


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def llama_routes(c) -> dict:
    return {
        r"embed_tokens\.weight$": EMBEDDING,
        r"^lm_head\.weight$": HEAD,
        ATTENTION: HIDDEN,
        r"mlp\.(gate|up|down)_proj\.weight$": HIDDEN,
        NORM: VECTOR,
    }


def qwen2_routes(c) -> dict:
    return {**llama_routes(c), r"self_attn\.(q|k|v)_proj\.bias$": VECTOR}


def gemma2_routes(c) -> dict:  # tied: no head group
    routes = llama_routes(c)
    del routes[r"^lm_head\.weight$"]
    return routes


def phi3_routes(c) -> dict:
    hd, inter = _head_dim(c), c.intermediate_size
    qkv = (c.num_attention_heads * hd, c.num_key_value_heads * hd, c.num_key_value_heads * hd)
    return {
        r"embed_tokens\.weight$": EMBEDDING,
        r"^lm_head\.weight$": HEAD,
        r"self_attn\.qkv_proj\.weight$": ("hidden", "matrix", qkv),
        r"self_attn\.o_proj\.weight$": HIDDEN,
        r"mlp\.gate_up_proj\.weight$": ("hidden", "matrix", (inter, inter)),
        r"mlp\.down_proj\.weight$": HIDDEN,
        NORM: VECTOR,
    }


def gpt2_routes(c) -> dict:  # tied wte / lm_head
    d = c.n_embd
    return {
        r"wte\.weight$": EMBEDDING,
        r"wpe\.weight$": EMBEDDING,
        r"attn\.c_attn\.weight$": ("hidden", "transposed", (d, d, d)),
        r"(attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$": ("hidden", "transposed", None),
        r"\.(c_attn|c_proj|c_fc)\.bias$": VECTOR,
        r"ln_(1|2|f)\.(weight|bias)$": VECTOR,
    }


def mistral_routes(c) -> dict:
    return llama_routes(c)


# Fused query_key_value whose layout interleaves heads: never guessed, one whole hidden matrix.
KEPT_WHOLE = r"query_key_value\.weight$"


def gpt_neox_routes(c) -> dict:
    return {
        r"embed_in\.weight$": EMBEDDING,
        r"^(lm_head|embed_out)\.weight$": HEAD,
        KEPT_WHOLE: HIDDEN,
        r"(attention\.dense|mlp\.dense_h_to_4h|mlp\.dense_4h_to_h)\.weight$": HIDDEN,
        r"(query_key_value|dense|dense_h_to_4h|dense_4h_to_h)\.bias$": VECTOR,
        r"(layernorm|layer_norm)\.(weight|bias)$": VECTOR,
    }


def falcon_routes(c) -> dict:  # tied word_embeddings / lm_head; no biases in the linears (config default)
    return {
        r"word_embeddings\.weight$": EMBEDDING,
        KEPT_WHOLE: HIDDEN,
        r"(self_attention\.dense|mlp\.dense_h_to_4h|mlp\.dense_4h_to_h)\.weight$": HIDDEN,
        r"(layernorm|ln_f|ln_attn|ln_mlp)\.(weight|bias)$": VECTOR,
    }


def opt_routes(c) -> dict:  # tied embed_tokens / lm_head (OPTConfig default)
    return {
        r"embed_tokens\.weight$": EMBEDDING,
        r"embed_positions\.weight$": EMBEDDING,  # OPTLearnedPositionalEmbedding, an nn.Embedding
        r"self_attn\.(q|k|v|out)_proj\.weight$": HIDDEN,
        r"\.fc(1|2)\.weight$": HIDDEN,
        r"(self_attn\.(q|k|v|out)_proj|fc1|fc2)\.bias$": VECTOR,
        r"layer_norm\.(weight|bias)$": VECTOR,
    }


def _moe_routes(c, expert_inter: int) -> dict:
    return {
        r"embed_tokens\.weight$": EMBEDDING,
        r"^lm_head\.weight$": HEAD,
        ATTENTION: HIDDEN,
        r"mlp\.gate\.weight$": HIDDEN,  # the router, (E, d)
        r"mlp\.experts\.gate_up_proj$": ("hidden", "stacked", (expert_inter, expert_inter)),  # (E, 2I, d)
        r"mlp\.experts\.down_proj$": ("hidden", "stacked", None),  # (E, d, I)
        NORM: VECTOR,
    }


def mixtral_routes(c) -> dict:
    return _moe_routes(c, c.intermediate_size)


def qwen2_moe_routes(c) -> dict:
    return {
        **_moe_routes(c, c.moe_intermediate_size),
        r"self_attn\.(q|k|v)_proj\.bias$": VECTOR,
        r"mlp\.shared_expert\.(gate|up|down)_proj\.weight$": HIDDEN,
        r"mlp\.shared_expert_gate\.weight$": VECTOR,  # (1, d): a vector in disguise, no sign update
    }


def qwen3_moe_routes(c) -> dict:  # q_norm / k_norm fall under NORM
    return _moe_routes(c, c.moe_intermediate_size)


def bert_routes(c) -> dict:  # word embeddings tied with cls.predictions.decoder; MLM has no pooler
    return {
        r"embeddings\.(word|position|token_type)_embeddings\.weight$": EMBEDDING,
        r"\.(query|key|value|dense)\.weight$": HIDDEN,
        r"\.(query|key|value|dense)\.bias$": VECTOR,
        r"LayerNorm\.(weight|bias)$": VECTOR,
        r"^cls\.predictions\.bias$": VECTOR,
    }


def t5_routes(c) -> dict:  # transformers 5 always ties lm_head to shared (T5Config forces it)
    return {
        r"^shared\.weight$": EMBEDDING,
        r"relative_attention_bias\.weight$": EMBEDDING,  # an nn.Embedding (buckets, heads)
        r"(SelfAttention|EncDecAttention)\.(q|k|v|o)\.weight$": HIDDEN,
        r"DenseReluDense\.(wi|wo|wi_0|wi_1)\.weight$": HIDDEN,
        r"layer_norm\.weight$": VECTOR,
    }


def vit_routes(c) -> dict:
    return {
        r"embeddings\.cls_token$": VECTOR,  # (1, 1, d)
        r"embeddings\.position_embeddings$": ("embedding", "stacked", None),  # (1, N, d)
        r"patch_embeddings\.projection\.weight$": EMBEDDING,  # Conv2d, get_input_embeddings()
        r"patch_embeddings\.projection\.bias$": VECTOR,
        r"attention\.(q|k|v|o)_proj\.weight$": HIDDEN,
        r"mlp\.fc(1|2)\.weight$": HIDDEN,
        r"(attention\.(q|k|v|o)_proj|mlp\.fc(1|2))\.bias$": VECTOR,
        r"layernorm(_before|_after)?\.(weight|bias)$": VECTOR,
        r"^classifier\.weight$": HEAD,
        r"^classifier\.bias$": VECTOR,
    }


def mamba_routes(c) -> dict:  # tied embeddings / lm_head (MambaConfig default)
    inner, n = c.intermediate_size, c.state_size
    return {
        r"embeddings\.weight$": EMBEDDING,
        r"mixer\.in_proj\.weight$": ("hidden", "matrix", (inner, inner)),  # chunk(2): x, z
        r"mixer\.x_proj\.weight$": ("hidden", "matrix", (c.time_step_rank, n, n)),  # dt, B, C
        r"mixer\.(dt_proj|out_proj)\.weight$": HIDDEN,
        r"mixer\.conv1d\.weight$": HIDDEN,  # (d_inner, 1, k) depthwise convolution
        r"mixer\.A_log$": VECTOR,  # (d_inner, state): elementwise decays, not a linear map
        r"mixer\.D$": VECTOR,
        r"mixer\.(conv1d|dt_proj)\.bias$": VECTOR,
        r"norm(_f)?\.weight$": VECTOR,
    }


def dbrx_routes(c) -> dict:
    d, experts = c.d_model, c.ffn_config.moe_num_experts
    kv = c.attn_config.kv_n_heads * d // c.n_heads
    return {
        r"wte\.weight$": EMBEDDING,
        r"^lm_head\.weight$": HEAD,
        r"attn\.Wqkv\.weight$": ("hidden", "matrix", (d, kv, kv)),
        r"attn\.out_proj\.weight$": HIDDEN,
        r"ffn\.router\.layer\.weight$": HIDDEN,
        r"experts\.mlp\.(w1|v1)$": ("hidden", "stacked", None, experts),  # (E * ffn, d): (out, in) blocks
        r"experts\.mlp\.w2$": ("hidden", "stacked-transposed", None, experts),  # x @ w2[e]: (in, out) blocks
        r"norm_(1|2|f)\.weight$": VECTOR,
    }


def gpt_oss_routes(c) -> dict:
    return {
        r"embed_tokens\.weight$": EMBEDDING,
        r"^lm_head\.weight$": HEAD,
        ATTENTION: HIDDEN,
        r"self_attn\.(q|k|v|o)_proj\.bias$": VECTOR,
        r"self_attn\.sinks$": VECTOR,
        r"mlp\.router\.weight$": HIDDEN,
        r"mlp\.router\.bias$": VECTOR,
        r"experts\.gate_up_proj$": ("hidden", "stacked-transposed", (c.intermediate_size,) * 2, None, True),  # ::2
        r"experts\.down_proj$": ("hidden", "stacked-transposed", None),
        r"experts\.(gate_up|down)_proj_bias$": ("vector", "vectors", None),  # (E, k): one bias per expert
        NORM: VECTOR,
    }


def llama4_routes(c) -> dict:
    inter = c.intermediate_size
    return {
        r"embed_tokens\.weight$": EMBEDDING,
        r"^lm_head\.weight$": HEAD,
        ATTENTION: HIDDEN,
        r"experts\.gate_up_proj$": ("hidden", "stacked-transposed", (inter, inter)),  # chunk(2): halves
        r"experts\.down_proj$": ("hidden", "stacked-transposed", None),
        r"feed_forward\.router\.weight$": HIDDEN,
        r"shared_expert\.(gate|up|down)_proj\.weight$": HIDDEN,
        NORM: VECTOR,
    }


def modernbert_routes(c) -> dict:  # tied decoder / tok_embeddings; no linear biases (config default)
    d, inter = c.hidden_size, c.intermediate_size
    return {
        r"tok_embeddings\.weight$": EMBEDDING,
        r"attn\.Wqkv\.weight$": ("hidden", "matrix", (d, d, d)),  # view(..., 3, heads, head_dim)
        r"mlp\.Wi\.weight$": ("hidden", "matrix", (inter, inter)),  # chunk(2): input, gate
        r"(attn|mlp)\.Wo\.weight$": HIDDEN,
        r"^head\.dense\.weight$": HIDDEN,  # the MLM transform before the tied decoder
        r"norm\.weight$": VECTOR,
        r"^decoder\.bias$": VECTOR,
    }


def clip_routes(c) -> dict:  # two towers, projections (hidden), no LM head
    return {
        r"(token|position)_embedding\.weight$": EMBEDDING,
        r"patch_embedding\.weight$": EMBEDDING,  # Conv2d of CLIPVisionEmbeddings: the input layer, as ViT's
        r"class_embedding$": VECTOR,
        r"self_attn\.(q|k|v|out)_proj\.weight$": HIDDEN,
        r"mlp\.fc(1|2)\.weight$": HIDDEN,
        r"(self_attn\.(q|k|v|out)_proj|mlp\.fc(1|2))\.bias$": VECTOR,
        r"(layer_norm(1|2)|final_layer_norm|pre_layrnorm|post_layernorm)\.(weight|bias)$": VECTOR,
        r"^(visual|text)_projection\.weight$": HIDDEN,
        r"^logit_scale$": VECTOR,  # 0-D
    }


def mamba2_routes(c) -> dict:  # tied embeddings / lm_head
    inner, groups, heads = c.expand * c.hidden_size, c.n_groups * c.state_size, c.num_heads
    return {
        r"embeddings\.weight$": EMBEDDING,
        r"mixer\.in_proj\.weight$": ("hidden", "matrix", (inner, inner, groups, groups, heads)),  # z, x, B, C, dt
        r"mixer\.conv1d\.weight$": ("hidden", "matrix", (inner, groups, groups)),  # depthwise over x, B, C
        r"mixer\.out_proj\.weight$": HIDDEN,
        r"mixer\.(A_log|D|dt_bias)$": VECTOR,  # (heads,)
        r"mixer\.conv1d\.bias$": VECTOR,
        r"norm(_f)?\.weight$": VECTOR,
    }


def qwen3_next_routes(c) -> dict:  # layer 0 Gated-DeltaNet, layer 1 gated attention; MoE with a shared expert
    key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    routes = qwen2_moe_routes(c)
    del routes[r"self_attn\.(q|k|v)_proj\.bias$"]  # no attention biases
    return {
        **routes,
        # Kept whole and listed (q, k, v, z / b, a / query, gate interleaved per head).
        r"linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)\.weight$": HIDDEN,
        r"linear_attn\.conv1d\.weight$": ("hidden", "matrix", (key, key, value)),  # depthwise over q | k | v
        r"linear_attn\.(dt_bias|A_log)$": VECTOR,
    }


ROUTES = {
    "llama": llama_routes,
    "mistral": mistral_routes,
    "qwen2": qwen2_routes,
    "gemma2": gemma2_routes,
    "phi3": phi3_routes,
    "gpt2": gpt2_routes,
    "gpt_neox": gpt_neox_routes,
    "falcon": falcon_routes,
    "opt": opt_routes,
    "mixtral": mixtral_routes,
    "qwen2_moe": qwen2_moe_routes,
    "qwen3_moe": qwen3_moe_routes,
    "bert": bert_routes,
    "t5": t5_routes,
    "vit": vit_routes,
    "mamba": mamba_routes,
    "dbrx": dbrx_routes,
    "gpt_oss": gpt_oss_routes,
    "llama4": llama4_routes,
    "modernbert": modernbert_routes,
    "clip": clip_routes,
    "mamba2": mamba2_routes,
    "qwen3_next": qwen3_next_routes,
}

# The embedding tensor shared with the output head (its group has ``tied=True``), or None.
TIED = {
    "gemma2": r"^model\.embed_tokens\.weight$",
    "gpt2": r"^transformer\.wte\.weight$",
    "falcon": r"^transformer\.word_embeddings\.weight$",
    "opt": r"^model\.decoder\.embed_tokens\.weight$",
    "bert": r"^bert\.embeddings\.word_embeddings\.weight$",
    "t5": r"^shared\.weight$",
    "mamba": r"^backbone\.embeddings\.weight$",
    "modernbert": r"^model\.embeddings\.tok_embeddings\.weight$",
    "mamba2": r"^backbone\.embeddings\.weight$",
}

assert set(ROUTES) == set(ZOO)

#: One optimizer per hidden update (capabilities.py): Muon, NorMuon, MeqMuon, MuonEq.
OPTIMIZERS = tuple(ONE_PER_HIDDEN_RULE)
# One lr for all four: MeqMuon's step RMS is rho * lr = 2e-3 (loss falls ~25% in 10 steps); the
# baselines' AdamW parts (embedding/head/vectors) at 1e-2 drop it ~60%. Both far from the edge.
LR = dict.fromkeys(OPTIMIZERS, 1e-2)
# 6 steps, for the suite's time: every run's loss falls in them
STEPS = 6


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices gain nothing from intra-op threads, and on a shared, busy CPU two OpenMP threads
    spin-wait for each other: the file ran 350 s with 2 threads and ~30 s with 1 under load 6 on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _base(arch: str):
    return ZOO[arch]()


def _model(arch: str):
    """A fresh copy of the cached tiny model and its fixed batch; skip what transformers lacks."""
    try:
        model, batch = _base(arch)
    except Missing as e:
        pytest.skip(str(e))
    return copy.deepcopy(model), batch


# -------------------------------------------------------------------------------------- routing

MISSING = "<missing>"


def _matrix_rows(p: torch.Tensor, view: str) -> int | None:
    """Rows of the matrix a split refers to under ``view``."""
    if view == "matrix":
        return p.shape[0]
    if view == "stacked":
        return p.shape[-2]
    if view in ("transposed", "stacked-transposed"):
        return p.shape[-1]
    return None


def _actual_routing(groups: list[dict]) -> list[dict]:
    rows = []
    for g in groups:
        n = len(g["params"])
        views, splits = g.get("views", [MISSING] * n), g.get("splits", [MISSING] * n)
        folds = g.get("folds", [None] * n)
        interleaved = g.get("interleaved", [False] * n)
        for i, (name, p) in enumerate(zip(g["names"], g["params"], strict=True)):
            split = splits[i] if i < len(splits) else MISSING
            rows.append({
                "name": name,
                "param": p,
                "kind": g["kind"],
                "view": views[i] if i < len(views) else MISSING,
                "split": tuple(split) if isinstance(split, list | tuple) else split,
                "folds": folds[i] if i < len(folds) else MISSING,
                "interleaved": interleaved[i] if i < len(interleaved) else MISSING,
                "tied": bool(g.get("tied")),
            })
    return rows


def _entry(route: tuple) -> tuple:
    """A table entry as ``(kind, view, split, folds, interleaved)``; ``folds`` (experts folded into a
    2-D tensor's rows, DBRX) and ``interleaved`` (the split's blocks alternate rows, GPT-OSS) are left
    out of most entries."""
    return (*route, *(None, False)[len(route) - 3:])


def _got(r: dict) -> tuple:
    return (r["kind"], r["view"], r["split"], r["folds"], r["interleaved"])


def _format(rows: list[dict], expected: dict[str, tuple | None]) -> str:
    lines = [f"{'name':62s} {'shape':15s} {'kind':9s} {'view':18s} {'split':14s} tied  expected"]
    for r in rows:
        exp = expected.get(r["name"])
        exp_s = "(no rule)" if exp is None else ("ok" if exp == _got(r) else str(exp))
        lines.append(
            f"{r['name']:62s} {str(tuple(r['param'].shape)):15s} {r['kind']:9s} {str(r['view']):18s} "
            f"{str(r['split']):14s} {'yes' if r['tied'] else 'no ':4s}  {exp_s}"
        )
    return "\n".join(lines)


@pytest.mark.parametrize("arch", list(ZOO))
def test_every_tensor_routed_once_with_the_expected_view(arch):
    model, _ = _model(arch)
    groups = meqmuon.param_groups(model)
    rows = _actual_routing(groups)
    problems: list[str] = []

    # Exactly once, by identity; nothing that is not a trainable parameter of the model.
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    seen: dict[int, str] = {}
    for r in rows:
        pid = id(r["param"])
        if pid in seen:
            problems.append(f"{r['name']} routed twice (also as {seen[pid]})")
        elif pid not in trainable:
            problems.append(f"{r['name']} routed but not a trainable parameter of the model")
        seen[pid] = r["name"]
    problems += [f"{n} not routed" for i, n in trainable.items() if i not in seen]

    for g in groups:
        for key in ("views", "splits"):
            if key not in g:
                problems.append(f"group kind={g['kind']} has no {key!r}")
            elif len(g[key]) != len(g["params"]):
                problems.append(f"group kind={g['kind']}: len({key})={len(g[key])} != len(params)={len(g['params'])}")

    # The table: every parameter matches exactly one rule, every rule some parameter.
    routes = ROUTES[arch](model.config)
    expected: dict[str, tuple | None] = {}
    used = dict.fromkeys(routes, 0)
    for r in rows:
        hits = [rx for rx in routes if re.search(rx, r["name"])]
        if len(hits) != 1:
            problems.append(f"{r['name']} matches {len(hits)} rules of the table: {hits}")
            expected[r["name"]] = None
            continue
        used[hits[0]] += 1
        exp = expected[r["name"]] = _entry(routes[hits[0]])
        kind, view, split, _, _ = exp
        if split is not None and sum(split) != _matrix_rows(r["param"], view):  # a wrong table entry
            problems.append(f"table: split {split} of {r['name']} {tuple(r['param'].shape)} does not fit view {view}")
        if _got(r) != exp:
            problems.append(f"{r['name']}: got {_got(r)}, expected {exp}")
    problems += [f"table rule {rx!r} matches no parameter" for rx, k in used.items() if k == 0]

    # Tying: the tied embedding's group says tied=True, every other group tied=False.
    tied_rx = TIED.get(arch)
    for g in groups:
        want = tied_rx is not None and any(re.search(tied_rx, n) for n in g["names"])
        if bool(g.get("tied")) != want:
            problems.append(f"group kind={g['kind']}: tied={g.get('tied')}, expected {want}")
    out = model.get_output_embeddings()
    model_tied = out is not None and out.weight is model.get_input_embeddings().weight
    assert model_tied == (tied_rx is not None), f"{arch}: TIED says {tied_rx!r}, the model is tied: {model_tied}"

    shown = problems[:40] + ([f"... and {len(problems) - 40} more"] if len(problems) > 40 else [])
    assert not problems, (
        f"{arch}: {len(problems)} routing problem(s):\n  " + "\n  ".join(shown)
        + "\n\nactual routing:\n" + _format(rows, expected)
    )


@pytest.mark.parametrize("arch", ["gpt_neox", "falcon"])
def test_interleaved_fused_qkv_is_kept_whole_and_described(arch):
    """GPT-NeoX and Falcon interleave q, k, v per head in ``query_key_value``: the package does not
    guess that layout, so the tensor stays one unsplit hidden matrix, and ``describe_groups`` says so."""
    model, _ = _model(arch)
    groups = meqmuon.param_groups(model)
    (hidden,) = [g for g in groups if g["kind"] == "hidden"]
    fused = [n for n in hidden["names"] if re.search(KEPT_WHOLE, n)]
    assert len(fused) == model.config.num_hidden_layers, hidden["names"]
    owner = type(model.get_submodule(fused[0].rsplit(".", 2)[0])).__name__  # GPTNeoXAttention, FalconAttention
    assert sorted(hidden.get("notes", {})) == sorted(fused), hidden.get("notes")
    text = meqmuon.describe_groups(groups)
    assert "Fused tensors kept whole:" in text, text
    for n in fused:
        i = hidden["names"].index(n)
        assert (hidden["views"][i], hidden["splits"][i]) == ("matrix", None)
        assert f"- {n}: fused layout of {owner} not read: kept whole" in text, text
        assert f"- {n} (" not in text, text  # not listed among the split / non-whole matrix views


#: Tensors each model uses as several blocks (read from its forward): each must be split (or its
#: experts folded) or listed, with its reason, under "Fused tensors kept whole" by describe_groups.
FUSED = {
    "phi3": r"(qkv_proj|gate_up_proj)\.weight$",
    "gpt2": r"attn\.c_attn\.weight$",
    "gpt_neox": KEPT_WHOLE,
    "falcon": KEPT_WHOLE,
    "mixtral": r"experts\.gate_up_proj$",
    "qwen2_moe": r"experts\.gate_up_proj$",
    "qwen3_moe": r"experts\.gate_up_proj$",
    "mamba": r"mixer\.(in_proj|x_proj)\.weight$",
    "dbrx": r"(Wqkv\.weight|experts\.mlp\.(w1|v1|w2))$",
    "gpt_oss": r"experts\.gate_up_proj(_bias)?$",
    "llama4": r"experts\.gate_up_proj$",
    "modernbert": r"(Wqkv|Wi)\.weight$",
    "mamba2": r"mixer\.(in_proj|conv1d)\.weight$",
    "qwen3_next": r"(linear_attn\.(in_proj_qkvz|in_proj_ba|conv1d)\.weight|self_attn\.q_proj\.weight"
                  r"|experts\.gate_up_proj)$",
}


@pytest.mark.parametrize("arch", list(ZOO))
def test_every_fused_tensor_is_split_or_listed(arch):
    """A tensor the model uses as several blocks is split, or kept whole and listed with its reason;
    nothing else is listed."""
    model, _ = _model(arch)
    groups = meqmuon.param_groups(model)
    text = meqmuon.describe_groups(groups)
    rows = _actual_routing(groups)
    notes = {n: why for g in groups for n, why in g.get("notes", {}).items()}
    fused = [r for r in rows if FUSED.get(arch) and re.search(FUSED[arch], r["name"])]
    assert len(fused) >= model.config.get_text_config().num_hidden_layers or arch not in FUSED, fused
    for r in fused:
        split = r["split"] is not None or r["folds"] is not None
        assert split or r["name"] in notes, f"{arch}: {r['name']} used as several blocks, neither split nor listed"
    for name, why in notes.items():
        assert FUSED.get(arch) and re.search(FUSED[arch], name), f"{arch}: {name} listed but not fused"
        assert f"- {name}: {why}" in text and why, text
    assert ("Fused tensors kept whole:" in text) == bool(notes), text
    # A model that declares no output head (CLIP: projections) gets no missing-head warning.
    assert "no recognised output head" not in text, text


def _blocks_of(arch: str, name: str, t: torch.Tensor, c) -> list[torch.Tensor]:
    """The per-expert / per-block matrices (``(out, in)``) or vectors of ``t``, written from each
    model's forward, independently of the package's views: views of ``t``."""
    if arch == "dbrx":  # w.view(-1, ffn, d)[e]; x @ w1[e].T, x @ v1[e].T, h @ w2[e]
        e = t.view(-1, c.ffn_config.ffn_hidden_size, c.d_model).unbind(0)
        return [m.T for m in e] if name.endswith("w2") else list(e)
    if arch == "gpt_oss":
        if name.endswith("_bias"):  # gate_up @ W[e] + b[e]: one bias vector per expert
            return list(t.unbind(0))
        experts = [m.T for m in t.unbind(0)]  # x @ W[e]: stored (in, out)
        if name.endswith("gate_up_proj"):  # gate_up[..., ::2], gate_up[..., 1::2]
            return [h for m in experts for h in (m[0::2], m[1::2])]
        return experts
    if arch == "llama4":  # bmm(x, W) then chunk(2, dim=-1): gate | up halves of each (in, out) expert
        inter = c.intermediate_size
        return [h for m in t.unbind(0) for h in (m.T[:inter], m.T[inter:])]
    if arch == "modernbert":  # view(..., 3, heads, head_dim): q | k | v
        return list(t.chunk(3, dim=0))
    raise KeyError(arch)


VIEW_CASES = [("dbrx", r"blocks\.0\.ffn\.experts\.mlp\.w1$"), ("dbrx", r"blocks\.0\.ffn\.experts\.mlp\.w2$"),
              ("gpt_oss", r"layers\.0\.mlp\.experts\.gate_up_proj_bias$"),
              ("gpt_oss", r"layers\.0\.mlp\.experts\.down_proj_bias$"),
              ("gpt_oss", r"layers\.0\.mlp\.experts\.down_proj$"),
              ("gpt_oss", r"layers\.0\.mlp\.experts\.gate_up_proj$"),
              ("llama4", r"layers\.0\.feed_forward\.experts\.gate_up_proj$"),
              ("modernbert", r"layers\.0\.attn\.Wqkv\.weight$")]


def _step_views(name: str, group: dict, tensors: list, grads_of, foreach: bool) -> None:
    hp = {"ns_dtype": torch.float32} if name != "scale" else {}
    if "clip_norm" in meqmuon.valid_hyperparameters(name):  # a recipe's global clipping couples every gradient by
        hp["clip_norm"] = None  # design (tests/test_recipes_2026.py); the views' independence is the update rule's
    opt = build_optimizer(name, [group], lr=2e-2, weight_decay=0.1, foreach=foreach, **hp)
    for step in range(3):
        for t, g in zip(tensors, grads_of(step), strict=True):
            t.grad = g
        opt.step()


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(("arch", "pattern"), VIEW_CASES)
def test_detected_views_equal_separate_twins(arch, pattern, foreach):
    """The view ``param_groups`` reads from each model equals the tensor's blocks held as separate
    parameters (per-expert ``nn.Linear`` weights, per-expert bias vectors, Llama 4's gate/up halves as
    with ``splits=(I, I)``, ModernBERT's q/k/v) to 1e-5 (float32 Newton-Schulz), and block 0 moves by
    < 1e-6 (relative) when only block 1's gradient changes (expert 1, for DBRX and GPT-OSS)."""
    model, _ = _model(arch)
    groups = meqmuon.param_groups(model)
    (r,) = [r for r in _actual_routing(groups) if re.search(pattern, r["name"])]
    start = r["param"].detach().clone()
    blocks = functools.partial(_blocks_of, arch, r["name"], c=model.config)
    kind = r["kind"]
    def grads(step, bump=1.0):
        g = torch.randn(start.shape, generator=torch.Generator().manual_seed(step))
        blocks(g)[1].mul_(bump)  # a view: only block 1 changes
        return g

    def run(name, bump=1.0):
        t = torch.nn.Parameter(start.clone())
        group = {"params": [t], "kind": kind, "names": [r["name"]], "views": [r["view"]],
                 "splits": [r["split"]], "folds": [r["folds"]], "interleaved": [r["interleaved"]]}
        _step_views(name, group, [t], lambda step: [grads(step, bump)], foreach)
        return t.detach()

    for name in OPTIMIZERS:
        got, bumped = run(name), run(name, -3.0)
        twins = [torch.nn.Parameter(b.clone()) for b in blocks(start)]
        _step_views(name, {"params": twins, "kind": kind}, twins,
                    lambda step: [b.contiguous() for b in blocks(grads(step))], foreach)
        # MuonH rescales the whole weight to its radius each step (W <- W' ||W|| / ||W'||), so a float32
        # norm summed in another order (a strided view against its contiguous twin) moves every entry by
        # ~1 ulp of W, which against a step of lr ||W|| is ~2e-5 here (Llama 4's gate/up halves, GPT-OSS)
        tol = 1e-4 if name.startswith("muonh") else 1e-5
        for j, (a, twin, init) in enumerate(zip(blocks(got), twins, blocks(start), strict=True)):
            moved = (twin.detach() - init).norm()
            assert moved > 0 and ((a - twin.detach()).norm() / moved).item() <= tol, (name, j)
        moved0 = (blocks(got)[0] - blocks(start)[0]).norm()
        assert ((blocks(bumped)[0] - blocks(got)[0]).norm() / moved0).item() < 1e-6, name


# ------------------------------------------------------------------------------------- training


def _train(model, batch, name: str, foreach: bool) -> list[float]:
    opt = build_optimizer(name, model, lr=LR[name], foreach=foreach)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
    return losses


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("arch", list(ZOO))
def test_trains_per_tensor_and_batched(arch, name):
    runs = {}
    for foreach in (False, True):
        model, batch = _model(arch)
        losses = _train(model, batch, name, foreach)
        label = f"{arch} {name} foreach={foreach}"
        assert all(math.isfinite(v) for v in losses), f"{label}: non-finite loss {losses}"
        assert losses[-1] < losses[0], f"{label}: loss did not fall {losses}"
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        assert not bad, f"{label}: non-finite parameters {bad}"
        runs[foreach] = losses
    # The batched step is the per-tensor step, regrouped: same trajectory up to rounding (bf16
    # Newton-Schulz where the CPU has it; observed differences <= 3e-3).
    gap = max(abs(a - b) for a, b in zip(runs[False], runs[True], strict=True))
    assert gap < 3e-2, f"{arch} {name}: per-tensor {runs[False]} vs batched {runs[True]}"
