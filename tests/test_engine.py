"""What every optimizer of the engine does whatever its rules: state, copies, dtypes, hooks, errors.

The rules' maths is held to its float64 references in the rule families' files (test_meqmuon.py,
test_muon.py, test_normuon.py, test_scale.py, test_adamw.py); this file is the behaviour around it,
for every registered optimizer where the test is parametrised:

- Resuming is exact: a ``state_dict`` round trip through ``torch.save``/``torch.load(weights_only=True)``,
  ``copy.deepcopy`` and pickling mid-run all go on to the same bits as the uninterrupted run
  (``torch.equal``: the same operations on the same values; anything lost or recomputed would show).
- A step makes no host-device synchronisation (any Python read of a tensor value fails), per-tensor
  and batched; ``opt.step()`` inside ``torch.compile`` runs the eager step bit for bit without
  recompiling per step; ``lr_scheduler`` and a compiled model work.
- Parameters: a non-contiguous 3-D kernel is updated in place like a contiguous copy (1e-12 in
  float64: the same maths through a copy); a bf16 direction on a float32 parameter (and the reverse)
  equals ``p.add_(d)``'s type promotion bit for bit; state follows the parameter dtype unless
  ``state_dtype`` is set; zero and tiny gradients give finite parameters.
- Groups and memory: ``param_groups`` covers every trainable parameter once; groups without a kind
  are inferred with a warning; the measured optimizer state equals each rule table's count (paper
  section 4) and ``predicted_state_elements``; the capture hook sees the Newton-Schulz inputs.
- Errors name what is wrong: invalid hyperparameters, betas, kinds, complex and sparse tensors,
  unknown optimizer names and hyperparameters.
"""

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
from capabilities import ALL, CAPABILITIES, ENGINE
from references import MUONEQ_MODE
from tinynet import batches, loss_fn, make_model, train
from torch import nn

import meqmuon


