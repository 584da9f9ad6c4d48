"""The 2026 field's presets (issue 48) against their official code, and in every form.

- **Upstream equality** (float64 throughout, three steps, a tall, a wide and a square matrix): ``muon-plus``
  (every ``norm_mode``) against its equations as K1seki221/MuonPlus computes them (no license: transcribed,
  ``reference_2026/muonplus_equations.py``), ``muon-vs`` against the vendored body of
  jingru-lee/Variance-Adaptive-Muon's ``Muon_VS.step``, ``muonh`` against levanter's ``scale_with_muonh``
  transcribed to torch, ``aurora`` against tilde-research/aurora-release's vendored ``aurora`` and ``polar``,
  ``meqmuon-shape`` against the paper's eq. 7 with the shape's side (``references.py``). Tolerance 1e-9: the
  only differences are where the Newton-Schulz normalisation puts its 1e-7 (``max(||X||, 1e-7)`` here,
  ``||X|| + 1e-7`` upstream) and Aurora's EMA momentum vs Moonlight's (a scalar the normalisations
  remove up to that epsilon).
- **2 gloo ranks**: under DDP every preset equals one process (1e-6), per-tensor and batched; under FSDP2
  every preset equals the unsharded optimizer (1e-6), Muon-VS's own input and MuonH's own step included.
- **Resume**: two steps, ``state_dict()`` into a fresh optimizer, one step equals three steps, bit for bit.
- **Every form** on tests/test_variants.py's model (a tall and a wide matrix sharing a stack, 3-D experts,
  a transposed stack, a split fused projection): per-tensor, batched, compiled and batched-compiled each equal
  the float64 per-matrix reference to 1e-5 (float32 model and Newton-Schulz).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from capabilities import FORM_KWARGS, reference_cases
from reference_2026 import aurora as aurora_ref
from reference_2026 import muonh_levanter, muonplus_equations
from reference_2026.muon_vs import muon_vs_step
from references import inv, ns, rms_vec
from test_distributed import _Holder, _spawn
from test_variants import FSDP_SHAPES, SHAPES, _fsdp_params, _grad, _groups, _matrices, _shard, _tensors
from torch import nn

import meqmuon
from meqmuon.optim.registry import REGISTRY
from meqmuon.optim.rules import RULES
from meqmuon.optim.rules.muonplus import MUONPLUS_MODES

#: Issue 48's presets: each hidden rule with the shared AdamW (the upstream recipes, issue 58: test_recipes_2026.py).
NAMES = ["muon-plus-shared", "muon-vs-shared", "muonh-2026-01", "aurora-shared", "meqmuon-shape"]
LR, WD, MU, RHO, STEPS = 0.02, 0.1, 0.95, 0.2, 3
MATRICES = [(24, 16), (16, 24), (16, 16)]


def _shape_dir(U: torch.Tensor) -> torch.Tensor:
    """Paper eq. 7 on the side fixed by shape (tall and square: rows, wide: columns), times rho."""
    m, n = U.shape
    side = inv(rms_vec(U, 1))[:, None] if m >= n else inv(rms_vec(U, 0))[None, :]
    return RHO * U * side


class _Reference:
    """One preset's official update, matrix by matrix, in place on float64 views ``W``."""

    def __init__(self, name: str, mats: list[torch.Tensor], wd: float, nesterov: bool = True, **kw) -> None:
        self.name, self.wd, self.nesterov, self.kw = _method(name), wd, nesterov, kw
        self.bufs = [torch.zeros_like(W) for W in mats]
        self.states = [{} for _ in mats]

    def step(self, mats: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        for W, G, b, st in zip(mats, grads, self.bufs, self.states, strict=True):
            if self.name == "muon-plus":
                muonplus_equations.muonplus_step(W, G, b, LR, self.wd, self.kw.get("norm_mode", "row_col"),
                                                 nesterov=self.nesterov)
            elif self.name == "muon-vs":
                muon_vs_step(W, G.clone(), st, {"eps": 1e-8, "momentum": MU, "lr": LR, "weight_decay": self.wd,
                                                 "ns_steps": 5})
            elif self.name == "muonh":
                new, buf = muonh_levanter.muonh_update(W, G, b, momentum=MU, nesterov=self.nesterov, learning_rate=LR)
                W.copy_(new)
                b.copy_(buf)
            elif self.name == "aurora":
                aurora_ref.aurora(W, G.clone(), b, eta=LR, weight_decay=self.wd, mu=MU, nesterov=self.nesterov)
            else:  # meqmuon-shape: B <- mu B + G, X = G + mu B, D = rho N_side(Orth(X)), W <- (1 - lr wd) W - lr D
                b.mul_(MU).add_(G)
                W.mul_(1 - LR * self.wd).sub_(LR * _shape_dir(ns(G + MU * b if self.nesterov else b)))


def _method(name: str) -> str:
    """The method of a preset: its registry name without "-shared" or "-2026-01"."""
    return name.removesuffix("-shared").removesuffix("-2026-01")


def _wd(name: str) -> float:
    return 0.0 if _method(name) == "muonh" else WD  # levanter's MuonH has no weight decay


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_preset_equals_its_official_update_in_float64(name, foreach):
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64) * 0.1) for s in MATRICES]
    mats = [p.detach().clone() for p in params]
    init = [p.detach().clone() for p in params]
    opt = meqmuon.build_optimizer(name, [{"params": params, "kind": "hidden"}], lr=LR, weight_decay=_wd(name),
                                  momentum=MU, ns_dtype=torch.float64, foreach=foreach)
    ref = _Reference(name, mats, _wd(name))
    for step in range(STEPS):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in MATRICES]
        for p, G in zip(params, grads, strict=True):
            p.grad = G.clone()
        opt.step()
        ref.step(mats, grads)
        for i, (p, W) in enumerate(zip(params, mats, strict=True)):
            assert torch.allclose(p.detach(), W, rtol=0, atol=1e-9), (name, step, i, (p - W).abs().max().item())
    assert max((p.detach() - W0).abs().max().item() for p, W0 in zip(params, init, strict=True)) > 1e-3  # moved


