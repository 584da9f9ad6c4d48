"""User variants: a ``meqmuon.HiddenRule`` subclass passed as ``rules={"hidden": ...}`` runs in every form.

Two variants of at most 15 lines each, written as a researcher would: :class:`BothSided` (``post``
only: MeqMuon with two-sided normalisation after Newton-Schulz, ``rho N_c(N_r(U))``) and
:class:`RowEqMoonlight` (``pre`` and ``post``: rows of the Newton-Schulz input to unit norm, then
Moonlight's ``rho sqrt(max(m, n)) U``). Neither says anything about buckets, transposition, views,
distribution or compilation; the driver does (``optim/driver.py``).

What is verified:

- every form (per-tensor, batched, compiled per-tensor and batched) equals a float64 reference
  written from the variant's equations with plain loops, per matrix, to 1e-5 (float32 model and
  Newton-Schulz; the float32 iteration's rounding, ~1e-6 after three steps of lr 0.02, is the
  difference). The model has what a variant could get wrong: a ``(16, 8)`` and an ``(8, 16)``
  matrix that share a batched Newton-Schulz stack (one transposed; ``pre``/``post`` must see it in
  its own orientation), 3-D experts viewed as stacked matrices, a stack stored transposed, a fused
  projection split in two;
- on 2 gloo ranks, DDP (the work split by owners) equals one process to 1e-6, per-tensor and
  batched, and FSDP2 (row shards; owners run ``pre -> NS -> post`` on whole matrices) equals the
  unsharded optimizer to 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
from references import equilibrate_dir, ns
from test_distributed import _Holder, _spawn
from torch import nn

import meqmuon
from meqmuon import functional as F


class BothSided(meqmuon.HiddenRule):
    """MeqMuon with both-sided normalisation after Newton-Schulz: ``D = rho N_c(N_r(U))``."""

    name = "both_sided"

    def post(self, U, group):
        return group["rho"] * F.equilibrate(U)


class RowEqMoonlight(meqmuon.HiddenRule):
    """Rows of the Newton-Schulz input to unit norm, then Moonlight's ``rho sqrt(max(m, n)) U``."""

    name = "row_eq_moonlight"

    def pre(self, X, group):
        return X / torch.linalg.vector_norm(X, dim=-1, keepdim=True).clamp(min=1e-8)

    def post(self, U, group):
        return group["rho"] * math.sqrt(max(U.shape[-2:])) * U


VARIANTS = {"both_sided": BothSided, "row_eq_moonlight": RowEqMoonlight}
LR, WD, MU, RHO, STEPS = 0.02, 0.1, 0.95, 0.2, 3


def _reference_direction(name: str, X: torch.Tensor) -> torch.Tensor:
    """The variants' equations for one float64 matrix, sharing no code with the package."""
    if name == "both_sided":
        return RHO * equilibrate_dir(ns(X))
    rows = X / X.norm(dim=1, keepdim=True).clamp(min=1e-8)
    return RHO * math.sqrt(max(X.shape)) * ns(rows)


# ---- the model: tensors, their views, and each view's matrices ------------------------------------

SHAPES = [(16, 8), (8, 16), (12, 12), (3, 6, 8), (3, 8, 6), (10, 8)]
VIEWS = ["matrix", "matrix", "matrix", "stacked", "stacked-transposed", "matrix"]
SPLITS = [None, None, None, None, None, (4, 6)]


def _matrices(t: torch.Tensor, i: int) -> list[torch.Tensor]:
    """The matrices an optimizer sees in tensor ``i`` (its view), as views of ``t``."""
    if VIEWS[i] == "stacked":
        return list(t.unbind(0))
    if VIEWS[i] == "stacked-transposed":
        return [m.T for m in t.unbind(0)]
    if SPLITS[i]:
        return list(t.split(SPLITS[i]))
    return [t]


