"""meqmuon in torchtitan (issue 57): ``meqmuon.integrations.torchtitan`` on torchtitan's own classes.

torchtitan 0.3.0 (the release on PyPI) is an optional extra: the tests that need it skip where it does not
import. ``.ci/run`` installs it into a virtual environment of its own and runs this file there: pip's
resolver would replace the environment's ``datasets`` (torchtitan pins ``datasets<4.8``), and on a CPU-only
torch it needs ``triton``, which it imports (``distributed/minimal_async_ep/kernels.py``) but does not declare.

torchtitan's ``Trainer`` does not run on a CPU, so its classes run here directly: its model classes (llama3,
qwen3, qwen3's MoE), its own parallelisation (``Module.parallelize`` for TP, ``apply_fsdp_to_decoder`` for
FSDP2, and both on a MoE), ``MeqMuonOptimizers`` (a torchtitan ``OptimizersContainer``),
``LRSchedulersContainer`` and the DCP ``CheckpointManager``, on gloo. Three substitutions, each in :func:`_built` /
:func:`_parallelize`, none of them in what the optimizer sees:

- causal SDPA for the parameter-free FlexAttention (``FlexAttention does not support backward on CPU``);
- ``torchtitan.distributed.parallel_dims.device_type = "cpu"`` (``tools/utils.get_device_info`` answers
  "cuda" where torch finds no accelerator);
- FSDP2's reduce-scatter as a sum (``set_force_sum_reduction_for_comms``): torchtitan sets a gradient divide
  factor of 1.0, for which FSDP2 reduces with ``PREMUL_SUM``, which gloo lacks; the sum is what that factor
  asks for (torchtitan divides the loss by the global token count, as :func:`_loss` does).

Routing: torchtitan's ``wqkv`` (``FusedQKVLinear``) holds each KV group's q heads, then its k and v rows; no
row view gives the unfused ``wq``, ``wk``, ``wv``, and blocks per KV group are farther from them than the
whole matrix (docs/torchtitan.md), so it is kept whole and listed; every other tensor is routed as in the
unfused model (torchtitan's own ``QKVLinear``), and updated bit for bit as there.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_distributed import _spawn
from tinynet import batches, loss_fn, make_model
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import meqmuon
from meqmuon.integrations.torchtitan import build_meqmuon

REPO = Path(__file__).resolve().parents[1]
try:
    import torchtitan  # noqa: F401

    TITAN = None
except ImportError as e:  # triton missing on a CPU-only torch is an ImportError too
    TITAN = f"torchtitan does not import ({e}); .ci/run installs it in a venv of its own"
titan = pytest.mark.skipif(TITAN is not None, reason=TITAN or "")

#: The batches of the training tests: 4 updates of 4 sequences of 32 tokens; DCP saves after update SAVE.
STEPS, SAVE, VOCAB = 4, 2, 2048
KW = {"ns_dtype": torch.float32}  # exactness tests pin float32 Newton-Schulz


# ---- without torchtitan: the module, the groups it builds -----------------------------------------------


def test_import_does_not_import_torchtitan():
    """``import meqmuon.integrations.torchtitan`` and :func:`build_meqmuon` need torch and meqmuon only."""
    code = ("import sys, meqmuon.integrations.torchtitan as t; assert callable(t.build_meqmuon); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torchtitan', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out


@pytest.mark.skipif(TITAN is None, reason="torchtitan imports here")
def test_container_without_torchtitan_says_what_to_install():
    with pytest.raises(ImportError, match=r"pip install 'meqmuon\[torchtitan\]'"):
        from meqmuon.integrations.torchtitan import MeqMuonOptimizers  # noqa: F401


def test_build_meqmuon_groups_carry_torchtitans_keys():
    """``param_names`` without the activation-checkpoint wrapper (torchtitan's ``canonical_fqn``), ``foreach``
    from ``implementation``; the zero-gradient ``lr=0`` step (``init_optim_state``) changes nothing; the flat
    state dict round trip (``flatten_optimizer_state_dict``, the checkpoint path of torchtitan before 0.3)."""
    model = make_model(torch.float32)
    model.up = checkpoint_wrapper(model.up)  # as torchtitan's activation checkpointing wraps blocks
    opt = build_meqmuon("meqmuon", model, "for-loop", lr=0.02, **KW)
    names = [n for g in opt.param_groups for n in g["param_names"]]
    assert "up._checkpoint_wrapped_module.weight" in dict(model.named_parameters())
    assert "up.weight" in names and not any("_checkpoint_wrapped_module" in n for n in names)
    assert {g["foreach"] for g in opt.param_groups} == {False}
    assert {g["foreach"] for g in build_meqmuon("muon", model, "foreach").param_groups} == {True}
    assert {g["foreach"] for g in build_meqmuon("muon", model).param_groups} == {None}  # "fused": meqmuon's choice
    with pytest.raises(ValueError, match="state_dtype"):
        build_meqmuon("meqmuon", model, "fused_opt_states_bf16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _init_optim_state(opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for ids in batches(2):
        opt.zero_grad()
        loss_fn(model, ids).backward()
        opt.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    saved = get_optimizer_state_dict(model, opt, options=flat)
    model.zero_grad(set_to_none=True)
    opt2 = build_meqmuon("meqmuon", model, "for-loop", lr=0.02, **KW)
    set_optimizer_state_dict(model, opt2, saved, options=flat)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[p][k]) if torch.is_tensor(v) else v == opt2.state[p][k], k


class FusedQKVLinear(nn.Module):
    """torchtitan's ``FusedQKVLinear`` as the routing reads it (its class name, ``heads_per_kv``, ``head_dim``,
    ``wqkv``), for the environments without torchtitan; the real one is tested below."""

    def __init__(self, dim: int, n_heads: int, n_kv: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim, self.heads_per_kv = head_dim, n_heads // n_kv
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv) * head_dim, bias=False)


def test_wqkv_kept_whole_and_output_is_the_head_offline():
    """A ``wqkv`` of a ``FusedQKVLinear`` is listed with its layout; a top-level ``output`` (torchtitan's
    decoders up to 0.2) is the head, an ``output`` deeper in the model is not."""
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(64, 32)
    model.qkv_linear = FusedQKVLinear(32, 8, 2, 4)
    model.block = nn.Module()
    model.block.output = nn.Linear(32, 32, bias=False)
    model.output = nn.Linear(32, 64, bias=False)
    groups = meqmuon.param_groups(model)
    kinds = {n: g["kind"] for g in groups for n in g["names"]}
    assert kinds == {"tok_embeddings.weight": "embedding", "qkv_linear.wqkv.weight": "hidden",
                     "block.output.weight": "hidden", "output.weight": "head"}
    text = meqmuon.describe_groups(groups)
    assert ("- qkv_linear.wqkv.weight: q, k, v interleaved per KV head (2 groups of 16, 4, 4 rows; torchtitan's "
            "FusedQKVLinear)") in text, text
    assert "no recognised output head" not in text


# ---- torchtitan's models: routing -------------------------------------------------------------------


def _registry(model: str):
    from torchtitan.models.llama3 import model_registry as llama3
    from torchtitan.models.qwen3 import model_registry as qwen3

    return {"llama3": llama3, "qwen3": qwen3}[model]


def _unfused(cfg):
    """``cfg`` (a decoder config) with every ``FusedQKVLinear`` replaced by torchtitan's ``QKVLinear`` of the
    same sizes (``make_gqa_config(fuse_qkv=False)``): the unfused twin."""
    from torchtitan.models.common.attention import FusedQKVLinear as Fused
    from torchtitan.models.common.attention import QKVLinear
    from torchtitan.models.common.linear import Linear

    cfg = copy.deepcopy(cfg)
    for layer in cfg.layers:
        q = layer.attention.qkv_linear
        assert isinstance(q, Fused.Config), type(q)
        kw = dict(in_features=q.wqkv.in_features, bias=q.wqkv.bias)
        layer.attention.qkv_linear = QKVLinear.Config(
            head_dim=q.head_dim, wq=Linear.Config(out_features=q.n_heads * q.head_dim, **kw),
            wkv=Linear.Config(out_features=q.n_kv_heads * q.head_dim, **kw))
    return cfg


def _routing(groups) -> dict[str, tuple]:
    """name -> (kind, view, split, folds, interleaved, note) of every tensor."""
    out = {}
    for g in groups:
        for i, n in enumerate(g["names"]):
            out[n] = (g["kind"], g["views"][i], g["splits"][i], (g.get("folds") or [None] * (i + 1))[i],
                      (g.get("interleaved") or [False] * (i + 1))[i], g.get("notes", {}).get(n))
    return out


#: torchtitan's models and flavours: llama3 (MHA debug model, GQA 8B), qwen3 (GQA, tied debug model), its MoE
#: (debug, and 30B-A3B), two decoder layers each, built on the meta device (routing reads shapes and modules).
FLAVOURS = [("llama3", "debugmodel"), ("llama3", "8B"), ("qwen3", "debugmodel"), ("qwen3", "debugmodel_moe"),
            ("qwen3", "30B-A3B")]
QKV = re.compile(r"qkv_linear\.(wqkv|wq|wk|wv)\.weight$")


@titan
@pytest.mark.parametrize(("model", "flavour"), FLAVOURS, ids=[f"{m}-{f}" for m, f in FLAVOURS])
def test_routing_is_the_unfused_twins_but_wqkv_listed(model, flavour):
    """Every tensor but ``wqkv`` is routed as in the unfused model; each ``wqkv`` is one hidden matrix, listed
    with its layout, and nothing else is listed; ``tok_embeddings`` is the embedding, ``lm_head`` the head
    (qwen3's debug model ties them); experts are stacks of ``(out, in)`` matrices."""
    cfg = _registry(model)(flavour).model
    cfg.layers = cfg.layers[:2]
    with torch.device("meta"):
        fused, twin = cfg.build(), _unfused(cfg).build()
    groups = meqmuon.param_groups(fused)
    a, b = _routing(groups), _routing(meqmuon.param_groups(twin))
    assert {n for n in a if not QKV.search(n)} == {n for n in b if not QKV.search(n)}
    for n, route in a.items():
        if not QKV.search(n):
            assert route == b[n], (n, route, b[n])
    for name in (n for n in b if QKV.search(n)):
        assert b[name] == ("hidden", "matrix", None, None, False, None), (name, b[name])
    text = meqmuon.describe_groups(groups)
    wqkv = [n for n in a if n.endswith("wqkv.weight")]
    assert len(wqkv) == 2
    listed = {n for g in groups for n in g.get("notes", {})}
    assert listed == set(wqkv), listed
    att = cfg.layers[0].attention.qkv_linear
    r, hd = att.n_heads // att.n_kv_heads, att.head_dim
    for n in wqkv:
        assert a[n][:5] == ("hidden", "matrix", None, None, False), a[n]
        assert (f"- {n}: q, k, v interleaved per KV head ({att.n_kv_heads} groups of {r * hd}, {hd}, {hd} rows; "
                "torchtitan's FusedQKVLinear)") in text, text
    assert a["tok_embeddings.weight"][0] == "embedding" and "no recognised output head" not in text
    if cfg.enable_weight_tying:
        assert "lm_head.weight" not in a and any(g.get("tied") for g in groups)
    else:
        assert a["lm_head.weight"][0] == "head"
    experts = [n for n in a if "inner_experts" in n]
    assert bool(experts) == ("moe" in flavour or "A3B" in flavour)
    for n in experts:  # torchtitan: x @ w1_EFD[e].T, h @ w2_EDF[e].T: each expert stored (out, in)
        assert a[n][:3] == ("hidden", "stacked", None), (n, a[n])


@titan
def test_wqkv_layout_is_torchtitans():
    """The layout the note states is the one torchtitan's own ``_split_qkv_on_save`` reads: row ``i`` of group
    ``g`` is a q row for ``i < heads_per_kv * head_dim``, then k, then v (GQA: 4 q heads per KV head)."""
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("8B").model
    cfg.layers = cfg.layers[:1]
    att_cfg = cfg.layers[0].attention
    att_cfg.dim = att_cfg.qkv_linear.wqkv.in_features = 64
    att_cfg.n_heads = att_cfg.qkv_linear.n_heads = 8
    att_cfg.n_kv_heads = att_cfg.qkv_linear.n_kv_heads = 2
    att_cfg.qkv_linear.head_dim = 4
    att_cfg.qkv_linear.wqkv.out_features = (8 + 2 * 2) * 4
    qkv = att_cfg.qkv_linear.build()
    with torch.no_grad():
        qkv.wqkv.weight.copy_(torch.arange(48.0)[:, None].expand(48, 64))
    sd = qkv.state_dict()
    rows = {k: sd[f"{k}.weight"][:, 0].long().tolist() for k in ("wq", "wk", "wv")}
    n_kv, r, hd = 2, 4, 4
    expect = {k: [g * (r + 2) * hd + o + i for g in range(n_kv) for i in range(size)]
              for k, o, size in (("wq", 0, r * hd), ("wk", r * hd, hd), ("wv", (r + 1) * hd, hd))}
    assert rows == expect


@titan
def test_gpt_oss_experts_gate_up_interleaved_and_biases_vectors():
    """torchtitan's GPT-OSS experts (``GptOssGroupedExperts``): ``mlp1_weight_EGD`` split per expert into the
    gate and up rows its ``swiglu`` reads (``x[..., ::2]``, ``x[..., 1::2]``: with the gate block zeroed through
    meqmuon's own views, torchtitan's swiglu gives 0), its per-expert biases are vectors; ``wqkv`` listed."""
    from torchtitan.models.gpt_oss import model_registry
    from torchtitan.models.gpt_oss.moe import swiglu

    from meqmuon.optim.views import group_layout

    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:1]
    with torch.device("meta"):
        model = cfg.build()
    groups = meqmuon.param_groups(model)
    route = _routing(groups)
    prefix = "layers.0.moe.routed_experts.inner_experts."
    assert route[prefix + "mlp1_weight_EGD"][:5] == ("hidden", "stacked", (2880, 2880), None, True)
    assert route[prefix + "mlp2_weight_EDF"][:3] == ("hidden", "stacked", None)
    for bias in ("mlp1_bias_EG", "mlp2_bias_ED"):
        assert route[prefix + bias][:2] == ("vector", "vectors"), route[prefix + bias]
    assert route["layers.0.attention.qkv_linear.wqkv.weight"][5].startswith("q, k, v interleaved per KV head")
    (hidden,) = [g for g in groups if g["kind"] == "hidden"]
    i = hidden["names"].index(prefix + "mlp1_weight_EGD")
    w = torch.randn(2, 8, 4)  # 2 experts of 2 x 4 gate and up rows, as the layout reads (E, 2F, D)
    layout = group_layout({**hidden, "splits": [None] * i + [(4, 4)] + [None] * (len(hidden["names"]) - i - 1)},
                          i, w.shape)
    for gate in layout.matrices(w)[0::2]:
        gate.zero_()
    x = torch.randn(5, 4)
    assert torch.equal(swiglu(x @ w[0].T), torch.zeros(5, 4)) and torch.equal(swiglu(x @ w[1].T), torch.zeros(5, 4))
    assert swiglu(x @ torch.randn(2, 8, 4)[0].T).abs().sum() > 0  # the control: not zero by itself


