"""Muon-family baselines for hidden matrices: Moonlight's Muon (:class:`MoonlightHidden`) and MuonEq
(:class:`MuonEqHidden`), per-tensor (``update``) and batched (``directions_foreach``) forms side by side.

Momentum convention (Moonlight; paper eq. 6): ``B_t = mu * B_{t-1} + G_t``; the direction input is
``G_t + mu * B_t`` with Nesterov, else ``B_t``. torch.optim.Muon and NorMuon keep an EMA
``M = lerp(M, G, 1 - mu)`` instead; the two differ by the scalar ``1 - mu`` only, which every
normalising rule removes (Newton-Schulz, row/column/RMS normalisation are scale-invariant).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import functional as F
from ..step import HiddenRule, apply_update, shape_scale


class MoonlightHidden(HiddenRule):
    """Muon in Moonlight's form (paper eq. 2; MoonshotAI/Moonlight c2ad5b2 examples/toy_train.py):
    ``W <- (1 - lr wd) W - lr * rho * sqrt(max(m, n)) * Orth(B)``."""

    name = "moonlight_hidden"
    hyperparameters = ("momentum", "nesterov", "rho", "ns_steps", "ns_coefficients", "ns_dtype")

    def update(self, items, group, ctx):
        scratch: dict[tuple, Tensor] = {}
        for i, u in self.orthogonalized(items, group, ctx):
            apply_update([items[i]], [u], [group["rho"] * shape_scale(items[i].shape)], group, scratch)

    transposes = True

    def directions_foreach(self, buckets, ranges, group, ctx):
        us = self.orthogonalized_stacks(buckets, ranges, group, ctx)
        out = []
        for b, U in zip(buckets, us, strict=True):
            dtype = b.items[0].param.dtype  # cast once per bucket, so the update keeps to foreach's fast path
            out.append((U if U.dtype == dtype else U.to(dtype), []))
        return out

    def scale_foreach(self, bucket, group):
        return group["rho"] * shape_scale(bucket.global_shape)


class MuonEqHidden(MoonlightHidden):
    """MuonEq for hidden matrices (arXiv 2603.28254; MaeChd/muon-eq 99b6c8b ``muoneq.py``): Moonlight's
    Muon with the direction input equilibrated before Newton-Schulz,
    ``O = Orth(E(G + mu B))`` with ``E`` = :func:`functional.muoneq_equilibrate` in mode ``eq_mode``;
    in mode RC with ``eq_phase = P``, steps ``P, P+1, ...`` use R (upstream's phase switch: RC for
    the first ``P - 1`` steps). Everything else is :class:`MoonlightHidden`, so the only difference
    from ``muon`` is ``E``. Buckets never transpose: R on a transposed member would be C."""

    name = "muoneq_hidden"
    hyperparameters = MoonlightHidden.hyperparameters + ("eq_mode", "eq_phase")
    transposes = False

    @staticmethod
    def mode_at(group: dict, step: int) -> str:
        mode, phase = group["eq_mode"], group["eq_phase"]
        return "R" if mode == "RC" and phase is not None and step >= phase else mode

    def pre_ns(self, x, items, group, ctx):
        modes = {self.mode_at(group, it.state["step"]) for it in items}
        if len(modes) == 1:
            return F.muoneq_equilibrate(x, modes.pop(), ctx.split.psum)
        # Members past and before the phase switch in one stack (parameters that skipped steps):
        # R, or R and C, per member from the same input.
        rows = F.muoneq_equilibrate(x, "R", ctx.split.psum)
        both = F.muoneq_equilibrate(x, "RC", ctx.split.psum)
        use_rows = [self.mode_at(group, it.state["step"]) == "R" for it in items]
        return torch.stack([r if u else b for r, b, u in zip(rows, both, use_rows, strict=True)])


