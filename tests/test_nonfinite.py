"""Every step all or nothing (issue 56): a non-finite gradient, a rule that raises, a GradScaler's overflow.

What is proven (one process; the distributed layouts are test_distributed.py's and test_layouts.py's):

- Under the default ``nonfinite="skip"`` a NaN or an infinity in any one gradient changes no parameter and no state
  tensor of any registry optimizer (tests/capabilities.py), in every step form (per tensor, batched, compiled): the
  whole step is skipped, and counted (``"skipped_steps"`` in every stepped parameter's state, ``skipped_steps()``).
  Without the option (``nonfinite="propagate"``, torch's behaviour and the code before issue 56) the same gradient
  makes the parameters non-finite: the negative control.
- With finite gradients ``"skip"`` and ``"propagate"`` give the same bits (the flag folded into the writes changes
  nothing that it does not skip); benchmarks/fingerprint.py holds both to the code before issue 56.
- ``"raise"``: a ``RuntimeError`` naming the first non-finite parameter, nothing written, the step not counted.
- A skipped step's count is saved and resumed with the state (``state_dict`` / ``load_state_dict``), and the
  resumed run continues bit for bit like the uninterrupted one.
- ``torch.amp.GradScaler`` (on CPU) drives the optimizer through its protocol for optimizers that unscale
  themselves (``_step_supports_amp_scaling``): the step unscales in its check kernel (a power-of-two scale: the
  same bits as an unscaled run), skips an overflowed step, and the scaler makes no host sync of its own.
- A rule whose ``post`` raises, on a matrix after another's direction was computed (per tensor) or in a batched
  step: every parameter and state tensor stays bit-identical, the step count too, and the error names the rule
  and the parameter. On the code before issue 56 this failed (the momentum, and in the per-tensor form the first
  matrices' weights, were already written).
- No host sync in the default step with a NaN gradient (``aten._local_scalar_dense``, which ``.item()`` and
  ``bool(tensor)`` dispatch, counted on CPU); ``"raise"`` makes one, by choice.

Every test here but the last two runs the writes with the flag folded in, as on a GPU (``decision.ON_HOST`` empty,
:func:`_folded`). On a CPU the step reads the flag instead (``decision.settle``), which costs nothing there: the last
two prove that a taken step then makes the kernels of ``"propagate"`` and one read, and that the bits of every
step, a skipped one among them, are the folded writes' bits.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from capabilities import CAPABILITIES, FORM_KWARGS, NEWTON_SCHULZ, every_form
from tinynet import batches, loss_fn, make_model
from torch.utils._python_dispatch import TorchDispatchMode

import meqmuon
from meqmuon.optim import compiled as C
from meqmuon.optim import decision
from meqmuon.optim.commit import SKIPPED

ENGINE_FORMS = [(n, f) for n, f in every_form() if CAPABILITIES[n].engine]


def _build(name, model, form="per-tensor", **kw):
    if name in NEWTON_SCHULZ:
        kw.setdefault("ns_dtype", torch.float32)
    return meqmuon.build_optimizer(name, model, lr=0.02, weight_decay=0.1, **FORM_KWARGS[form], **kw)


def _backward(model, ids):
    model.zero_grad()
    loss_fn(model, ids).backward()


def _snapshot(model, opt):
    """Every parameter and every state value (tensors cloned), the engine's skip counter apart."""
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items() if k != SKIPPED}
             for st in opt.state.values()]
    return params, state


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert len(pa) == len(pb) and len(sa) == len(sb)
    for x, y in zip(pa, pb, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(sa, sb, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert (torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k]), k


def _skip_and_propagate(name, form, dtype, steps):
    """The same finite steps under ``nonfinite="skip"`` and ``"propagate"``: both snapshots, and the last model."""
    runs = []
    for nonfinite in ("skip", "propagate"):
        model = make_model(dtype=dtype)
        opt = _build(name, model, form, nonfinite=nonfinite)
        for ids in batches(steps):
            _backward(model, ids)
            opt.step()
        runs.append(_snapshot(model, opt))
    return runs, model


def _counts(state):
    return [st["step"] for st in state]


@pytest.fixture(autouse=True)
def _folded(request, monkeypatch):
    """The skip flag folded into the writes, never read (a GPU's step), on this CPU too; not for the tests of
    the CPU's own step (``test_on_a_cpu_*``)."""
    if not request.node.name.startswith("test_on_a_cpu"):
        monkeypatch.setattr(decision, "ON_HOST", ())


@pytest.fixture
def cheap_compile(monkeypatch):
    """The compiled forms' graphs with dynamo's eager backend: the same graphs, none of inductor's codegen."""
    monkeypatch.setattr(C, "BACKEND", "eager")


@pytest.mark.parametrize(("name", "form", "bad"), [(n, f, "nan") for n, f in ENGINE_FORMS] +
                         [(n, f, "inf") for n, f in ENGINE_FORMS if n in ("meqmuon", "muon", "normuon")])
def test_a_non_finite_gradient_changes_nothing_by_default(name, form, bad, cheap_compile):
    model = make_model(dtype=torch.float32)
    opt = _build(name, model, form)
    for ids in batches(2):
        _backward(model, ids)
        opt.step()
    _backward(model, batches(3)[2])
    # one entry of one gradient: a hidden matrix's for a NaN, the vector's for an infinity
    target = model.up.weight if bad == "nan" else model.norm.weight
    target.grad.view(-1)[1] = float(bad)
    before = _snapshot(model, opt)
    opt.step()
    params, state = _snapshot(model, opt)
    assert _counts(state) == [c + 1 for c in _counts(before[1])]  # the step counts as taken, and as skipped
    for st in state:
        st["step"] -= 1
    _same(before, (params, state))
    assert all(int(st[SKIPPED]) == 1 for st in opt.state.values()) and opt.skipped_steps() == 1
    # the next finite step steps again
    _backward(model, batches(4)[3])
    opt.step()
    assert not torch.equal(model.up.weight, before[0][3]) and opt.skipped_steps() == 1


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
@pytest.mark.parametrize("name", ["meqmuon", "muon", "normuon"])
def test_propagate_poisons_as_torch_does(name, form):
    """The negative control: without the skip a NaN in one gradient spreads over its matrix."""
    model = make_model(dtype=torch.float32)
    opt = _build(name, model, form, nonfinite="propagate")
    _backward(model, batches(1)[0])
    model.up.weight.grad[0, 0] = float("nan")
    opt.step()
    assert torch.isnan(model.up.weight).all() and opt.skipped_steps() == 0


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
@pytest.mark.parametrize("name", [n for n in CAPABILITIES if CAPABILITIES[n].engine])
def test_skip_and_propagate_are_the_same_bits_with_finite_gradients(name, form):
    runs, _ = _skip_and_propagate(name, form, torch.float32, 3)
    _same(*runs)


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
def test_raise_names_the_first_non_finite_parameter_and_writes_nothing(form):
    model = make_model(dtype=torch.float32)
    opt = _build("meqmuon", model, form, nonfinite="raise")
    _backward(model, batches(1)[0])
    opt.step()
    _backward(model, batches(2)[1])
    model.down.weight.grad[1, 2] = float("-inf")
    model.lm_head.weight.grad[0, 0] = float("nan")
    before = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match=r"gradient of parameter 'down\.weight' holds a NaN or an infinity"):
        opt.step()
    _same(before, _snapshot(model, opt))  # nothing written, the step not counted