class _SDPA(nn.Module):
    """Causal SDPA in place of torchtitan's FlexAttention (no backward on a CPU), same call: ``(B, L, N, H)``
    tensors; under TP the heads of each rank (torchtitan's own local map does the same for FlexAttention)."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        from torch.distributed.tensor import DTensor

        d = q if isinstance(q, DTensor) else None
        if d is not None:
            q, k, v = q.to_local(), k.to_local(), v.to_local()
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=scale, enable_gqa=enable_gqa).transpose(1, 2)
        return DTensor.from_local(o, d.device_mesh, d.placements, run_check=False) if d is not None else o


def _one_layer(cfg):
    """A torchtitan decoder config cut to its first layer, RoPE's cache for 64 positions, not 131,072 (as
    ``training.seq_len`` sets it)."""
    cfg.layers = cfg.layers[:1]
    for layer in cfg.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=64)
    return cfg


def _built(cfg, seed: int, tp: int) -> nn.Module:
    """``cfg`` with the sharding configs a TP degree ``tp`` sets (``update_from_config``), built and given its own
    initialisation (``init_states``) from ``seed``, causal SDPA for its FlexAttention."""
    from torchtitan.config import ParallelismConfig

    cfg.update_from_config(config=types.SimpleNamespace(parallelism=ParallelismConfig(
        tensor_parallel_degree=tp, spmd_backend="partial_dtensor")))
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    for block in model.layers.values():
        block.attention.inner_attention = _SDPA()
    return model


def _llama(seed: int, tp: int = 1, fuse_qkv: bool = True) -> nn.Module:
    """torchtitan's llama3 debug model (dim 256, 16 heads, vocab 2,048), one layer (:func:`_one_layer`, :func:`_built`;
    the unfused twin without ``fuse_qkv``)."""
    from torchtitan.models.llama3 import model_registry

    cfg = _one_layer(model_registry("debugmodel").model)
    return _built(cfg if fuse_qkv else _unfused(cfg), seed, tp)


def _qwen3_moe(seed: int, tp: int = 1) -> nn.Module:
    """torchtitan's qwen3 MoE debug model, one layer, its routed experts cut to 4 of hidden size 64, top 2 (its 64
    of 768, top 8, are minutes of float32 Newton-Schulz a step on a CPU), built as :func:`_llama`."""
    from dataclasses import replace

    from torchtitan.models.qwen3 import model_registry

    cfg = _one_layer(model_registry("debugmodel_moe").model)
    for layer in cfg.layers:
        moe, n, k = layer.moe, 4, 2
        routed = moe.routed_experts
        routed = replace(routed, inner_experts=replace(routed.inner_experts, hidden_dim=64, num_experts=n),
                         token_dispatcher=replace(routed.token_dispatcher, num_experts=n, top_k=k))
        router = replace(moe.router, num_experts=n, top_k=k, gate=replace(moe.router.gate, out_features=n))
        layer.moe = replace(moe, num_experts=n, routed_experts=routed, router=router)
    return _built(cfg, seed, tp)


@titan
def test_every_matrix_but_wqkv_steps_as_in_the_unfused_model():
    """The same weights and gradients in the fused and the unfused model (torchtitan's own state-dict hooks
    convert ``wqkv`` to and from ``wq``, ``wk``, ``wv``): after a MeqMuon and a Muon step every tensor but
    ``wqkv`` is bit for bit the unfused model's."""
    from torchtitan.models.common.attention import FusedQKVLinear as Fused

    for name in ("meqmuon", "muon"):
        fused, twin = _llama(0), _llama(1, fuse_qkv=False)
        twin.load_state_dict(fused.state_dict())  # fused.state_dict() is in wq / wk / wv form already
        gen = torch.Generator().manual_seed(2)
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in twin.named_parameters()}
        for n, p in twin.named_parameters():
            p.grad = grads[n].clone()
        merged = dict(grads)
        for prefix in {n.rsplit(".", 2)[0] + "." for n in grads if n.endswith("wq.weight")}:
            Fused._merge_qkv_on_load(fused.get_submodule(prefix[:-1]), merged, prefix)
        for n, p in fused.named_parameters():
            p.grad = merged[n].clone()
        for model in (fused, twin):
            build_meqmuon(name, model, lr=0.02, **KW).step()
        a, b = fused.state_dict(), twin.state_dict()
        assert sorted(a) == sorted(b)
        qkv = [k for k in a if QKV.search(k)]
        assert len(qkv) == 3
        for k in a:
            if k not in qkv:
                assert torch.equal(a[k], b[k]), (name, k)