@pytest.mark.parametrize("mode", MUONPLUS_MODES)
def test_muon_plus_every_norm_mode_equals_upstream(mode):
    g = torch.Generator().manual_seed(1)
    params = [nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64) * 0.1) for s in MATRICES]
    mats = [p.detach().clone() for p in params]
    opt = meqmuon.build_optimizer("muon-plus-shared", [{"params": params, "kind": "hidden"}], lr=LR, weight_decay=WD,
                                  norm_mode=mode, ns_dtype=torch.float64)
    ref = _Reference("muon-plus", mats, WD, norm_mode=mode)
    for _ in range(STEPS):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in MATRICES]
        for p, G in zip(params, grads, strict=True):
            p.grad = G.clone()
        opt.step()
        ref.step(mats, grads)
    for p, W in zip(params, mats, strict=True):
        assert torch.allclose(p.detach(), W, rtol=0, atol=1e-9), (mode, (p - W).abs().max().item())


#: This file is the 2026 presets' rule family (tests/test_capabilities.py): every preset in every step form,
#: with and without Nesterov (compiled forms: with), against its float64 reference.
CASES = reference_cases(*NAMES)


@pytest.mark.parametrize("name, nesterov, form", CASES)
def test_matches_float64_reference(name, nesterov, form, monkeypatch):
    """Every form on test_variants.py's model (views of every kind) equals the preset's float64 reference."""
    from meqmuon.optim import compiled as C

    monkeypatch.setattr(C, "BACKEND", "eager")  # dynamo traces the driver's body with the rule inside
    params = _tensors()
    build = functools.partial(meqmuon.build_optimizer, name, _groups(params), lr=LR, weight_decay=_wd(name),
                              momentum=MU, nesterov=nesterov, ns_dtype=torch.float32, **FORM_KWARGS[form])
    if _method(name) == "muon-vs" and not nesterov:  # upstream has no other input: refused, not ignored
        with pytest.raises(ValueError, match="nesterov"):
            build()
        return
    opt = build()
    ref_params = [p.detach().double() for p in _tensors()]
    mats = [m for i, p in enumerate(ref_params) for m in _matrices(p, i)]
    ref = _Reference(name, mats, _wd(name), nesterov)
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = _grad(i, step).float()
        opt.step()
        ref.step(mats, [m for i in range(len(SHAPES)) for m in _matrices(_grad(i, step), i)])
    moved = 0.0
    for i, (p, q, init) in enumerate(zip(params, ref_params, _tensors(), strict=True)):
        assert torch.allclose(p.double(), q, rtol=0, atol=1e-5), (name, form, i, (p.double() - q).abs().max().item())
        moved = max(moved, (p - init).abs().max().item())
    assert moved > 1e-2


