"""Muon-family baselines for hidden matrices: Moonlight's Muon (:class:`MoonlightHidden`) and MuonEq
(:class:`MuonEqHidden`), written as :class:`~meqmuon.optim.driver.HiddenRule` s (``pre``/``post``
around the driver's Newton-Schulz).

Momentum convention (Moonlight; paper eq. 6): ``B_t = mu * B_{t-1} + G_t``; the direction input is
``G_t + mu * B_t`` with Nesterov, else ``B_t``. torch.optim.Muon and NorMuon keep an EMA
``M = lerp(M, G, 1 - mu)`` instead; the two differ by the scalar ``1 - mu`` only, which every
normalising rule removes (Newton-Schulz, row/column/RMS normalisation are scale-invariant).
"""

from __future__ import annotations

import math

import torch

from ... import functional as F
from ..driver import HiddenRule


class MoonlightHidden(HiddenRule):
    """Muon in Moonlight's form (paper eq. 2; MoonshotAI/Moonlight c2ad5b2 examples/toy_train.py):
    ``W <- (1 - lr wd) W - lr * rho * sqrt(max(m, n)) * Orth(B)``. ``post`` is the identity: the
    factor is a step multiplier (:meth:`lr_scale`), which costs no pass over the matrix."""

    name = "moonlight_hidden"

    def lr_scale(self, m, n, group):
        return group["rho"] * math.sqrt(max(m, n))


class MuonEqHidden(MoonlightHidden):
    """MuonEq for hidden matrices (arXiv 2603.28254; MaeChd/muon-eq 99b6c8b ``muoneq.py``): Moonlight's
    Muon with the direction input equilibrated before Newton-Schulz,
    ``O = Orth(E(G + mu B))`` with ``E`` = :func:`functional.muoneq_equilibrate` in mode ``eq_mode``;
    in mode RC with ``eq_phase = P``, steps ``P, P+1, ...`` use R (upstream's phase switch: RC for
    the first ``P - 1`` steps), chosen per matrix from its own step count. Everything else is
    :class:`MoonlightHidden`. Buckets keep orientations apart: ``pre`` costs more kernels than the
    Newton-Schulz stack it would save."""

    name = "muoneq_hidden"
    #: Upstream's default mode (R) and no phase switch.
    defaults = {"eq_mode": "R", "eq_phase": None}
    state_views = {**HiddenRule.state_views, "step": "step"}
    transposes = False

    def validate(self, group):
        """``eq_mode`` one of :data:`F.MUONEQ_MODES`; ``eq_phase`` ``None`` or a step >= 1, in mode RC only."""
        if group["eq_mode"] not in F.MUONEQ_MODES:
            raise ValueError(f"Invalid MuonEq mode: {group['eq_mode']!r} (valid modes: {', '.join(F.MUONEQ_MODES)})")
        v = group["eq_phase"]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"Invalid phase: {v!r} (expected None or an integer step >= 1)")
        if v is not None and group["eq_mode"] != "RC":
            raise ValueError(f"phase={v} switches RC to R; it needs mode RC, got {group['eq_mode']!r}")

    def pre(self, X, group, state):
        mode, phase = group["eq_mode"], group["eq_phase"]
        if mode != "RC" or phase is None:
            return F.muoneq_equilibrate(X, mode)
        past = (state["step"] >= phase)[:, None, None]
        return torch.where(past, F.muoneq_equilibrate(X, "R"), F.muoneq_equilibrate(X, "RC"))