def test_meqmuon_updates_a_non_contiguous_conv_kernel_in_place():
    """A 3-D hidden parameter whose storage is not contiguous (no matrix view) gets the same update
    as a contiguous copy of it, in place (the fast path updates through a view; this one cannot)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 5, 4, generator=g, dtype=torch.float64)
    strided = nn.Parameter(base.transpose(1, 2).contiguous().transpose(1, 2))  # shape (6, 5, 4), not contiguous
    dense = nn.Parameter(base.clone())
    assert not strided.is_contiguous() and dense.is_contiguous()
    storage = strided.data_ptr()
    opts = [
        meqmuon.MeqMuon([{"params": [p], "kind": "hidden"}], lr=0.05, ns_dtype=torch.float64) for p in (strided, dense)
    ]
    for _ in range(3):
        grad = torch.randn(6, 5, 4, generator=g, dtype=torch.float64)
        for p, opt in zip((strided, dense), opts, strict=True):
            p.grad = grad.clone()
            opt.step()
    assert strided.data_ptr() == storage and not strided.is_contiguous()
    assert torch.allclose(strided, dense, rtol=0, atol=1e-12)
    assert (dense - base).abs().max() > 1e-2


# ---- behaviour -------------------------------------------------------------------------------------


def test_zero_gradients_and_tiny_values_are_finite():
    model = make_model(dtype=torch.float32)
    for name in ALL:
        opt = meqmuon.build_optimizer(name, model, lr=1e-2)
        for scale in (0.0, 1e-30, 1e-12):
            for p in model.parameters():
                p.grad = torch.full_like(p, scale)
            opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters()), name


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip_is_bit_exact(name):
    """k steps, save, load into a fresh optimizer and model copy, k more == 2k uninterrupted."""
    data = batches(6, seed=11)

    straight = make_model(dtype=torch.float32)
    train(straight, meqmuon.build_optimizer(name, straight, lr=1e-2), data)

    first = make_model(dtype=torch.float32)
    opt = meqmuon.build_optimizer(name, first, lr=1e-2)
    train(first, opt, data[:3])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = make_model(dtype=torch.float32, seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt2 = meqmuon.build_optimizer(name, resumed, lr=1e-2)
    opt2.load_state_dict(ckpt["opt"])
    train(resumed, opt2, data[3:])
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), n
    if hasattr(opt2, "selection_counts") and CAPABILITIES[name].rules["hidden"] == "meq_hidden":
        assert sum(r + c for r, c in opt2.selection_counts().values()) == 6 * 5  # 5 hidden tensors


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_optimizer_steps_like_the_original(name, how):
    """``copy.deepcopy`` / pickling of (model, optimizer) mid-run: both go on to the same bits.

    torch's ``Optimizer.__getstate__`` keeps only defaults, state and param groups; the engine's own
    settings (``compile``) must survive too, or the copy fails at its first step."""
    data = batches(6, seed=5)

    model = make_model(dtype=torch.float32)
    opt = meqmuon.build_optimizer(name, model, lr=1e-2)
    train(model, opt, data[:3])
    both = {"model": model, "opt": opt}
    copied = copy.deepcopy(both) if how == "deepcopy" else pickle.loads(pickle.dumps(both))
    train(model, opt, data[3:])
    train(copied["model"], copied["opt"], data[3:])
    for (n, p), q in zip(model.named_parameters(), copied["model"].parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not any(p is q for p, q in zip(model.parameters(), copied["model"].parameters(), strict=True))


def test_copy_keeps_compile_and_refuses_an_explicit_process_group():
    model = make_model(dtype=torch.float32)
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2, compile=True)
    assert copy.deepcopy(opt)._compile is True
    assert pickle.loads(pickle.dumps(opt))._compile is True
    # A process group cannot be pickled: an optimizer bound to an explicit one says so instead of
    # coming back bound to the default group.
    bound = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2, process_group=object())
    with pytest.raises(RuntimeError, match="explicit process_group"):
        copy.deepcopy(bound)


@pytest.mark.parametrize("foreach", [False, True])
def test_step_makes_no_host_device_sync(monkeypatch, foreach):
    """Any Python read of a tensor value (item, bool, float, int, tolist) inside step() fails the test,
    on the per-tensor and on the batched (foreach) step, deciding as on a GPU: the skip flag folded into the
    writes (a CPU's step reads it, ``decision.ON_HOST``: there no device is waited for; test_nonfinite.py)."""
    from meqmuon.optim import decision

    monkeypatch.setattr(decision, "ON_HOST", ())
    model = make_model(dtype=torch.float32)
    opts = [meqmuon.build_optimizer(n, model, lr=1e-2, foreach=foreach) for n in ENGINE]
    loss_fn(model, batches(1)[0]).backward()

    def forbidden(*a, **k):
        raise AssertionError("host-device synchronisation in step()")

    for attr in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, attr, forbidden)
    for opt in opts:
        opt.step()
        opt.step()
    monkeypatch.undo()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_step_inside_torch_compile_runs_eagerly_without_recompiles():
    """A compiled function that calls ``opt.step()``: the step is not traced (it recompiled at every
    step when it was: the step count and lr are Python numbers), runs exactly the eager step, and
    says so once."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_model = make_model(dtype=torch.float32)
    compiled_model = copy.deepcopy(eager_model)
    eager = meqmuon.MeqMuon(meqmuon.param_groups(eager_model), lr=1e-2)
    inside = meqmuon.MeqMuon(meqmuon.param_groups(compiled_model), lr=1e-2)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1 / (1 + t)) for o in (eager, inside)]
    compiled_step = torch.compile(lambda: inside.step())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ids in batches(5, seed=2):
            for model in (eager_model, compiled_model):
                model.zero_grad()
                loss_fn(model, ids).backward()
            eager.step()
            compiled_step()
            for sched in schedules:
                sched.step()
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs <= 1  # at most the empty graph before the break; none per step or per lr
    assert sum("inside torch.compile" in str(w.message) for w in caught) == 1
    for (n, p), q in zip(eager_model.named_parameters(), compiled_model.parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize(
    "param_dtype, direction_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_apply_update_with_mixed_dtypes_equals_torch_promotion(param_dtype, direction_dtype):
    """A bf16 direction is cast into a float32 buffer before the add (no fresh temporary); the
    result must be ``p.add_(d)``'s type promotion bit for bit, also when the parameter is the
    narrower one (then nothing may be cast down before the add)."""
    from meqmuon.optim.driver import apply_update
    from meqmuon.optim.rule import Item

    g = torch.Generator().manual_seed(4)
    p = torch.randn(48, 40, generator=g).to(param_dtype)
    d = torch.randn(48, 40, generator=g).to(direction_dtype)
    expected = p.clone().mul_(1 - 0.03 * 0.1).add_(d, alpha=-0.03 * 0.7)
    scratch: dict = {}
    apply_update([Item(p, d, {}, "w")], [d], [0.7], {"lr": 0.03, "weight_decay": 0.1}, scratch)
    assert torch.equal(p, expected)
    assert bool(scratch) == (direction_dtype == torch.bfloat16)  # the buffer is used only to widen


def test_state_dtype_follows_parameter_unless_configured():
    model = make_model(dtype=torch.bfloat16)
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2)
    loss_fn(model, batches(1)[0]).backward()
    opt.step()
    assert {s["momentum_buffer"].dtype for s in opt.state.values()} == {torch.bfloat16}
    opt32 = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2, state_dtype=torch.float32)
    opt32.step()
    assert {s["momentum_buffer"].dtype for s in opt32.state.values()} == {torch.float32}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_lr_scheduler_and_compiled_model():
    model = make_model(dtype=torch.float32)
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    compiled = torch.compile(model)
    losses = []
    for ids in batches(4):
        opt.zero_grad()
        loss = loss_fn(compiled, ids)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 5)
    assert all(math.isfinite(x) for x in losses)


def test_groups_without_kind_are_inferred_with_a_warning():
    model = make_model(dtype=torch.float32)
    with pytest.warns(UserWarning, match="param_groups"):
        opt = meqmuon.MeqMuon(model.parameters(), lr=1e-2)
    loss_fn(model, batches(1)[0]).backward()
    opt.step()
    st = opt.state[model.q.weight]
    assert "rows_chosen" in st  # 2-D -> hidden rule
    assert "rows_chosen" not in opt.state[model.norm.weight]


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=-0.1), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(rho=0.0), "rho"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
        (dict(ns_dtype=torch.int32), "ns_dtype"),
        (dict(nesterov="yes"), "nesterov"),
        (dict(lr=float("nan")), "lr"),
    ],
)
def test_invalid_hyperparameters_name_the_parameter(kwargs, match):
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        meqmuon.MeqMuon(meqmuon.param_groups(model), **kwargs)


def test_invalid_betas_and_beta2():
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="betas"):
        meqmuon.Muon(meqmuon.param_groups(model), betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="beta2"):
        meqmuon.NorMuon(meqmuon.param_groups(model), beta2=1.0)


def test_bad_kinds_complex_and_sparse():
    w = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="kind"):
        meqmuon.MeqMuon([{"params": [w], "kind": "bias"}])
    with pytest.raises(ValueError, match=r"needs a >=2-D tensor"):
        meqmuon.MeqMuon([{"params": [nn.Parameter(torch.zeros(3))], "kind": "hidden", "names": ["b"]}])
    with pytest.raises(ValueError, match="complex"):
        meqmuon.MeqMuon([{"params": [nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))], "kind": "hidden"}])
    emb = nn.Embedding(10, 4, sparse=True)
    opt = meqmuon.MeqMuon([{"params": list(emb.parameters()), "kind": "embedding", "names": ["emb.weight"]}])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse.*emb.weight"):
        opt.step()


def test_build_optimizer_errors_list_valid_choices():
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="valid optimizers: adamw, muon"):
        meqmuon.build_optimizer("lion", model)
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['betaz'\].*valid: lr"):
        meqmuon.build_optimizer("muon", model, betaz=(0.9, 0.9))
    opt = meqmuon.build_optimizer("adamw", model, lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["weight_decay"] == 0.1


def test_optimizer_state_bytes_matches_rule_counts():
    """Measured bytes after one step equal each rule table's count (section 4 formulas)."""
    model = make_model(dtype=torch.float32)
    groups = meqmuon.param_groups(model)
    sizes = {g["kind"]: sum(p.numel() for p in g["params"]) for g in groups}
    n_h = sizes["hidden"]
    n_a = sum(v for k, v in sizes.items() if k != "hidden")
    r_h = sum(p.shape[0] for g in groups if g["kind"] == "hidden" for p in g["params"])
    n = n_h + n_a
    expected = {
        "meqmuon": n * 4,
        "muon": (n_h + 2 * n_a) * 4,
        "normuon": (n_h + 2 * n_a + r_h) * 4,
        "adamw": 2 * n * 4,
        "meqmuon-only-hidden": (n_h + 2 * n_a) * 4,
        "meqmuon-only-embedding": (n_h + sizes["embedding"] + sizes["head"] + 2 * sizes["vector"]) * 4,
        "meqmuon-only-vector": (n_h + 2 * (sizes["embedding"] + sizes["head"]) + sizes["vector"]) * 4,
        "scale": (sizes["head"] + 2 * sizes["vector"]) * 4,
        **{name: (n_h + 2 * n_a) * 4 for name in MUONEQ_MODE},  # Muon's state
        # the 2026 field (issue 48): Muon's state, Muon-VS with one variance per hidden element besides
        # the momentum; meqmuon-shape has MeqMuon's (its side is fixed by shape: no selection counts)
        **{name: (n_h + 2 * n_a) * 4 for name in ("muon-plus", "muon-plus-shared", "muonh", "muonh-2026-01",
                                                  "aurora-shared")},
        **{name: (2 * n_h + 2 * n_a) * 4 for name in ("muon-vs", "muon-vs-shared")},
        # Aurora's recipe (issue 58): its rule, one momentum buffer, for the head too
        "aurora": (n_h + sizes["head"] + 2 * (n_a - sizes["head"])) * 4,
        "meqmuon-shape": n * 4,
    }
    for name in ALL:
        opt = meqmuon.build_optimizer(name, model, lr=1e-3)
        model.zero_grad()
        loss_fn(model, batches(1)[0]).backward()
        opt.step()
        measured = meqmuon.optimizer_state_bytes(opt)
        assert measured == expected[name], name
        assert meqmuon.predicted_state_elements(meqmuon.rules_of(name), groups) * 4 == measured, name