def test_muonh_keeps_every_matrix_norm_and_moves_it_by_lr():
    params = _tensors()
    norms = [[m.norm().item() for m in _matrices(p.detach(), i)] for i, p in enumerate(params)]
    opt = meqmuon.build_optimizer("muonh", _groups(params), lr=LR, weight_decay=0.0, ns_dtype=torch.float32)
    before = [[m.clone() for m in _matrices(p.detach(), i)] for i, p in enumerate(params)]
    for i, p in enumerate(params):
        p.grad = _grad(i, 0).float()
    opt.step()
    for i, p in enumerate(params):
        for W, W0, r in zip(_matrices(p.detach(), i), before[i], norms[i], strict=True):
            assert math.isclose(W.norm().item(), r, rel_tol=1e-5)
            # a step of length lr r, then the projection back to the sphere: from outside the ball it shortens the
            # chord, from inside (|W'| >= r (1 - lr)) it lengthens it by 1 / (1 - lr) at most
            assert 1e-4 < (W - W0).norm().item() <= LR * r / (1 - LR) * (1 + 1e-5)


def test_the_rules_own_hyperparameters_are_checked():
    params = [nn.Parameter(torch.randn(8, 4))]
    for name, bad in [("muon-plus", {"norm_mode": "both"}), ("aurora", {"pp_iterations": 0}),
                      ("aurora", {"pp_beta": 0.0}), ("muon-vs", {"vs_eps": 0.0}), ("muonh", {"ns_method": "x"}),
                      ("muon-vs", {"momentum": 1.0})]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            meqmuon.build_optimizer(name, [{"params": params, "kind": "hidden"}], **bad)


def test_registry_rows_of_the_2026_presets():
    for name in NAMES:
        entry = REGISTRY[name]
        assert entry.default_lr > 0 and entry.cls.RULES["hidden"] in RULES
    assert REGISTRY["aurora"].cls([nn.Parameter(torch.randn(4, 2))]).defaults["ns_steps"] == 12


# ---- 2 gloo ranks: DDP and FSDP2, every preset ------------------------------------------------------------------


def _run_preset(name, params, groups, foreach, grad=lambda i, step: _grad(i, step).float()):
    opt = meqmuon.build_optimizer(name, groups, lr=LR, weight_decay=_wd(name), momentum=MU,
                                  ns_dtype=torch.float32, foreach=foreach)
    for step in range(STEPS):
        for i, p in enumerate(params):
            full = grad(i, step)
            p.grad = full if not hasattr(p, "device_mesh") else _shard(full, p)
        opt.step()


def _ddp_worker(rank):
    out = {}
    for name in NAMES:
        for foreach in (False, True):
            params = _tensors()
            _run_preset(name, params, _groups(params), foreach)
            out[(name, foreach)] = [p.detach().clone() for p in params]
    return out


def test_every_preset_under_ddp_equals_one_process(tmp_path):
    results = _spawn(_ddp_worker, tmp_path)
    for name in NAMES:
        for foreach in (False, True):
            params = _tensors()
            _run_preset(name, params, _groups(params), foreach)
            for r, got in enumerate(results):
                for i, (p, q) in enumerate(zip(got[(name, foreach)], params, strict=True)):
                    assert torch.allclose(p, q.detach(), rtol=0, atol=1e-6), (name, foreach, r, i)


def _fsdp_grad(i, step):
    return torch.randn(FSDP_SHAPES[i], generator=torch.Generator().manual_seed(100 * step + i))


def _fsdp_groups(params):
    return [{"params": params, "kind": "hidden", "views": ["matrix"] * 3 + ["stacked"]}]


