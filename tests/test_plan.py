"""The engine prepares each param group once (rules, matrix views, items) and keeps that plan between
steps; these tests check that what a user may change between steps is followed, and that the kept
plan holds nothing a step should let go of.

- a param group added after some steps is stepped, with fresh state;
- ``load_state_dict`` into an optimizer that has stepped (its plan made) continues exactly like the
  optimizer the state came from (bit for bit: same code, same inputs);
- a parameter whose gradient is ``None`` in a step is skipped that step and stepped the next;
- clearing ``opt.state`` recreates the state, as for a new optimizer;
- after ``step()`` and ``zero_grad()`` the optimizer holds no reference to a gradient.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import meqmuon


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 8, bias=True))


def _backward(model: nn.Module, seed: int) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()


def _groups(model: nn.Module) -> list[dict]:
    return [{"params": [model[0].weight, model[1].weight], "kind": "hidden"},
            {"params": [model[1].bias], "kind": "vector"}]


@pytest.mark.parametrize("foreach", [False, True])
def test_load_state_dict_into_a_stepped_optimizer_continues_exactly(foreach):
    a, b = _model(), _model()
    opt_a = meqmuon.MeqMuon(_groups(a), lr=1e-2, foreach=foreach)
    opt_b = meqmuon.MeqMuon(_groups(b), lr=1e-2, foreach=foreach)
    for seed in range(2):
        _backward(a, seed)
        opt_a.step()
    _backward(b, 9)
    opt_b.step()  # b's plan and state now differ from a's
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for seed in range(2, 4):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _backward(model, seed)
            opt.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt_b.selection_counts() == opt_a.selection_counts()


def test_a_group_added_later_and_a_skipped_parameter_are_followed():
    model = _model()
    opt = meqmuon.MeqMuon(_groups(model)[:1], lr=1e-2)
    _backward(model, 0)
    opt.step()
    bias_before = model[1].bias.detach().clone()
    opt.add_param_group({"params": [model[1].bias], "kind": "vector"})
    _backward(model, 1)
    model[0].weight.grad = None  # not stepped this time
    w0 = model[0].weight.detach().clone()
    opt.step()
    assert torch.equal(model[0].weight, w0) and opt.state[model[0].weight]["step"] == 1
    assert not torch.equal(model[1].bias, bias_before) and opt.state[model[1].bias]["step"] == 1
    _backward(model, 2)
    opt.step()
    assert opt.state[model[0].weight]["step"] == 2 and not torch.equal(model[0].weight, w0)


def test_cleared_state_is_made_anew():
    model = _model()
    opt = meqmuon.MeqMuon(_groups(model), lr=1e-2)
    _backward(model, 0)
    opt.step()
    opt.state.clear()
    _backward(model, 1)
    opt.step()
    st = opt.state[model[0].weight]
    assert st["step"] == 1 and torch.equal(st["momentum_buffer"], model[0].weight.grad)


@pytest.mark.parametrize("foreach", [False, True])
def test_no_gradient_is_kept_alive(foreach):
    model = _model()
    opt = meqmuon.MeqMuon(_groups(model), lr=1e-2, foreach=foreach)
    _backward(model, 0)
    refs = [weakref.ref(p.grad) for p in model.parameters()]
    opt.step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs)


def test_load_state_dict_keeps_the_capture_hook():
    """``load_state_dict`` goes through ``__setstate__``: the optimizer keeps its own settings and hook."""
    model = _model()
    opt = meqmuon.MeqMuon(_groups(model), lr=1e-2)
    seen = []
    opt.set_capture_hook(lambda name, kind, what, x: seen.append(what))
    _backward(model, 0)
    opt.step()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    seen.clear()
    _backward(model, 1)
    opt.step()
    assert seen and set(seen) == {"momentum_input"}