def _tensors(seed: int = 0, dtype=torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(s, generator=g, dtype=torch.float64) * 0.5).to(dtype)) for s in SHAPES]


def _grad(i: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + i)
    return torch.randn(SHAPES[i], generator=g, dtype=torch.float64)


def _groups(params):
    return [{"params": params, "kind": "hidden", "names": [f"w{i}" for i in range(len(params))],
             "views": VIEWS, "splits": SPLITS}]


def _run_meqmuon(name, params, steps=STEPS, **kw):
    opt = meqmuon.Muon(_groups(params), lr=LR, weight_decay=WD, momentum=MU, rho=RHO, ns_dtype=torch.float32,
                       rules={"hidden": VARIANTS[name]()}, **kw)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = _grad(i, step).to(p.dtype)
        opt.step()
    return opt


def _reference(name: str) -> list[torch.Tensor]:
    """Float64, matrix by matrix: ``B <- mu B + G``, ``X = G + mu B``, the variant's direction, the step."""
    params = [p.detach().double() for p in _tensors()]
    mats = [m for i, p in enumerate(params) for m in _matrices(p, i)]
    bufs = [torch.zeros_like(m) for m in mats]
    for step in range(STEPS):
        grads = [m for i in range(len(SHAPES)) for m in _matrices(_grad(i, step), i)]
        for W, b, G in zip(mats, bufs, grads, strict=True):
            b.mul_(MU).add_(G)
            D = _reference_direction(name, G + MU * b)
            W.mul_(1 - LR * WD).sub_(LR * D)
    return params


FORMS = {"per-tensor": {"foreach": False}, "batched": {"foreach": True},
         "compile": {"foreach": False, "compile": True}, "batched-compile": {"foreach": True, "compile": True}}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_equals_its_float64_reference_in_every_form(name, form, monkeypatch):
    from meqmuon.optim import compiled as C

    monkeypatch.setattr(C, "BACKEND", "eager")  # dynamo traces the driver's body with the variant inside
    params = _tensors()
    _run_meqmuon(name, params, **FORMS[form])
    moved = 0.0
    for i, (p, q, init) in enumerate(zip(params, _reference(name), _tensors(), strict=True)):
        assert torch.allclose(p.double(), q, rtol=0, atol=1e-5), (name, form, i, (p.double() - q).abs().max().item())
        moved = max(moved, (p - init).abs().max().item())
    assert moved > 1e-2  # the steps really moved the parameters


def test_hidden_rule_shows_only_what_a_variant_overrides_or_declares():
    """``meqmuon.HiddenRule`` is a protocol: its public names are the hooks a variant overrides (``pre``, ``post``,
    ``post_all``, ``post_factors``, ``lr_scale``, ``validate``, and ``inputs`` and ``step_weights`` for a rule whose
    Newton-Schulz input or step reads more than the momentum: Muon-VS, MuonH) and what it declares (``defaults``,
    ``state_views``, ``transposes``, ``factors_divide``; ``hyperparameters``, derived from ``defaults``, and
    ``transfer_form``, from the hooks it overrides, ``transfer.py``); nothing of the driver (issue 35). A variant
    that overrides a hook is run through it, whatever the form (the tests above)."""
    shown = {n for n in dir(meqmuon.HiddenRule) if not n.startswith("_")}
    assert shown == {"pre", "post", "post_all", "post_factors", "lr_scale", "validate", "inputs", "step_weights",
                     "defaults", "state_views", "transposes", "hyperparameters", "factors_divide",
                     "transfer_form"}, shown
    from meqmuon.optim import compiled, exchange, forms
    from meqmuon.optim.placement import EXECUTORS, Path

    # The driver is functions: per path the four forms in one table (the eager two in forms.py, the compiled two
    # beside their graphs; the exchange's on OWNERS), picked by one chooser, the engine's _run.
    for path, modules in ((Path.LOCAL, [forms.__name__] * 2 + [compiled.__name__] * 2),
                          (Path.OWNERS, [exchange.__name__] * 4)):
        forms = EXECUTORS[path].forms
        assert set(forms) == {(False, False), (True, False), (False, True), (True, True)}
        assert [getattr(f, "func", f).__module__ for f in forms.values()] == modules


