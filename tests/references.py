"""Float64 references of every update rule, shared by the tests that hold an optimizer to them.

Each reference is a direct transcription of one update rule (paper Algorithm 1 / eq. 2-11, Moonlight
toy_train.py, NorMuon normuon.py, SCALE scale_optimizer.py, MaeChd/muon-eq muoneq.py: see
baselines.md; Polar Express: Amsel et al. 2025, Algorithm 1), written per parameter with plain loops
and sharing no code with meqmuon. Used by test_optimizers.py (the named optimizers to 1e-10 in
float64), test_foreach.py (through it), test_prior_art.py (MuonEq and Polar Express) and test_views.py
(through the 2-D rules).
"""

import math

import torch

import meqmuon

A, B, C = 3.4445, -4.7750, 2.0315
DELTA = 1e-7


# ---- independent float64 references ----------------------------------------------------------


def ns(H, steps=5):
    """Paper eq. 3 with the default quintic (test_prior_art.py swaps in other schedules)."""
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
