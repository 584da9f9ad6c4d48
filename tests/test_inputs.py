"""Inputs as torch.optim takes them, and bad ones refused in one line with nothing updated.

- A tensor given twice, in one group or across two, is a ``ValueError`` naming it, for every registered
  optimizer (``torch.optim.AdamW`` through ``build_optimizer`` included); torch only warns within a group.
- Float hyperparameters take any real number (numpy scalars, ints) and 0-D CPU tensors; numbers are stored
  as Python floats, a tensor is kept and read at each step, so LR schedulers (which ``fill_`` a tensor lr)
  drive the step. Bools, NaN/inf, non-0-D, integer and non-CPU tensors are refused.
- The wrong object for ``param_groups`` or an optimizer is a one-line ``TypeError`` saying what to pass.
"""

from __future__ import annotations

import copy
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from capabilities import ENGINE
from torch import nn
from torch.optim import lr_scheduler

import meqmuon
from meqmuon.optim.registry import REGISTRY


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 11, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(torch.relu(self.body(self.embed(ids)))))


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def unchanged(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3, scheduler=None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 11, (2, 5), generator=g)
        opt.zero_grad()
        model(ids).logsumexp(-1).mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return snapshot(model)


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg
    return msg


# ---- duplicates ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_tensor_twice_in_one_group_is_an_error_naming_it(name):
    model = tiny()
    before = snapshot(model)
    groups = meqmuon.param_groups(model)
    hidden = groups[0]
    assert hidden["kind"] == "hidden" and hidden["names"][0] == "body.weight"
    hidden["params"].append(hidden["params"][0])
    hidden["names"].append("body.weight (again)")
    with pytest.raises(ValueError) as err, warnings.catch_warnings():
        warnings.simplefilter("error")  # an error, not torch's duplicate warning
        meqmuon.build_optimizer(name, groups)
    assert "'body.weight (again)' appears twice" in one_line(err) and "first as 'body.weight'" in str(err.value)
    assert unchanged(model, before)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_tensor_in_two_groups_is_an_error_naming_it(name):
    model = tiny()
    before = snapshot(model)
    groups = meqmuon.param_groups(model) + [{"params": [model.body.weight], "kind": "hidden"}]
    with pytest.raises(ValueError) as err:
        meqmuon.build_optimizer(name, groups)
    assert f"params[0] of group {len(groups) - 1} appears twice" in one_line(err)
    assert "first as 'body.weight'" in str(err.value)
    assert unchanged(model, before)


def test_duplicates_without_names_and_as_a_flat_list():
    model = tiny()
    w = model.body.weight
    with pytest.raises(ValueError, match=r"params\[2\] of group 0 appears twice .*first as params\[0\] of group 0"):
        meqmuon.MeqMuon([w, model.body.bias, w])
    with pytest.raises(ValueError, match=r"params\[1\] of group 0 appears twice"):
        meqmuon.build_optimizer("adamw", [w, w])
    with pytest.raises(ValueError, match=r"params\[0\] of group 1 appears twice"):
        meqmuon.build_optimizer("adamw", [{"params": iter([w])}, {"params": (p for p in [w])}])
    # torch's (name, tensor) pairs name the tensor too
    with pytest.raises(ValueError, match="'again' appears twice .*first as 'w'"):
        torch_style = [("w", w), ("again", w)]
        meqmuon.Muon([{"params": torch_style, "kind": "hidden"}])
    opt = meqmuon.Muon([{"params": [("w", w)], "kind": "hidden"}])
    with pytest.raises(ValueError, match="'again' appears twice .*first as 'w'"):
        opt.add_param_group({"params": [("again", w)], "kind": "hidden"})
    assert len(opt.param_groups) == 1


def test_a_refused_add_param_group_leaves_the_optimizer_as_it_was():
    model, ref = tiny(), tiny()
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2)
    ref_opt = meqmuon.MeqMuon(meqmuon.param_groups(ref), lr=1e-2)
    train(model, opt, 1), train(ref, ref_opt, 1)
    n_groups, before = len(opt.param_groups), snapshot(model)
    with pytest.raises(ValueError, match="'body.weight' appears twice"):
        opt.add_param_group({"params": [model.body.weight], "names": ["body.weight"], "kind": "hidden"})
    with pytest.raises(ValueError, match="Invalid lr"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3, 3))], "kind": "hidden", "lr": float("nan")})
    assert len(opt.param_groups) == n_groups and unchanged(model, before)
    assert all(torch.equal(a, b) for a, b in zip(train(model, opt, 2), train(ref, ref_opt, 2), strict=True))


