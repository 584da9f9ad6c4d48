"""Optimizer state keeps its dtype and values through ``state_dict()`` -> serialisation -> ``load_state_dict()``.

torch's ``Optimizer.load_state_dict`` casts floating state to the parameter's dtype; the engine skips that
cast (``meqmuon/optim/saved_state.py``), so that, for every optimizer of the registry on a float32 and on a
bf16 model (float32 state where the optimizer has ``state_dtype``), and for a variant with an int64 counter:

- every loaded state tensor has its saved dtype and bit-identical values (int64 counters past 2**25, where
  a float32 cast would round, and MeqMuon's selection counts past 256, where a bf16 cast rounds);
- the resumed optimizer continues bit for bit like the uninterrupted one (``ns_dtype=torch.float32``, so
  the result does not depend on the CPU kind);
- state saved in one dtype and loaded next to parameters of another steps (it is not cast either way).

Issue 46, item 9. torch's own ``torch.optim.AdamW`` (the registry's ``adamw``) is held to the same checks:
its state follows the parameter's dtype, so torch's policy keeps it too.
"""

from __future__ import annotations

import io

import pytest
import torch
from tinynet import batches, make_model, train

import meqmuon
from meqmuon.optim.factory import valid_hyperparameters
from meqmuon.optim.registry import REGISTRY

#: A count that a float32 cast rounds (2**25 + 1 is not a float32) and so does a bf16 one.
BIG = 2**25 + 1


class Counting(meqmuon.HiddenRule):
    """Moonlight's Muon with an int64 counter of its own (a ``"counter"`` view, docs/variants.md) that grows
    by :data:`BIG` a step, so that a cast of it to either float dtype rounds."""

    name = "counting"
    state_views = {**meqmuon.HiddenRule.state_views, "counter": "counter"}

    def post(self, U, group, state):
        state["counter"].add_(BIG)
        return group["rho"] * max(U.shape[-2:]) ** 0.5 * U


#: (test id, registry name, extra keywords): every optimizer of the registry, and the variant.
CASES = [(name, name, {}) for name in REGISTRY] + [("variant", "muon", {"rules": {"hidden": Counting()}})]


def _build(name: str, model: torch.nn.Module, foreach: bool | None, float32_state: bool = True,
           **extra) -> torch.optim.Optimizer:
    """Optimizer ``name`` with float32 Newton-Schulz and, on a bf16 model, float32 state where it has the option."""
    valid = valid_hyperparameters(name, extra.get("rules"))
    hp = {"lr": 1e-2, "foreach": foreach, **extra}
    if "ns_dtype" in valid:
        hp["ns_dtype"] = torch.float32
    if float32_state and "state_dtype" in valid and next(model.parameters()).dtype == torch.bfloat16:
        hp["state_dtype"] = torch.float32
    return meqmuon.build_optimizer(name, model, **hp)


def _roundtrip(opt: torch.optim.Optimizer) -> dict:
    """``opt.state_dict()`` through ``torch.save`` and ``torch.load(weights_only=True)``: a checkpoint's copy."""
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)


def _states(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    return [(p, opt.state[p]) for g in opt.param_groups for p in g["params"]]


def _assert_same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for (_, sa), (pb, sb) in zip(_states(a), _states(b), strict=True):
        assert sa.keys() == sb.keys()
        for key, va in sa.items():
            vb = sb[key]
            if isinstance(va, torch.Tensor):
                assert vb.dtype == va.dtype, (key, va.dtype, vb.dtype)
                assert key == "step" or vb.device == pb.device  # torch keeps AdamW's step tensor where it was
                assert torch.equal(vb, va), key  # same dtype: equal values are the same bits (no NaN here)
            else:
                assert vb == va, key


def _check_resume(name: str, extra: dict, dtype: torch.dtype, foreach: bool | None, device: str = "cpu") -> None:
    """Steps, a checkpoint's copy of the state, a fresh optimizer that loads it: same dtypes and values, and
    both continue bit for bit."""
    def data(n, seed):
        return [ids.to(device) for ids in batches(n, seed=seed)]

    a = make_model(dtype).to(device)
    opt_a = _build(name, a, foreach, **extra)
    train(a, opt_a, data(3, 1))
    for _, st in _states(opt_a):  # counters past where a float cast rounds (MeqMuon's, the variant's)
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and v.dtype == torch.int64 and key != "step":
                v.add_(BIG)
    if name != "adamw" and dtype == torch.bfloat16:  # the case torch's cast breaks: float32 state, bf16 weights
        assert any(isinstance(v, torch.Tensor) and v.dtype == torch.float32
                   for _, st in _states(opt_a) for v in st.values())

    saved = _roundtrip(opt_a)
    b = make_model(dtype, seed=1).to(device)
    b.load_state_dict(a.state_dict())
    opt_b = _build(name, b, foreach, **extra)
    opt_b.load_state_dict(saved)
    _assert_same_state(opt_a, opt_b)
    if isinstance(opt_a, meqmuon.MeqMuon):
        assert opt_b.selection_counts() == opt_a.selection_counts()

    more = data(3, 2)
    train(a, opt_a, more)
    train(b, opt_b, more)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    _assert_same_state(opt_a, opt_b)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "extra"), [(n, e) for _, n, e in CASES], ids=[i for i, _, _ in CASES])
