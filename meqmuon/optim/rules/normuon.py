"""NorMuon for hidden matrices (zichongli5/NorMuon d45c9a4; Li et al. 2025), as a ``post`` with state."""

from __future__ import annotations

import torch
from torch import Tensor

from ..driver import HiddenRule
from ..inputs import number
from .muon import MoonlightHidden

# NorMuon's epsilons (zichongli5/NorMuon d45c9a4, normuon.py): 1e-10 in the row scaling and in the
# Frobenius-norm restore.
NORMUON_EPS = 1e-10


def normuon_normalize(O: Tensor, v: Tensor, beta2: float) -> Tensor:
    """NorMuon's normalisation of ``O = Orth(B)``, a stack ``(k, m, n)``: ``v`` ``(k, m)`` (O's dtype)
    takes the row second moments in place; returns ``O'``."""
    scaled, _, restore = _normuon(O, v, beta2)
    return scaled.mul_(restore)


def normuon_factors(U: Tensor, v: Tensor, beta2: float) -> tuple[Tensor, Tensor]:
    """:func:`normuon_normalize` of ``U`` (``O = U`` in ``v``'s dtype) as factors: the row divisors
    ``sqrt(v) + eps`` ``(k, m, 1)`` and the restoring scale, one per matrix, as ``(k, 1, n)`` column factors, such
    that ``F.apply_factors(U, divisors, scale, divide=True)`` is its output bit for bit on any block of ``U``
    (``torch.div`` then ``mul_``, its own two products); ``v`` updated in place."""
    _, divisors, restore = _normuon(U.to(v.dtype), v, beta2)
    return divisors, restore.expand(U.shape[0], 1, U.shape[-1])


def _normuon(O: Tensor, v: Tensor, beta2: float) -> tuple[Tensor, Tensor, Tensor]:
    """``O / (sqrt(v) + eps)`` with ``v`` updated, its row divisors and the Frobenius-norm restoring scale."""
    v.lerp_(torch.mul(O, O).mean(dim=-1), 1.0 - beta2)
    divisors = v.sqrt().unsqueeze(-1) + NORMUON_EPS
    scaled = torch.div(O, divisors)
    dims = (-2, -1)
    fro_o, fro_s = torch.linalg.vector_norm(O, dim=dims), torch.linalg.vector_norm(scaled, dim=dims)
    return scaled, divisors, (fro_o / (fro_s + NORMUON_EPS))[..., None, None]


class NorMuonHidden(MoonlightHidden):
    """NorMuon for hidden matrices (zichongli5/NorMuon d45c9a4 ``normuon_update``; Li et al. 2025).

    ``O = Orth(B)``; per-row second moment ``v <- lerp(v, mean_j O_ij^2, 1 - beta2)`` (no bias
    correction, as upstream; it would be a global scalar that the restore below cancels);
    ``O' = O / (sqrt(v) + 1e-10)``; ``O' <- O' * ||O||_F / (||O'||_F + 1e-10)``; scale
    ``rho * sqrt(max(m, n))`` (dion's "rms_norm" adjust_lr, so NorMuon shares Muon's lr grid;
    upstream's single file uses ``sqrt(max(1, m/n))`` with a 10-20x larger lr instead).

    Deliberate deviation: ``v`` and the normalisation are at least float32 whatever the parameter dtype,
    avoiding the upstream bf16/fp32 ``lerp`` dtype failure (zichongli5/NorMuon issue 7, PR 10).
    """

    name = "normuon_hidden"
    defaults = {"beta2": 0.95}  # upstream's default
    state_views = {**HiddenRule.state_views, "second_moment": "rows"}
    transposes = False  # per-row state

    def validate(self, group):
        """``beta2`` in [0, 1)."""
        group["beta2"] = number("beta2", group["beta2"], low=0.0, high=1.0)

    #: :meth:`post_factors`' row factors are divisors (upstream divides; the bits stay upstream's).
    factors_divide = True

    def post(self, U, group, state):
        v = state["second_moment"]
        return normuon_normalize(U.to(v.dtype), v, group["beta2"])

    def post_factors(self, Us, group, states):
        """:meth:`post` as factors (:func:`normuon_factors`): an owner rank sends ``U`` in the Newton-Schulz
        dtype with them, and each rank divides and scales its piece (``transfer.py``)."""
        return [normuon_factors(U, st["second_moment"], group["beta2"]) for U, st in zip(Us, states, strict=True)]