# ---- numbers as torch.optim takes them ---------------------------------------------------------


@pytest.mark.parametrize(
    "lr", [np.float32(1e-2), np.float64(1e-2), torch.tensor(1e-2), torch.tensor(1e-2, dtype=torch.float64),
           Fraction(1, 100), 1]
)
@pytest.mark.parametrize("name", ENGINE)
def test_real_numbers_and_cpu_tensors_are_accepted(name, lr):
    opt = meqmuon.build_optimizer(name, tiny(), lr=lr, weight_decay=np.float32(0.1))
    for g in opt.param_groups:
        own = getattr(opt, "kind_defaults", lambda kind: {})(g.get("kind"))  # a recipe's lr of its own for a kind
        if "lr" in own:  # (MuonH's Adam on embeddings and vectors, adam_lr): not the lr given
            assert type(g["lr"]) is float and g["lr"] == own["lr"], (g.get("kind"), g["lr"])
        elif isinstance(lr, torch.Tensor):
            assert g["lr"] is lr  # kept, so that a scheduler's fill_ reaches the step
        else:
            assert type(g["lr"]) is float and g["lr"] == float(lr)  # stored as a Python float
        assert type(g["weight_decay"]) is float


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", ENGINE)
def test_numpy_and_tensor_hyperparameters_step_as_their_float(name, foreach):
    """Same parameters after three steps as with the Python floats; every float hyperparameter of the class."""
    extra = {k: v for k, v in {"momentum": 0.9, "rho": 0.3, "beta2": 0.9, "eps": 1e-7, "betas": (0.8, 0.9)}.items()
             if k in meqmuon.valid_hyperparameters(name)}

    def as_numpy(v):
        return tuple(np.float64(b) for b in v) if isinstance(v, tuple) else np.float64(v)

    def as_tensor(v):
        return tuple(torch.tensor(b, dtype=torch.float64) for b in v) if isinstance(v, tuple) else (
            torch.tensor(v, dtype=torch.float64))

    runs = []
    for convert in (lambda v: v, as_numpy, as_tensor):
        model = tiny()
        hp = {k: convert(v) for k, v in {"lr": 1e-2, "weight_decay": 0.1, **extra}.items()}
        runs.append(train(model, meqmuon.build_optimizer(name, model, foreach=foreach, **hp)))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (True, "Invalid lr: True (expected a finite number)"),
        (np.float32("nan"), "Invalid lr: np.float32(nan) (expected a finite number)"),
        (float("inf"), "Invalid lr: inf (expected a finite number)"),
        (torch.tensor(float("nan")), "expected a finite number"),
        (-1e-3, "expected a value in [0.0, inf)"),
        (torch.tensor(-1e-3), "expected a value in [0.0, inf)"),
        ("1e-3", "Invalid lr: '1e-3' (expected a finite number)"),
        (torch.tensor([1e-3]), "a tensor lr must be 0-D and floating, got shape (1,)"),
        (torch.tensor(1), "a tensor lr must be 0-D and floating, got shape (), torch.int64"),
        (torch.tensor(1e-3, device="meta"), "a tensor on meta; pass a Python float or a CPU tensor"),
    ],
)
def test_bad_numbers_are_one_line_errors(value, needle):
    model = tiny()
    before = snapshot(model)
    with pytest.raises(ValueError) as err:
        meqmuon.MeqMuon(meqmuon.param_groups(model), lr=value)
    assert needle in one_line(err)
    assert unchanged(model, before)