def test_an_unknown_nonfinite_is_refused():
    with pytest.raises(ValueError, match="Invalid nonfinite: 'ignore'"):
        _build("muon", make_model(dtype=torch.float32), nonfinite="ignore")


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
def test_skipped_steps_are_saved_and_resumed(form):
    def run(steps, resume_at=None):
        model = make_model(dtype=torch.float32)
        opt = _build("meqmuon", model, form)
        for t, ids in enumerate(batches(steps)):
            if t == resume_at:
                state = copy.deepcopy(opt.state_dict())
                opt = _build("meqmuon", model, form)
                opt.load_state_dict(state)
                assert opt.skipped_steps() == 2
            _backward(model, ids)
            if t in (1, 3):
                model.q.weight.grad[0, 0] = float("nan")
            opt.step()
        return model, opt

    straight, resumed = run(6), run(6, resume_at=4)
    assert straight[1].skipped_steps() == resumed[1].skipped_steps() == 2
    _same(_snapshot(*straight), _snapshot(*resumed))
    counts = straight[1].selection_counts()  # a skipped step chose nothing: rows + columns = steps taken
    assert all(r + c == 4 for r, c in counts.values()), counts


def test_a_state_saved_before_the_counter_loads_with_zero():
    model = make_model(dtype=torch.float32)
    opt = _build("muon", model)
    _backward(model, batches(1)[0])
    opt.step()
    saved = opt.state_dict()
    for st in saved["state"].values():
        del st[SKIPPED]
    fresh = _build("muon", model)
    fresh.load_state_dict(saved)
    _backward(model, batches(2)[1])
    fresh.step()
    assert fresh.skipped_steps() == 0 and all(SKIPPED in st for st in fresh.state.values())