def test_state_keeps_dtype_and_values_and_the_resumed_run_continues_bit_for_bit(name, extra, dtype, foreach):
    _check_resume(name, extra, dtype, foreach)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "extra"), [(n, e) for _, n, e in CASES], ids=[i for i, _, _ in CASES])
def test_on_cuda_state_keeps_dtype_and_values_and_the_resumed_run_continues_bit_for_bit(name, extra, dtype):
    _check_resume(name, extra, dtype, None, device="cuda")  # foreach=None: the batched step, CUDA's default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "extra"), [(n, e) for _, n, e in CASES], ids=[i for i, _, _ in CASES])
def test_a_cpu_checkpoint_loads_onto_cuda_parameters_uncast(name, extra):
    """Only the device changes: every tensor on the parameter's GPU, in its saved dtype and values."""
    src = make_model(torch.bfloat16)
    opt_src = _build(name, src, False, **extra)
    train(src, opt_src, batches(2))
    dst = make_model(torch.bfloat16).cuda()
    opt = _build(name, dst, None, **extra)
    opt.load_state_dict(_roundtrip(opt_src))
    for (_, s0), (p, s1) in zip(_states(opt_src), _states(opt), strict=True):
        for key, v0 in s0.items():
            v1 = s1[key]
            if isinstance(v0, torch.Tensor) and key != "step":
                assert v1.device == p.device and v1.dtype == v0.dtype and torch.equal(v1.cpu(), v0), key
    train(dst, opt, [ids.cuda() for ids in batches(2, seed=3)])
    assert all(torch.isfinite(p).all() for p in dst.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_selection_counts_past_256_survive_a_checkpoint(dtype):
    """The issue's case: (257, 43) after 300 steps, which a cast to bf16 made (256, 44)."""
    model = make_model(dtype)
    opt = _build("meqmuon", model, foreach=False)
    train(model, opt, batches(1))
    saved = _roundtrip(opt)
    for st in saved["state"].values():
        if "rows_chosen" in st:
            st["step"], st["rows_chosen"] = 300, torch.tensor(257, dtype=torch.int64)
    fresh = _build("meqmuon", make_model(dtype), foreach=False)
    fresh.load_state_dict(saved)
    counts = fresh.selection_counts()
    assert counts and set(counts.values()) == {(257, 43)}
    assert all(st["rows_chosen"].dtype == torch.int64 for _, st in _states(fresh) if "rows_chosen" in st)


@pytest.mark.parametrize(("saved_dtype", "model_dtype"), [(torch.float32, torch.bfloat16),
                                                          (torch.bfloat16, torch.float32)],
                         ids=["fp32-bf16", "bf16-fp32"])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", ["meqmuon", "normuon", "muon", "scale"])
def test_state_saved_next_to_another_dtype_loads_uncast_and_steps(name, foreach, saved_dtype, model_dtype):
    """A checkpoint of a float32 model resumed on a bf16 one (and back; state in the parameters' dtype, no
    ``state_dtype``): the state is not cast, and the step runs on it."""
    src = make_model(saved_dtype)
    opt_src = _build(name, src, foreach, float32_state=False)
    train(src, opt_src, batches(2))
    saved = _roundtrip(opt_src)
    dst = make_model(model_dtype)
    opt = _build(name, dst, foreach, float32_state=False)
    opt.load_state_dict(saved)
    for (_, s0), (_, s1) in zip(_states(opt_src), _states(opt), strict=True):
        assert {k: v.dtype for k, v in s0.items() if isinstance(v, torch.Tensor)} == \
               {k: v.dtype for k, v in s1.items() if isinstance(v, torch.Tensor)}
    before = [p.detach().clone() for p in dst.parameters()]
    train(dst, opt, batches(2, seed=3))
    for p, p0 in zip(dst.parameters(), before, strict=True):
        assert p.dtype == model_dtype and torch.isfinite(p).all() and not torch.equal(p, p0)


def test_user_load_hooks_see_the_state_as_saved_and_as_loaded():
    """The engine's own hooks run inside the user's: a pre-hook sees plain tensors of the checkpoint, a
    post-hook the loaded state; the engine's hooks are gone afterwards."""
    model = make_model(torch.bfloat16)
    opt = _build("normuon", model, foreach=False)
    train(model, opt, batches(1))
    seen = {}

    def pre(optimizer, state_dict):
        seen["pre"] = {type(v) for st in state_dict["state"].values() for v in st.values()}

    def post(optimizer):
        seen["post"] = {v.dtype for st in optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor)}

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(post)
    opt.load_state_dict(_roundtrip(opt))
    assert seen["pre"] <= {torch.Tensor, int} and torch.Tensor in seen["pre"]
    # momentum and second moment (state_dtype=torch.float32), and the skipped steps' int64 counter
    assert seen["post"] == {torch.float32, torch.int64}
    assert len(opt._optimizer_load_state_dict_pre_hooks) == 1 and len(opt._optimizer_load_state_dict_post_hooks) == 1