def test_bad_betas_entry_and_momentum_tensor():
    with pytest.raises(ValueError, match=r"Invalid betas\[1\]: True"):
        meqmuon.Muon(meqmuon.param_groups(tiny()), betas=(0.9, True))
    with pytest.raises(ValueError, match=r"Invalid momentum: tensor\(1\.\) \(expected a value in \[0\.0, 1\.0\)\)"):
        meqmuon.Muon(meqmuon.param_groups(tiny()), momentum=torch.tensor(1.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_tensor_lr_is_refused():
    with pytest.raises(ValueError, match="a tensor on cuda:0; pass a Python float or a CPU tensor"):
        meqmuon.MeqMuon(meqmuon.param_groups(tiny().cuda()), lr=torch.tensor(1e-2, device="cuda"))


SCHEDULERS = {
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda k: 0.5**k),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=4),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=10),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("name", ["meqmuon", "muon", "scale"])
def test_lr_schedulers_drive_numpy_and_tensor_lrs(name, sched):
    """torch's schedulers write a float into ``group["lr"]``, or ``fill_`` a tensor lr in place; the step
    reads the current value either way (same parameters as with a float lr, different from no schedule)."""
    results, lrs = [], []
    # float32 Newton-Schulz: the float32 lr differs from 1e-2 in its 9th digit, and bf16 Newton-Schulz
    # (the default on a CPU with native bf16) could round that into a difference above 1e-6.
    ns = {} if name == "scale" else {"ns_dtype": torch.float32}
    for lr in (1e-2, np.float32(1e-2), torch.tensor(1e-2, dtype=torch.float64)):
        model = tiny()
        opt = meqmuon.build_optimizer(name, model, lr=lr, **ns)
        results.append(train(model, opt, 4, SCHEDULERS[sched](opt)))
        lrs.append(float(opt.param_groups[0]["lr"]))
        if isinstance(lr, torch.Tensor):
            assert opt.param_groups[0]["lr"] is lr  # filled in place by the scheduler
    model = tiny()
    unscheduled = train(model, meqmuon.build_optimizer(name, model, lr=1e-2, **ns), 4)
    assert lrs[0] == lrs[2] != 1e-2 and lrs[1] == pytest.approx(lrs[0], rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[2], strict=True))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(results[0], results[1], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(results[0], unscheduled, strict=True))


def test_tensor_lr_survives_state_dict_and_deepcopy():
    model = tiny()
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=torch.tensor(1e-2))
    train(model, opt, 1)
    twin = copy.deepcopy(opt)
    fresh = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=5e-3)
    fresh.load_state_dict(opt.state_dict())
    assert float(fresh.param_groups[0]["lr"]) == float(twin.param_groups[0]["lr"]) == pytest.approx(1e-2)
    train(model, fresh, 1)  # steps with the loaded tensor lr


# ---- the wrong object ----------------------------------------------------------------------------


@pytest.mark.parametrize("wrong", ["generator", "list", "tensor"])
def test_param_groups_needs_the_model(wrong):
    model = tiny()
    arg = {"generator": model.parameters(), "list": list(model.parameters()), "tensor": model.body.weight}[wrong]
    with pytest.raises(TypeError) as err:
        meqmuon.param_groups(arg)
    what = {"generator": "a generator", "list": "a list", "tensor": "a Parameter"}[wrong]
    assert one_line(err) == ("param_groups() takes an nn.Module (it needs parameter names and module types to "
                             f"route by role); got {what}: pass the model itself")


@pytest.mark.parametrize("name", ENGINE)
def test_every_optimizer_class_refuses_a_module_in_one_line(name):
    model = tiny()
    before = snapshot(model)
    cls = REGISTRY[name].cls.__name__
    with pytest.raises(TypeError) as err:
        REGISTRY[name].cls(model.body)
    assert one_line(err) == (f"{cls}(params=...) takes parameters or param groups, e.g. "
                             f"{cls}(meqmuon.param_groups(model)); got an nn.Module (Linear)")
    with pytest.raises(TypeError, match=r"got a dict \(one param group; put it in a list\)"):
        REGISTRY[name].cls({"params": list(model.parameters())})
    with pytest.raises(TypeError, match="got a float$"):
        REGISTRY[name].cls(0.01)
    assert unchanged(model, before)


@pytest.mark.parametrize(("arg", "what"), [(0.01, "a float"), ("model", "a str"), ({"params": []}, "a dict"),
                                           (torch.zeros(2, 2), "a single tensor")])
@pytest.mark.parametrize("name", ["adamw", "meqmuon"])
def test_build_optimizer_refuses_the_wrong_object_in_one_line(name, arg, what):
    with pytest.raises(TypeError) as err:
        meqmuon.build_optimizer(name, arg)
    assert one_line(err).startswith("build_optimizer(name, model_or_groups) takes an nn.Module, parameters or "
                                    f"param groups, e.g. build_optimizer('{name}', model); got {what}")

