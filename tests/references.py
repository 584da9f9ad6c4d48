"""Float64 references of every update rule, and the runners that hold the optimizers to them.

Each reference is a direct transcription of one update rule (paper Algorithm 1 / eq. 2-11, Moonlight
toy_train.py, NorMuon normuon.py, SCALE scale_optimizer.py, MaeChd/muon-eq muoneq.py: see
baselines.md; Polar Express: Amsel et al. 2025, Algorithm 1), written per parameter with plain loops
and sharing no code with meqmuon. :func:`run_against_reference` steps a named optimizer in one step
form next to :class:`RefOptimizer`; the rule families' files (test_meqmuon.py, test_muon.py,
test_normuon.py, test_scale.py, test_adamw.py) call it in every form. :func:`compare_scheduled_ns`
swaps the Newton-Schulz schedule of the reference (MuonEq in test_muon.py, Polar Express in
test_polar_express.py). test_views.py holds the views to the 2-D rules these references check.
"""

import contextlib
import copy
import math
from collections.abc import Callable, Iterator

import torch
from capabilities import CAPABILITIES, FORM_KWARGS
from tinynet import batches, loss_fn, make_model

import meqmuon

A, B, C = 3.4445, -4.7750, 2.0315
DELTA = 1e-7


# ---- independent float64 references ----------------------------------------------------------


def ns(H, steps=5):
    """Paper eq. 3 with the default quintic (:func:`compare_scheduled_ns` swaps in other schedules)."""
    tall = H.shape[0] > H.shape[1]
    X = H.T if tall else H
    X = X / torch.linalg.norm(X).clamp(min=1e-7)
    for _ in range(steps):
        Am = X @ X.T
        X = A * X + (B * Am + C * Am @ Am) @ X
    return X.T if tall else X


def rms_vec(X, dim):
    return X.square().mean(dim=dim).sqrt()


def cv(v):
    v = v[v > DELTA]
    if v.numel() == 0:
        return 0.0
    return (v.var(unbiased=False).sqrt() / v.mean()).item()


def inv(v):
    return torch.where(v > DELTA, 1 / v.clamp(min=DELTA), torch.zeros_like(v))


def meq_hidden_dir(U):
    r, c = rms_vec(U, 1), rms_vec(U, 0)
    if cv(r) >= cv(c):
        return U * inv(r)[:, None], True
    return U * inv(c)[None, :], False


def equilibrate_dir(Bm):
    Y = Bm * inv(rms_vec(Bm, 1))[:, None]
    return Y * inv(rms_vec(Y, 0))[None, :]


def muoneq_dir(U, mode):
    """MuonEq (MaeChd/muon-eq muoneq.py): rows and/or columns by (squared norm + 1e-8)^(-1/2) of the same U."""
    r = (U.square().sum(dim=1, keepdim=True) + 1e-8).rsqrt()
    c = (U.square().sum(dim=0, keepdim=True) + 1e-8).rsqrt()
    return {"R": U * r, "C": U * c, "RC": U * r * c}[mode]


#: The MuonEq mode of each named preset, for RefOptimizer below.
MUONEQ_MODE = {"muoneq-r": "R", "muoneq-c": "C", "muoneq-rc": "RC"}


def rms_dir(b):
    rms = b.square().mean().sqrt()
    return b * inv(rms)


#: Polar Express (Amsel et al. 2025, Algorithm 1): per-iteration (a, b, c), typed from the paper; PE
#: applies the safety factor 1.01 to all but the last.
PE_RAW = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
PE = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in PE_RAW[:-1]] + [PE_RAW[-1]]