def test_a_rule_table_entry_must_be_a_named_rule_instance():
    params = _tensors()
    with pytest.raises(TypeError, match="rule instance"):
        meqmuon.Muon(_groups(params), rules={"hidden": BothSided})  # the class, not an instance
    from meqmuon.optim.rule import Rule

    class Bare(Rule):  # neither a hidden, a momentum nor a stepping rule: the driver could not run it
        name = "bare"

    with pytest.raises(TypeError, match="rule instance"):
        meqmuon.Muon(_groups(params), rules={"hidden": Bare()})
    with pytest.raises(ValueError, match="Invalid rules key"):
        meqmuon.Muon(_groups(params), rules={"hiden": BothSided()})

    class Nameless(meqmuon.HiddenRule):
        def post(self, U, group):
            return U

    with pytest.raises(TypeError, match="'name'"):
        meqmuon.Muon(_groups(params), rules={"hidden": Nameless()})
    opt = meqmuon.build_optimizer("meqmuon", _groups(params), rules={"hidden": BothSided()})
    assert type(opt._rule_for("hidden")) is BothSided and opt._rule_for("vector").name == "rms_normalize"


# ---- a variant's own hyperparameter: default, keyword, per group, bad values, in every form ----------


class Scaled(meqmuon.HiddenRule):
    """``D = alpha U``: the issue's public form of a variant that owns a hyperparameter (issue 35)."""

    name = "scaled"
    defaults = {"alpha": 0.5}

    def validate(self, group):
        if not group["alpha"] > 0:
            raise ValueError(f"Invalid alpha: {group['alpha']!r} (expected > 0)")

    def post(self, U, group):
        return group["alpha"] * U


def _scaled_groups(params, first_alpha):
    """Two hidden groups: the first 3 tensors with ``alpha`` of their own (unless ``None``), the rest not."""
    groups = [{"params": params[:3], "kind": "hidden", "views": VIEWS[:3], "splits": SPLITS[:3]},
              {"params": params[3:], "kind": "hidden", "views": VIEWS[3:], "splits": SPLITS[3:]}]
    if first_alpha is not None:
        groups[0]["alpha"] = first_alpha
    return groups


def _scaled_reference(alphas: list[float]) -> list[torch.Tensor]:
    """Float64, matrix by matrix, tensor ``i`` with ``D = alphas[i] Orth(X)``."""
    params = [p.detach().double() for p in _tensors()]
    for step in range(STEPS):
        for i, p in enumerate(params):
            if step == 0:
                p.bufs = [torch.zeros_like(m) for m in _matrices(p, i)]
            for W, b, G in zip(_matrices(p, i), p.bufs, _matrices(_grad(i, step), i), strict=True):
                b.mul_(MU).add_(G)
                W.mul_(1 - LR * WD).sub_(LR * alphas[i] * ns(G + MU * b))
    return params


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize(("keyword", "first"), [(None, None), (2.0, None), (None, 0.25), (2.0, 0.25)],
                         ids=["default", "keyword", "per-group", "keyword+per-group"])
def test_a_variants_own_hyperparameter_reaches_its_group_in_every_form(keyword, first, form, monkeypatch):
    from meqmuon.optim import compiled as C

    monkeypatch.setattr(C, "BACKEND", "eager")
    params = _tensors()
    kw = {} if keyword is None else {"alpha": keyword}
    opt = meqmuon.Muon(_scaled_groups(params, first), lr=LR, weight_decay=WD, momentum=MU, ns_dtype=torch.float32,
                       rules={"hidden": Scaled()}, **kw, **FORMS[form])
    rest = 0.5 if keyword is None else keyword
    assert [g["alpha"] for g in opt.param_groups] == [rest if first is None else first, rest]
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = _grad(i, step).to(p.dtype)
        opt.step()
    alphas = [rest if first is None else first] * 3 + [rest] * 3
    for i, (p, q) in enumerate(zip(params, _scaled_reference(alphas), strict=True)):
        assert torch.allclose(p.double(), q, rtol=0, atol=1e-5), (form, i, (p.double() - q).abs().max().item())