def test_param_groups_covers_everything_once_and_skips_frozen():
    model = make_model(dtype=torch.float32)
    model.norm.bias.requires_grad_(False)
    groups = meqmuon.param_groups(model, lr={"vector": 0.5}, weight_decay=0.0)
    names = [n for g in groups for n in g["names"]]
    expected = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(names) == sorted(expected) and len(names) == len(set(names))
    kinds = {n: g["kind"] for g in groups for n in g["names"]}
    assert kinds["embed_tokens.weight"] == "embedding" and kinds["lm_head.weight"] == "head"
    assert kinds["conv.weight"] == "hidden" and kinds["up.bias"] == "vector"
    vec = next(g for g in groups if g["kind"] == "vector")
    assert vec["lr"] == 0.5 and "lr" not in groups[0]
    table = meqmuon.describe_groups(groups)
    assert "| embedding | 1 |" in table and "lm_head.weight" in table


def test_capture_hook_sees_pre_ns_inputs_and_is_off_by_default():
    model = make_model()
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2, ns_dtype=torch.float64)
    seen = {}
    opt.set_capture_hook(lambda name, kind, what, x: seen.__setitem__(name, (kind, what, x.clone())))
    loss_fn(model, batches(1)[0]).backward()
    grad_q = model.q.weight.grad.clone()
    opt.step()
    assert set(seen) == {n for n, _ in model.named_parameters()}
    kind, what, x = seen["q.weight"]
    # first step: B = G, Nesterov input G + mu*B = (1 + mu) G
    assert (kind, what) == ("hidden", "momentum_input") and torch.allclose(x, 1.95 * grad_q)
    assert seen["lm_head.weight"][0] == "head"
    opt.set_capture_hook(None)
    seen.clear()
    opt.step()
    assert seen == {}
    muon = meqmuon.Muon(meqmuon.param_groups(model), lr=1e-2)
    muon.set_capture_hook(lambda name, kind, what, x: seen.__setitem__(name, what))
    muon.step()
    assert seen["embed_tokens.weight"] == "gradient" and seen["q.weight"] == "momentum_input"
