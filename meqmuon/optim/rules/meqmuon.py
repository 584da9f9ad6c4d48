"""MeqMuon's three rules (paper *MeqMuon: Matrix-Equilibrating Muon for LLM Pretraining*, Algorithm 1):

- hidden matrices (:class:`MeqHidden`, eq. 8): a :class:`~meqmuon.optim.driver.HiddenRule`, the driver
  orthogonalises, ``post`` row- or column-normalises whichever side has the larger CV;
- embeddings and LM heads (:class:`Equilibrate`, eq. 9): two-sided normalisation of the momentum;
- vectors (:class:`RmsNormalize`, eq. 10): global-RMS normalisation of the momentum.

The last two are directions of a stack of direction inputs
(:meth:`~meqmuon.optim.rule.MomentumRule.direction`), which the driver runs batched and compiled, and a
per-tensor form. Every MeqMuon rule steps with ``W <- (1 - lr wd) W - lr rho D`` after ``B <- mu B + G``
(eq. 6); ``rho`` rides on the normalisation's divisor, so all of MeqMuon's updates share one add in the
batched step.
"""

from __future__ import annotations

import math

import torch

from ... import functional as F
from .. import blockwise
from ..driver import HiddenRule, apply_update, direction_input
from ..rule import MomentumRule


class MeqHidden(HiddenRule):
    """MeqMuon for hidden matrices (paper Algorithm 1, eq. 8): ``U = Orth(B)``, then row- or
    column-normalise ``U``, whichever side has the larger CV (ties: rows), times ``rho``
    (:func:`meqmuon.functional.adaptive_normalize`).

    Keeps an int64 counter ``rows_chosen`` per matrix on its device (no sync); see
    :meth:`meqmuon.optim.engine.RoleOptimizer.selection_counts`."""

    name = "meq_hidden"
    state_views = {**HiddenRule.state_views, "rows_chosen": "counter"}

    def post(self, U, group, state):
        D, rows = F.adaptive_normalize(U, rho=group["rho"])
        state["rows_chosen"].add_(rows)
        return D

    def post_all(self, Us, group, states):
        """The same for all of a step's stacks: their statistics in one pass (a fixed number of kernels), and the
        choices counted (one kernel)."""
        Ds, rows = F.adaptive_normalize_stacks(Us, rho=group["rho"])
        torch._foreach_add_([st["rows_chosen"] for st in states], list(rows.split([U.shape[0] for U in Us])))
        return Ds

    def post_factors(self, Us, group, states):
        """Eq. 8's factors alone (:func:`F.adaptive_normalize_factors`), the choices counted as :meth:`post_all`
        counts them: an owner rank sends ``U`` in the Newton-Schulz dtype with them, and each rank scales its piece
        (``transfer.py``)."""
        factors, rows = F.adaptive_normalize_factors(Us, rho=group["rho"])
        torch._foreach_add_([st["rows_chosen"] for st in states], list(rows.split([U.shape[0] for U in Us])))
        return factors


class Equilibrate(MomentumRule):
    """MeqMuon for embeddings and LM heads (paper eq. 9): ``rho N_c(N_r(B))`` (:func:`F.equilibrate`).

    Per tensor row-blocked (``blockwise.equilibrate_step_``, the same statistics block by block), so the
    32000 x d direction is never materialised; ``compile=True`` leaves that form eager, as its two blocked
    passes already run at memory bandwidth (docs/benchmarks.md), and compiles the batched one."""

    name = "equilibrate"
    needs_matrix = True

    def direction(self, X, group, psum, shape):
        return F.equilibrate(X, psum=psum, rows=shape[0], scale=group["rho"], inplace=True)

    def update(self, items, group, ctx):
        """Per-tensor form: two row-blocked passes (``blockwise.equilibrate_step_``)."""
        for it in items:
            def rows_of(rows, out, it=it):  # into the block buffer ``out`` where it has the buffer's dtype
                same = out.dtype == it.state["momentum_buffer"].dtype
                return direction_input(it, group, rows, out if same else None)

            blockwise.equilibrate_step_(it.param, rows_of, group["lr"], group["weight_decay"], group["rho"],
                                        psum=ctx.split.psum, rows=it.shape[0])


class RmsNormalize(MomentumRule):
    """MeqMuon for 1-D parameters (paper eq. 10): ``rho B / (||B||_2 / sqrt(d))`` (:func:`F.rms_normalize`).

    Not split over DDP ranks: 1-D parameters are small, so repeating the update on every rank is
    cheaper than one broadcast per tensor."""

    name = "rms_normalize"
    split_work = False

    def direction(self, X, group, psum, shape):
        F.rms_normalize(X.view(X.shape[0], -1), psum=psum, numel=math.prod(shape), scale=group["rho"], inplace=True)
        return X

    def update(self, items, group, ctx):
        """Per-tensor form: each vector a stack of one."""
        for it in items:
            X = direction_input(it, group).reshape(1, -1)
            D = F.rms_normalize(X, psum=ctx.split.psum, numel=math.prod(it.shape), scale=group["rho"])
            apply_update([it], [D], [1.0], group)