# ---- torchtitan's container, LR scheduler and DCP checkpointer -----------------------------------------


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (4, 33), generator=gen) for _ in range(STEPS)]


def _loss(model: nn.Module, ids: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
    """torchtitan's loss normalisation: the sum over this rank's tokens (``rows``) over the global count."""
    out = model(ids[rows, :-1])
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    return F.cross_entropy(out.flatten(0, 1).float(), ids[rows, 1:].flatten(), reduction="sum") / ids[:, 1:].numel()


def _components(model: nn.Module, folder: Path, **kwargs):
    """torchtitan's optimizer container (meqmuon's), LR scheduler (warmup 2, linear decay) and checkpointer."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    from meqmuon.integrations.torchtitan import MeqMuonOptimizers

    opt = MeqMuonOptimizers.Config(name="meqmuon", lr=2e-2, kwargs={**KW, **kwargs}).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2, decay_type="linear").build(optimizers=opt,
                                                                                   training_steps=STEPS)
    ckpt = CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVE, keep_latest_k=0).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={}, sd_adapter=None,
        base_folder=str(folder))
    return opt, sched, ckpt


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, opt, sched, ckpt, first: int, rows: slice = slice(None), reference=None) -> float:
    """Updates ``first..STEPS`` (1-based), saving after update ``SAVE``; ``reference = (model, opt, sched)``:
    fed each update's full gradients; returns the largest parameter difference to it over the updates."""
    worst = 0.0
    for step, ids in enumerate(_batches()[first - 1:], first):
        _loss(model, ids, rows).backward()
        if reference is not None:
            ref, ropt, rsched = reference
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
            for n, p in ref.named_parameters():
                p.grad = grads[n]
            ropt.step(), rsched.step(), ropt.zero_grad()
        opt.step(), sched.step(), opt.zero_grad()
        if reference is not None:
            worst = max(worst, max((_full(p) - reference[0].get_parameter(n)).abs().max().item()
                                   for n, p in model.named_parameters()))
        if step == SAVE:
            ckpt.save(curr_step=step)
    return worst


def _snapshot(model, opt, sched) -> dict:
    state = {k: _full(v).clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state_dict().items()}
    return {"params": {n: _full(p).detach().clone() for n, p in model.named_parameters()}, "state": state,
            "lr": [g["lr"] for o in opt.optimizers for g in o.param_groups], "epoch": sched.state_dict()}


def _assert_same(a: dict, b: dict) -> None:
    assert a["lr"] == b["lr"] and a["epoch"] == b["epoch"]
    for key in ("params", "state"):
        assert sorted(a[key]) == sorted(b[key])
        for k, v in a[key].items():
            same = torch.equal(v, b[key][k]) if isinstance(v, torch.Tensor) else v == b[key][k]
            assert same, (key, k)


@titan
def test_one_process_resumes_bit_for_bit(tmp_path):
    """torchtitan's llama3 debug model, MeqMuonOptimizers, LRSchedulersContainer and CheckpointManager: a run
    resumed from the DCP checkpoint of update 2 (into a model of another initialisation) ends bit for bit as the
    uninterrupted one: parameters, the flat optimizer state, lr and scheduler step. The scheduler's warmup
    and decay reach every group's lr."""
    torch.set_num_threads(1)
    model = _llama(0)
    opt, sched, ckpt = _components(model, tmp_path)
    lrs = []
    for step, ids in enumerate(_batches(), 1):
        _loss(model, ids).backward()
        opt.step(), sched.step(), opt.zero_grad()
        lrs.append({g["lr"] for o in opt.optimizers for g in o.param_groups})
        if step == SAVE:
            ckpt.save(curr_step=step)
    assert [len(s) for s in lrs] == [1] * STEPS and lrs[0] == {2e-2} and max(lrs[-1]) < 2e-2 / 2
    done = _snapshot(model, opt, sched)
    model2 = _llama(1)
    opt2, sched2, ckpt2 = _components(model2, tmp_path)
    assert ckpt2.load(step=SAVE)
    _train(model2, opt2, sched2, ckpt2, SAVE + 1)
    _assert_same(done, _snapshot(model2, opt2, sched2))
    ckpt.close(), ckpt2.close()


def _parallelize(model: nn.Module, mode: str) -> slice:
    """torchtitan's own: ``Module.parallelize`` (TP 2), ``apply_fsdp_to_decoder`` (FSDP2 over 2 ranks) or both
    (``"fsdp2xtp"``, as ``parallelize_qwen3`` applies them, on 2 x 2 ranks); this rank's rows of a batch."""
    import torchtitan.distributed.parallel_dims as pd
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    pd.device_type = "cpu"  # what tools/utils.get_device_info finds on a machine with an accelerator
    par = ParallelismConfig(tensor_parallel_degree=1 if mode == "fsdp" else 2, spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(par, dist.get_world_size())
    dims.build_mesh()
    if mode != "fsdp":
        model.parallelize(dims)
    if mode == "tp":
        return slice(None)
    fsdp = dims.get_mesh(["fsdp"])
    apply_fsdp_to_decoder(model, fsdp, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    for module in model.modules():  # torchtitan's divide factor 1.0 reduces by PREMUL_SUM, which gloo lacks
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    rows = 4 // fsdp.size()
    return slice(fsdp.get_local_rank() * rows, (fsdp.get_local_rank() + 1) * rows)


def _parallel_worker(rank: int, mode: str, folder: str) -> dict:
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    build = _qwen3_moe if mode == "fsdp2xtp" else _llama
    model = build(0, tp=1 if mode == "fsdp" else 2)
    ref = copy.deepcopy(model)
    rows = _parallelize(model, mode)
    placements = {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters()}
    opt, sched, ckpt = _components(model, Path(folder))
    ropt, rsched, _ = _components(ref, Path(folder) / "unused", process_group=solo)
    worst = _train(model, opt, sched, ckpt, 1, rows, reference=(ref, ropt, rsched))
    done = _snapshot(model, opt, sched)
    # the experts' exchange units: per stacked parameter, its units' owners and the ranks that hold each
    units = [(e.name, [(o._exchange.units[i].owner, o._exchange.units[i].pieces.holders) for i in e.units])
             for o in opt.optimizers for _, es, _ in o._plan() for e in es if e.by_matrix]
    model2 = build(1, tp=1 if mode == "fsdp" else 2)
    _parallelize(model2, mode)
    opt2, sched2, ckpt2 = _components(model2, Path(folder))
    assert ckpt2.load(step=SAVE)
    _train(model2, opt2, sched2, ckpt2, SAVE + 1, rows)
    _assert_same(done, _snapshot(model2, opt2, sched2))
    ckpt.close(), ckpt2.close()
    return {"worst": worst, "placements": placements, "units": units}


@titan
@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_fsdp2_and_tp_equal_one_process_and_resume_bit_for_bit(tmp_path, mode):
    """On 2 gloo ranks under torchtitan's own FSDP2 or TP: every update of MeqMuonOptimizers with torchtitan's
    scheduler equals one process's fed the same gradients, to 1e-6 (float32 Newton-Schulz), over 4 updates; the
    run resumed from torchtitan's DCP checkpoint of update 2 ends bit for bit as the uninterrupted one."""
    results = _spawn(_parallel_worker, tmp_path, mode, str(tmp_path))
    for r in results:
        assert r["worst"] < 1e-6, r["worst"]
    placements = results[0]["placements"]
    wqkv = placements["layers.0.attention.qkv_linear.wqkv.weight"]
    assert wqkv == ("Shard(dim=0)",), wqkv
    if mode == "tp":  # rowwise wo: the owner path; colwise wqkv and a vocabulary-parallel embedding: row shards
        assert placements["layers.0.attention.wo.weight"] == ("Shard(dim=1)",)
        assert placements["tok_embeddings.weight"] == ("Shard(dim=0)",)


@titan
def test_moe_under_fsdp2_over_tp_equals_one_process_and_resumes_bit_for_bit(tmp_path):
    """torchtitan's qwen3 MoE (in small) on 2 x 2 gloo ranks under its own TP and FSDP2, as ``parallelize_qwen3``
    applies them: its grouped experts ``(Shard(0), Shard(1 or 2))`` (each expert split over ``tp``, the stack over
    ``fsdp``). Each expert is an exchange unit owned by a rank of the TP pair that holds it; every update equals one
    process's to 1e-6 and the DCP resume is bit for bit, as for the dense model."""
    results = _spawn(_parallel_worker, tmp_path, "fsdp2xtp", str(tmp_path), world=4)
    experts = "layers.0.moe.routed_experts.inner_experts."
    for rank, r in enumerate(results):
        assert r["worst"] < 1e-6, (rank, r["worst"])
        assert [r["placements"][experts + w] for w in ("w1_EFD", "w2_EDF", "w3_EFD")] == [
            ("Shard(dim=0)", "Shard(dim=1)"), ("Shard(dim=0)", "Shard(dim=2)"), ("Shard(dim=0)", "Shard(dim=1)")]
        stacks = {name: owners for name, owners in r["units"]}
        assert sorted(stacks) == [experts + w for w in ("w1_EFD", "w2_EDF", "w3_EFD")], sorted(stacks)
        for name, owners in stacks.items():
            assert len(owners) == 4, (name, owners)  # one unit per expert, not the stack
            # experts 0-1 on the first fsdp half, 2-3 on the other: each owned by a rank that holds it
            assert len({w for _, w in owners}) == 2 and all(w is not None and len(w) == 2 and o in w
                                                           for o, w in owners), (name, owners)


@titan
def test_module_loading_gives_torchtitans_config_with_meqmuon():
    """``--module meqmuon.integrations.torchtitan --config NAME``: torchtitan's ConfigManager loads torchtitan's
    config ``NAME`` with MeqMuonOptimizers' config, whose fields its command line sets."""
    from torchtitan.config import ConfigManager

    from meqmuon.integrations.torchtitan import MeqMuonOptimizers

    args = ["--module", "meqmuon.integrations.torchtitan", "--config", "llama3_debugmodel"]
    cfg = ConfigManager().parse_args(args)
    assert type(cfg.optimizer) is MeqMuonOptimizers.Config
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.weight_decay) == ("meqmuon", 2e-2, 0.1)
    assert cfg.model_spec.name == "llama3" and cfg.lr_scheduler.warmup_steps == 2  # torchtitan's own
    cfg = ConfigManager().parse_args([*args, "--optimizer.name", "muon", "--optimizer.lr", "0.01"])
    assert (cfg.optimizer.name, cfg.optimizer.lr) == ("muon", 0.01)
    cfg = ConfigManager().parse_args(["--module", "meqmuon.integrations.torchtitan", "--config", "qwen3_moe_debug"])
    assert type(cfg.optimizer) is MeqMuonOptimizers.Config and cfg.model_spec.flavor == "debugmodel_moe"
    with pytest.raises(ValueError, match="not found"):
        ConfigManager().parse_args(["--module", "meqmuon.integrations.torchtitan", "--config", "llama3_nonesuch"])
    with pytest.raises(ValueError, match="routes parameters by role"):
        from torchtitan.components.optimizer import ParamGroupConfig

        MeqMuonOptimizers.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW")]).build(
            model_parts=[_llama(0)])