def test_a_variants_own_hyperparameter_is_validated_and_unknown_keywords_raise():
    params = _tensors()
    with pytest.raises(ValueError, match=r"Invalid alpha: -1 \(expected > 0\)"):
        meqmuon.Muon(_groups(params), rules={"hidden": Scaled()}, alpha=-1)
    with pytest.raises(ValueError, match=r"Invalid alpha: 0"):
        meqmuon.Muon(_scaled_groups(params, 0), rules={"hidden": Scaled()})
    with pytest.raises(ValueError, match=r"Invalid alpha: -1"):
        meqmuon.build_optimizer("meqmuon", _groups(params), rules={"hidden": Scaled()}, alpha=-1)
    opt = meqmuon.Muon(_scaled_groups(params, None)[:1], rules={"hidden": Scaled()})
    with pytest.raises(ValueError, match=r"Invalid alpha: -2"):
        opt.add_param_group({"params": params[3:], "kind": "hidden", "views": VIEWS[3:], "alpha": -2})
    assert len(opt.param_groups) == 1  # the refused group is not kept
    with pytest.raises(TypeError, match="unexpected keyword argument 'alpha'"):
        meqmuon.Muon(_groups(params), alpha=1.0)  # Muon's own rules have no alpha
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['alpha'\]"):
        meqmuon.build_optimizer("muon", _groups(params), alpha=1.0)
    assert "alpha" in meqmuon.valid_hyperparameters("muon", {"hidden": Scaled()})

    class Undeclared(meqmuon.HiddenRule):  # reads a key it neither declares nor gets: refused when built
        name = "undeclared"
        hyperparameters = meqmuon.HiddenRule.hyperparameters + ("beta",)

    with pytest.raises(ValueError, match=r"rule 'undeclared' reads hyperparameter\(s\) \['beta'\]"):
        meqmuon.Muon(_groups(params), rules={"hidden": Undeclared()})


# ---- the table of Newton-Schulz methods -------------------------------------------------------------


@pytest.mark.parametrize("form", list(FORMS))
def test_ns_method_is_looked_up_in_the_table_in_every_form(form, monkeypatch):
    """A method added to ``NS_METHODS`` is what every form runs: here quintic Newton-Schulz scaled by 3,
    so the parameters move as with ``alpha = 3 * 0.5`` of :class:`Scaled` (they would move as with 0.5 if
    any form called quintic Newton-Schulz directly)."""
    from meqmuon.optim import compiled as C
    from meqmuon.optim import newton_schulz as NS

    monkeypatch.setattr(C, "BACKEND", "eager")
    def tripled(X, *args, **kw):
        return F.orthogonalize(X, *args, **kw) * 3

    monkeypatch.setitem(NS.NS_METHODS, "tripled", NS.NSMethod(tripled))
    params = _tensors()
    opt = meqmuon.Muon(_scaled_groups(params, None), lr=LR, weight_decay=WD, momentum=MU, ns_dtype=torch.float32,
                       rules={"hidden": Scaled()}, ns_method="tripled", **FORMS[form])
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = _grad(i, step).to(p.dtype)
        opt.step()
    for i, (p, q) in enumerate(zip(params, _scaled_reference([1.5] * 6), strict=True)):
        assert torch.allclose(p.double(), q, rtol=0, atol=1e-5), (form, i, (p.double() - q).abs().max().item())