def _fsdp_worker(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for name in NAMES:
        for foreach in (False, True):
            holder = _Holder({"hidden": _fsdp_params()})
            fully_shard(holder, mesh=mesh)
            sharded = [getattr(holder, f"hidden_{i}") for i in range(len(FSDP_SHAPES))]
            _run_preset(name, sharded, _fsdp_groups(sharded), foreach, _fsdp_grad)
            out[(name, foreach)] = [p.full_tensor().detach().clone() for p in sharded]
    return out


def test_every_preset_under_fsdp2_equals_unsharded(tmp_path):
    """Muon-VS's input (elementwise, made where the row shards lie) and MuonH's projection (its weights' pieces
    to the owner with ``X``, back stepped) as every other hidden rule: through the exchange."""
    results = _spawn(_fsdp_worker, tmp_path)
    for name in NAMES:
        for foreach in (False, True):
            params = _fsdp_params()
            _run_preset(name, params, _fsdp_groups(params), foreach, _fsdp_grad)
            for got in results:
                for i, (p, q) in enumerate(zip(got[(name, foreach)], params, strict=True)):
                    assert torch.allclose(p, q.detach(), rtol=0, atol=1e-6), (name, foreach, i)


@pytest.mark.parametrize("name", NAMES)
def test_a_resumed_preset_continues_as_if_uninterrupted(name):
    """``state_dict()`` holds each preset's whole state (Muon-VS's variance, Aurora's momentum, ...): two steps,
    a fresh optimizer loaded from it, one more step equals three steps of one optimizer, bit for bit."""
    def build(params):
        return meqmuon.build_optimizer(name, _groups(params), lr=LR, weight_decay=_wd(name), ns_dtype=torch.float32)

    def step(opt, params, k):
        for i, p in enumerate(params):
            p.grad = _grad(i, k).float()
        opt.step()

    straight = _tensors()
    opt = build(straight)
    for k in range(3):
        step(opt, straight, k)
    resumed = _tensors()
    first = build(resumed)
    for k in range(2):
        step(first, resumed, k)
    second = build(resumed)
    second.load_state_dict(first.state_dict())
    step(second, resumed, 2)
    for p, q in zip(resumed, straight, strict=True):
        assert torch.equal(p, q), (name, (p - q).abs().max().item())


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_polar_express_reaches_every_presets_newton_schulz(name, foreach, monkeypatch):
    """``ns_coefficients="polar_express"`` runs inside each preset (both polars of Aurora's): the preset equals
    its official update with the official polar replaced by Polar Express (float64, three steps), which
    tests/test_polar_express.py holds to Amsel et al.'s own iteration."""
    import sys

    from reference_2026 import muon_vs as muon_vs_ref

    def polar_express(G, steps=5, *_, **__):
        return meqmuon.functional.orthogonalize(G, steps, "polar_express", torch.float64)

    monkeypatch.setattr(muonplus_equations, "ns5", polar_express)
    monkeypatch.setattr(muon_vs_ref, "zeropower_via_newtonschulz5", polar_express)
    monkeypatch.setattr(muonh_levanter, "zeropower_via_newtonschulz5", polar_express)
    monkeypatch.setattr(aurora_ref, "polar", lambda G: polar_express(G, 12))
    monkeypatch.setattr(sys.modules[__name__], "ns", polar_express)
    g = torch.Generator().manual_seed(2)
    params = [nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64) * 0.1) for s in MATRICES]
    mats = [p.detach().clone() for p in params]
    opt = meqmuon.build_optimizer(name, [{"params": params, "kind": "hidden"}], lr=LR, weight_decay=_wd(name),
                                  momentum=MU, ns_dtype=torch.float64, ns_coefficients="polar_express",
                                  foreach=foreach)
    ref = _Reference(name, mats, _wd(name))
    for _ in range(STEPS):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in MATRICES]
        for p, G in zip(params, grads, strict=True):
            p.grad = G.clone()
        opt.step()
        ref.step(mats, grads)
    for p, W in zip(params, mats, strict=True):
        assert torch.allclose(p.detach(), W, rtol=0, atol=1e-9), (name, (p - W).abs().max().item())
