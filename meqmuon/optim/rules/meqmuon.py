"""MeqMuon's rule for hidden matrices (paper *MeqMuon: Matrix-Equilibrating Muon for LLM Pretraining*,
Algorithm 1, eq. 8), a :class:`~meqmuon.optim.driver.HiddenRule`: the driver orthogonalises, ``post``
normalises. The embedding/head (eq. 9) and vector (eq. 10) rules are in ``normalize.py``.
"""

from __future__ import annotations

import torch

from ... import functional as F
from ..driver import HiddenRule


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
        """The same for all of a step's stacks: their statistics in one pass (a fixed number of kernels)."""
        Ds, rows = F.adaptive_normalize_stacks(Us, rho=group["rho"])
        torch._foreach_add_([st["rows_chosen"] for st in states], list(rows.split([U.shape[0] for U in Us])))
        return Ds