class _Ops(TorchDispatchMode):
    """The aten ops a step dispatches, by name; ``syncs``: how many read a tensor's value on the host
    (``aten._local_scalar_dense``, which ``.item()`` and ``bool(tensor)`` dispatch)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> int:
        return self.ops.get("_local_scalar_dense", 0)


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
@pytest.mark.parametrize("name", ["meqmuon", "muon", "normuon", "scale", "muon-vs"])
def test_the_default_step_makes_no_host_sync(name, form):
    model = make_model(dtype=torch.float32)
    opt = _build(name, model, form)
    _backward(model, batches(1)[0])
    opt.step()
    _backward(model, batches(2)[1])
    model.q.weight.grad[0, 0] = float("nan")
    with _Ops() as counted:
        opt.step()
    assert counted.syncs == 0
    raising = _build(name, model, form, nonfinite="raise")
    _backward(model, batches(3)[2])
    with _Ops() as counted:
        raising.step()
    assert counted.syncs == 1  # by choice: the flag read once


def _scaled_run(name, form, overflow_at=None, steps=4):
    """``steps`` steps under ``torch.amp.GradScaler("cpu")`` (float32: the scale only scales); an infinity in one
    gradient at step ``overflow_at``. Returns the model, the optimizer, the scaler and the host syncs of
    ``scaler.step``."""
    model = make_model(dtype=torch.float32)
    opt = _build(name, model, form)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    syncs = 0
    for t, ids in enumerate(batches(steps)):
        opt.zero_grad()
        scaler.scale(loss_fn(model, ids)).backward()
        if t == overflow_at:
            model.k.weight.grad[0, 0] = float("inf")
        with _Ops() as counted:
            scaler.step(opt)
        syncs += counted.syncs
        scaler.update()
    return model, opt, scaler, syncs


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
@pytest.mark.parametrize("name", ["meqmuon", "muon"])
def test_grad_scaler_protocol(name, form):
    assert meqmuon.build_optimizer(name, make_model(), lr=0.01)._step_supports_amp_scaling
    model, opt, scaler, syncs = _scaled_run(name, form)
    plain = make_model(dtype=torch.float32)
    opt_plain = _build(name, plain, form)
    for ids in batches(4):
        _backward(plain, ids)
        opt_plain.step()
    _same(_snapshot(plain, opt_plain), _snapshot(model, opt))  # unscaled by powers of two: the same bits
    assert syncs == 0 and opt.skipped_steps() == 0
    # an overflow: that step skipped, by the scaler's found_inf and the optimizer alike; the scale backs off
    model, opt, scaler, syncs = _scaled_run(name, form, overflow_at=1)
    assert syncs == 0 and opt.skipped_steps() == 1 and all(torch.isfinite(p).all() for p in model.parameters())
    assert scaler.get_scale() < 2.0**11


def test_the_protocol_called_directly_unscales_and_skips():
    """``step(grad_scale=..., found_inf=...)`` as GradScaler calls it: the gradients unscaled in the check's kernel,
    the step skipped on ``found_inf`` even with finite gradients (the scaler saw an overflow elsewhere)."""
    model, ref = make_model(dtype=torch.float32), make_model(dtype=torch.float32)
    opt, opt_ref = _build("meqmuon", model), _build("meqmuon", ref)
    for m in (model, ref):
        _backward(m, batches(1)[0])
    for p in model.parameters():
        p.grad.mul_(8.0)
    opt.step(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(0.0))
    opt_ref.step()
    _same(_snapshot(ref, opt_ref), _snapshot(model, opt))
    _backward(model, batches(2)[1])
    before = _snapshot(model, opt)
    opt.step(found_inf=torch.tensor(1.0))
    after = _snapshot(model, opt)
    for st in after[1]:
        st["step"] -= 1
    _same(before, after)
    assert opt.skipped_steps() == 1


class Boom(meqmuon.HiddenRule):
    """A user's variant whose ``post`` raises on the ``fail_at``-th matrix (counted over stacks)."""

    name = "boom"

    def __init__(self, fail_at: int = 2):
        self.fail_at, self.seen = fail_at, 0

    def post(self, U, group, state=None):
        self.seen += U.shape[0]
        if self.seen >= self.fail_at:
            raise ValueError("post does not take this")
        return U


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
@pytest.mark.parametrize("name", ["meqmuon", "muon", "scale"])
def test_a_rule_that_raises_leaves_every_tensor_as_it_was(name, form):
    model = make_model(dtype=torch.float32)
    boom = Boom(fail_at=10**9)
    opt = _build(name, model, form, rules={"hidden": boom})
    for ids in batches(2):
        _backward(model, ids)
        opt.step()
    _backward(model, batches(3)[2])
    boom.seen, boom.fail_at = 0, 3  # the third matrix: after two others' directions (per tensor)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError) as raised:
        opt.step()
    _same(before, _snapshot(model, opt))  # parameters, momentum and every state tensor; the step counts too
    assert re.search(r"rule 'boom' on parameters? '(q|k|up|down|conv)\.weight'.*: post does not", str(raised.value))
    boom.fail_at = 10**9  # fixed: the next step takes the same gradient once, as if nothing had happened
    opt.step()
    reference = make_model(dtype=torch.float32)
    opt_ref = _build(name, reference, form, rules={"hidden": Boom(fail_at=10**9)})
    for ids in batches(3):
        _backward(reference, ids)
        opt_ref.step()
    _same(_snapshot(reference, opt_ref), _snapshot(model, opt))


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
@pytest.mark.parametrize("name", ["muon", "meqmuon"])
def test_bf16_state_skips_too(name, form):
    """bf16 parameters keep bf16 state, whose 0-D gate factors would round (0.95 is not a bf16 number): their writes
    go through flat copies and a ``where`` instead (``commit.stepping_``, ``commit.momentum_``); a skipped step
    still changes nothing, and a finite step writes the bits of ``nonfinite="propagate"``."""
    runs, model = _skip_and_propagate(name, form, torch.bfloat16, 2)
    _same(*runs)
    opt = _build(name, model, form)
    _backward(model, batches(3)[2])
    opt.step()
    before = _snapshot(model, opt)
    _backward(model, batches(4)[3])
    model.up.weight.grad.view(-1)[1] = float("nan")
    opt.step()
    params, state = _snapshot(model, opt)
    for st in state:
        st["step"] -= 1
    _same(before, (params, state))
    assert opt.skipped_steps() == 1


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
@pytest.mark.parametrize("name", ["meqmuon", "muon", "scale"])
def test_on_a_cpu_a_taken_step_makes_propagates_kernels_and_one_read(name, form):
    """The CPU's step (``decision.ON_HOST``): the check, one read of the flag, then exactly the ops of
    ``nonfinite="propagate"`` (none of the folded writes' selects and copies)."""
    assert "cpu" in decision.ON_HOST
    ops = {}
    for nonfinite in ("skip", "propagate"):
        model = make_model(dtype=torch.float32)
        opt = _build(name, model, form, nonfinite=nonfinite)
        _backward(model, batches(1)[0])
        opt.step()
        _backward(model, batches(2)[1])
        with _Ops() as counted:
            opt.step()
        ops[nonfinite] = counted.ops
    extra = {k: ops["skip"].get(k, 0) - ops["propagate"].get(k, 0) for k in ops["skip"].keys() | ops["propagate"]}
    extra = {k: v for k, v in extra.items() if v}
    assert extra.pop("_amp_foreach_non_finite_check_and_unscale_") == 1
    assert extra.pop("_local_scalar_dense") == 1
    extra.pop("zeros", None)  # the flag itself
    extra.pop("full", None)  # the check's kept 1.0
    assert extra == {}


@pytest.mark.parametrize("form", ["per-tensor", "batched"])
@pytest.mark.parametrize("name", ["meqmuon", "muon", "normuon", "scale", "muon-vs"])
def test_on_a_cpu_every_step_has_the_folded_writes_bits(name, form, monkeypatch):
    """Four steps, the third with a NaN gradient, with the flag read on the host and folded into the writes: the
    same parameters, state and skipped count, bit for bit; the skipped step changed nothing."""
    runs = []
    for on_host in (("cpu",), ()):
        monkeypatch.setattr(decision, "ON_HOST", on_host)
        model = make_model(dtype=torch.float32)
        opt = _build(name, model, form)
        for t, ids in enumerate(batches(4)):
            _backward(model, ids)
            if t == 2:
                model.up.weight.grad[0, 1] = float("nan")
                before = _snapshot(model, opt)
            opt.step()
            if t == 2:
                params, state = _snapshot(model, opt)
                for st in state:
                    st["step"] -= 1
                _same(before, (params, state))
        assert opt.skipped_steps() == 1
        runs.append(_snapshot(model, opt))
    _same(*runs)