def ns_scheduled(H, schedule, scale=1.0):
    """Paper eq. 3 with one (a, b, c) per iteration; input divided by scale * ||H||_F."""
    tall = H.shape[0] > H.shape[1]
    X = H.T if tall else H
    X = X / (torch.linalg.norm(X) * scale).clamp(min=1e-7)
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class RefOptimizer:
    """Per-parameter loop implementing a rule table in float64; kinds given explicitly."""

    def __init__(
        self,
        params_kinds,
        rules,
        lr,
        wd=0.1,
        mu=0.95,
        nesterov=True,
        rho=0.2,
        betas=(0.9, 0.95),
        eps=1e-8,
        beta2=0.95,
        scale_betas=(0.9, 0.999),
        scale_mu=0.9,
        eq_mode=None,
    ):
        self.items = params_kinds
        self.rules = rules
        self.lr, self.wd, self.mu, self.nesterov, self.rho = lr, wd, mu, nesterov, rho
        self.betas, self.eps, self.beta2 = betas, eps, beta2
        self.scale_betas, self.scale_mu = scale_betas, scale_mu
        self.eq_mode = eq_mode
        self.state = {id(p): {} for p, _ in params_kinds}
        self.rows_chosen = {id(p): 0 for p, _ in params_kinds}

    @torch.no_grad()
    def step(self):
        lr, wd = self.lr, self.wd
        for p, kind in self.items:
            g = p.grad
            st = self.state[id(p)]
            rule = self.rules[kind]
            st["t"] = st.get("t", 0) + 1
            t = st["t"]
            W = p.data
            if rule in ("meq_hidden", "moonlight_hidden", "muoneq_hidden", "normuon_hidden", "equilibrate",
                        "rms_normalize"):
                Bm = st.setdefault("B", torch.zeros_like(p))
                Bm.mul_(self.mu).add_(g)
                x = g + self.mu * Bm if self.nesterov else Bm.clone()
                if rule == "rms_normalize":
                    d, s = rms_dir(x), self.rho
                else:
                    X = x.reshape(x.shape[0], -1)
                    m, n = X.shape
                    if rule == "equilibrate":
                        d, s = equilibrate_dir(X), self.rho
                    elif rule == "meq_hidden":
                        d, rows = meq_hidden_dir(ns(X))
                        self.rows_chosen[id(p)] += int(rows)
                        s = self.rho
                    elif rule == "moonlight_hidden":
                        d, s = ns(X), self.rho * math.sqrt(max(m, n))
                    elif rule == "muoneq_hidden":
                        d, s = ns(muoneq_dir(X, self.eq_mode)), self.rho * math.sqrt(max(m, n))
                    else:  # normuon
                        O = ns(X)
                        v = st.setdefault("v", torch.zeros(m, dtype=X.dtype))
                        v.mul_(self.beta2).add_((1 - self.beta2) * O.square().mean(dim=1))
                        Oh = O / (v.sqrt()[:, None] + 1e-10)
                        Oh = Oh * torch.linalg.norm(O) / (torch.linalg.norm(Oh) + 1e-10)
                        d, s = Oh, self.rho * math.sqrt(max(m, n))
            elif rule in ("adamw", "adam_scale"):
                b1, b2 = self.betas if rule == "adamw" else self.scale_betas
                mm = st.setdefault("m", torch.zeros_like(p))
                vv = st.setdefault("v", torch.zeros_like(p))
                mm.mul_(b1).add_((1 - b1) * g)
                vv.mul_(b2).add_((1 - b2) * g * g)
                if rule == "adamw":  # torch.optim.AdamW: eps after bias correction
                    d = (mm / (1 - b1**t)) / ((vv / (1 - b2**t)).sqrt() + self.eps)
                else:  # SCALE's Adam: eps on the uncorrected sqrt(v)
                    d = math.sqrt(1 - b2**t) / (1 - b1**t) * mm / (vv.sqrt() + self.eps)
                s = 1.0
            elif rule == "scale_row":  # upstream views 3-D+ gradients as (size(0), -1)
                g2 = g.reshape(g.shape[0], -1)
                d, s = g2 / rms_vec(g2, 1).clamp(min=1e-8)[:, None], 1.0
            elif rule == "scale_col":
                d, s = g / rms_vec(g, 0).clamp(min=1e-8)[None, :], 1.0
            elif rule == "scale_head":
                mm = st.setdefault("m", torch.zeros_like(p))
                mm.mul_(self.scale_mu).add_((1 - self.scale_mu) * g)
                d, s = mm / rms_vec(mm, 1).clamp(min=1e-8)[:, None], 1.0
            else:
                raise AssertionError(rule)
            W.mul_(1 - lr * wd)
            W.add_(d.reshape(W.shape), alpha=-lr * s)