@pytest.mark.parametrize("name", ["meqmuon", "muon", "normuon", "muoneq-r", "meqmuon-only-hidden"])
def test_every_muon_family_optimizer_takes_ns_method_and_refuses_an_unknown_one(name):
    params = _tensors()
    assert "ns_method" in meqmuon.valid_hyperparameters(name)
    opt = meqmuon.build_optimizer(name, _groups(params), ns_method="quintic")
    assert opt.param_groups[0]["ns_method"] == "quintic"
    assert meqmuon.build_optimizer(name, _groups(params)).param_groups[0]["ns_method"] == "quintic"
    # quintic, its upstream-normalised forms (X / (||X|| + eps), issue 58's recipes), gram, aol, cubic
    known = r"quintic, quintic\+1e-7, quintic\+1e-8, gram, aol, cubic"
    with pytest.raises(ValueError, match=rf"Invalid ns_method: 'newton' \(known methods: {known}\)"):
        meqmuon.build_optimizer(name, _groups(params), ns_method="newton")
    with pytest.raises(ValueError, match=r"Invalid ns_method: 'quartic'"):
        meqmuon.build_optimizer(name, [{**_groups(params)[0], "ns_method": "quartic"}])


# ---- 2 gloo ranks: DDP and FSDP2 -----------------------------------------------------------------


def _ddp_worker(rank, name, foreach):
    params = _tensors()
    _run_meqmuon(name, params, foreach=foreach)
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_under_ddp_equals_one_process(name, foreach, tmp_path):
    results = _spawn(_ddp_worker, tmp_path, name, foreach)
    params = _tensors()
    _run_meqmuon(name, params, foreach=foreach)
    for r, got in enumerate(results):
        for i, (p, q) in enumerate(zip(got, params, strict=True)):
            assert torch.allclose(p, q.detach(), rtol=0, atol=1e-6), (name, r, i, (p - q).abs().max().item())


#: FSDP2 shards dim 0 of every tensor; views that need rows from several shards raise (engine), so the
#: sharded model is the 2-D matrices (odd sizes: a 7-row matrix over 2 ranks) and one expert stack.
FSDP_SHAPES = [(16, 8), (8, 16), (7, 12), (4, 6, 8)]


def _fsdp_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g) * 0.5) for s in FSDP_SHAPES]


def _fsdp_run(name, params, foreach):
    groups = [{"params": params, "kind": "hidden", "views": ["matrix"] * 3 + ["stacked"]}]
    opt = meqmuon.Muon(groups, lr=LR, weight_decay=WD, ns_dtype=torch.float32, foreach=foreach,
                       rules={"hidden": VARIANTS[name]()})
    for step in range(STEPS):
        for i, p in enumerate(params):
            g = torch.Generator().manual_seed(100 * step + i)
            full = torch.randn(FSDP_SHAPES[i], generator=g)
            p.grad = full if not hasattr(p, "device_mesh") else _shard(full, p)
        opt.step()


def _shard(full, p):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements)


def _fsdp_worker(rank, name, foreach):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    params = _fsdp_params()
    holder = _Holder({"hidden": params})
    fully_shard(holder, mesh=mesh)
    sharded = [getattr(holder, f"hidden_{i}") for i in range(len(params))]
    _fsdp_run(name, sharded, foreach)
    return [p.full_tensor().detach().clone() for p in sharded]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_under_fsdp2_equals_unsharded(name, foreach, tmp_path):
    results = _spawn(_fsdp_worker, tmp_path, name, foreach)
    params = _fsdp_params()
    _fsdp_run(name, params, foreach)
    moved = max((p - q).abs().max().item() for p, q in zip(params, _fsdp_params(), strict=True))
    assert moved > 1e-2
    for r, got in enumerate(results):
        for i, (p, q) in enumerate(zip(got, params, strict=True)):
            assert torch.allclose(p, q.detach(), rtol=0, atol=1e-6), (name, r, i, (p - q).abs().max().item())
