"""Muon+ for hidden matrices (arXiv 2602.21545; official code K1seki221/MuonPlus 8a9ace1,
``utils/optim/muon_plus.py``): Muon with one row and/or column normalisation after Newton-Schulz."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..driver import HiddenRule

#: Muon+'s ``norm_mode`` values (upstream ``valid_modes``): none, one side, or one side then the other.
MUONPLUS_MODES = ("none", "col", "row", "col_row", "row_col")
#: Upstream adds 1e-7 inside the square root of every row/column sum of squares (its ``norm_eps`` argument,
#: 1e-8 by default, is stored but never read: ``apply_post_polar_norm`` hard-codes 1e-7).
MUONPLUS_EPS = 1e-7


def muonplus_normalize(U: Tensor, mode: str) -> Tensor:
    """Muon+'s post-polar normalisation of a stack ``U`` ``(K, m, n)`` (upstream ``apply_post_polar_norm``):
    ``row``: ``U_ij / sqrt(sum_j U_ij^2 + 1e-7)``; ``col``: the same over ``i``; ``row_col``: rows, then
    columns of the result; ``col_row``: columns, then rows; ``none``: ``U``. At least float32."""
    U = U.to(torch.promote_types(U.dtype, torch.float32))
    for side in ([] if mode == "none" else mode.split("_")):
        dim = -1 if side == "row" else -2
        U = U / torch.sqrt((U * U).sum(dim=dim, keepdim=True) + MUONPLUS_EPS)
    return U


class MuonPlusHidden(HiddenRule):
    """Muon+ for hidden matrices: ``D = Norm_mode(Orth(X))``, stepped ``W <- (1 - lr wd) W - lr sqrt(m/n) D``.

    Momentum, Nesterov and decoupled weight decay are Moonlight's, as upstream's (``buf.mul_(mu).add_(g)``,
    ``g + mu buf``). Step multiplier ``sqrt(fan_out / fan_in) = sqrt(m / n)``: upstream's ``rms_scaling=True``
    default (no ``max(1, .)``, no ``rho``), so Muon+ has its own lr grid (its Llama-60M config: lr 0.04).
    ``norm_mode`` default ``row_col``: the mode of upstream's Llama configs (``configs/llama60M_row-col.yaml``,
    ``llama350M_row-col.yaml``; its GPT-small config uses ``col_row``), the family of our ``llama-micro``.
    """

    name = "muonplus_hidden"
    #: The step multiplier is not symmetric in ``(m, n)``, and the batched forms give a stack one multiplier, that
    #: of its orientation: an ``(n, m)`` matrix must not join the ``(m, n)`` stack transposed.
    transposes = False
    defaults = {"norm_mode": "row_col"}

    def validate(self, group):
        """``norm_mode`` one of :data:`MUONPLUS_MODES`."""
        if group["norm_mode"] not in MUONPLUS_MODES:
            raise ValueError(f"Invalid Muon+ norm_mode: {group['norm_mode']!r} (valid: {', '.join(MUONPLUS_MODES)})")

    def post(self, U, group):
        return muonplus_normalize(U, group["norm_mode"])

    def lr_scale(self, m, n, group):
        return math.sqrt(m / n)