def kinds_of(model):
    return [(p, g["kind"]) for g in meqmuon.param_groups(model) for p in g["params"]]


# ---- runners: an optimizer next to its reference -----------------------------------------------------


@contextlib.contextmanager
def dynamo_eager_backend() -> Iterator[None]:
    """``torch.compile`` with dynamo's eager backend inside the block, whatever backend the caller asks for.

    What a compiled form's reference case tests is that the step traces (``fullgraph=True``) and
    computes the same maths; inductor's fusion costs tens of seconds per graph on CPU and is tested
    once, in test_compile.py. torch.compile is patched rather than a package setting, so that this
    does not depend on how the package keeps its graphs."""
    real = torch.compile

    def compile_eager(model=None, **kwargs):
        return real(model, **{**kwargs, "backend": "eager"})

    torch.compile = compile_eager
    try:
        yield
    finally:
        torch.compile = real


def run_against_reference(name: str, nesterov: bool, form: str, steps: int = 4):
    """``steps`` steps of optimizer ``name`` in step form ``form`` (capabilities.FORM_KWARGS) and of
    :class:`RefOptimizer` on two float64 copies of TinyNet, lr 0.03, weight decay 0.1, float64
    Newton-Schulz; returns ``(opt, ref, model, ref_model)``. In the batched forms TinyNet's down
    (12 x 36) and conv view ride transposed in the up (36 x 12) bucket where the rule allows it."""
    cap = CAPABILITIES[name]
    model = make_model()
    ref_model = copy.deepcopy(model)
    kw = dict(lr=0.03, weight_decay=0.1, **FORM_KWARGS[form])
    if cap.newton_schulz:
        kw["ns_dtype"] = torch.float64
    if cap.nesterov:
        kw["nesterov"] = nesterov
    ref = RefOptimizer(kinds_of(ref_model), meqmuon.rules_of(name), lr=0.03, nesterov=nesterov,
                       eq_mode=MUONEQ_MODE.get(name))
    with dynamo_eager_backend() if "compile" in form else contextlib.nullcontext():
        opt = meqmuon.build_optimizer(name, model, **kw)
        for ids in batches(steps):
            for m in (model, ref_model):
                m.zero_grad()
                loss_fn(m, ids).backward()
            opt.step()
            ref.step()
    return opt, ref, model, ref_model


def assert_parameters_close(model, ref_model, atol: float) -> None:
    """Every parameter of ``model`` within ``atol`` of ``ref_model``'s, and the steps moved them."""
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=atol, rtol=0), (n, (p - q).abs().max().item())
    start = make_model(dtype=next(model.parameters()).dtype)
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), start.parameters(), strict=True)) > 1e-2


def compare_scheduled_ns(name: str, ns_schedule_fn: Callable, steps: int = 3, foreach: bool = False, **kw):
    """``steps`` steps of ``name`` with float32 Newton-Schulz against RefOptimizer whose ``ns`` is
    ``ns_schedule_fn(H, step)`` (MuonEq's equilibration or Polar Express's schedule inside it), to
    1e-3 (float32 rounding in NS is ~1e-6 here; 1e-3 is the bound these checks were set with)."""
    global ns
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = meqmuon.build_optimizer(name, model, lr=0.03, ns_dtype=torch.float32, foreach=foreach, **kw)
    rules = dict(meqmuon.rules_of(name))
    if rules["hidden"] == "muoneq_hidden":
        rules["hidden"] = "moonlight_hidden"  # the reference's Muon, with E applied in ns() below
    ref = RefOptimizer(kinds_of(ref_model), rules, lr=0.03)
    real_ns = ns
    try:
        for step, ids in enumerate(batches(steps), start=1):
            ns = lambda H, steps=5, step=step: ns_schedule_fn(H, step)  # noqa: E731
            for m in (model, ref_model):
                m.zero_grad()
                loss_fn(m, ids).backward()
            opt.step()
            ref.step()
    finally:
        ns = real_ns
    assert_parameters_close(model, ref_model, atol=1e-3)
    return opt
