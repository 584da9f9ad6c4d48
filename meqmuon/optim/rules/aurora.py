"""Aurora for hidden matrices (arXiv 2606.27715; official code tilde-research/aurora-release 3d79a5c,
``src/aurora.py`` and ``src/polar.py``): a leverage-uniform polar factor of tall (and, transposed, wide)
matrices by diagonal preconditioning, as a ``pre`` that runs the first polar itself and hands the
preconditioned input to the driver's Newton-Schulz for the last one."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...precision import resolve_ns_dtype
from ..driver import HiddenRule
from ..inputs import number, positive_int
from ..newton_schulz import NS_METHODS

#: Aurora's polar (``src/polar.py``): 12 iterations of the simple quintic ``p(s) = 2s - 1.5s^3 + 0.5s^5``
#: (modded-nanogpt track 3's baseline polar), the Aurora preset's ``ns_steps`` / ``ns_coefficients``.
AURORA_NS_STEPS = 12
AURORA_NS_COEFFICIENTS = (2.0, -1.5, 0.5)
#: Upstream's ``eps``: row norms are clamped at it, row sums of squares at its square.
AURORA_EPS = 1e-7


def aurora_input(X: Tensor, group: dict) -> Tensor:
    r"""The preconditioned input ``D X`` of Aurora's last polar, for a stack ``X`` ``(K, m, n)`` (``X D`` for a
    wide stack, computed on its transpose: ``polar(G D) = polar(D G^T)^T``); a square stack as it is.

    Tall ``(M, N)``, ``M > N``: ``D_0 = diag(1 / max(||X_i,:||, eps))``; for ``k = 0 .. pp_iterations - 2``:
    ``U_k = polar(D_k X)``, ``D_{k+1} = D_k ((N / M) / max(||(U_k)_i,:||^2, eps^2))^{pp_beta}`` (the row
    leverage pushed toward the uniform ``N / M``); returns ``D_{last} X``, whose polar is Aurora's update.
    ``polar`` is the group's Newton-Schulz (``ns_method``, ``ns_steps``, ``ns_coefficients``, ``ns_dtype``),
    the same as the driver's; at least float32, as upstream's ``G32``."""
    m, n = X.shape[-2:]
    if m == n:  # square: plain polar (upstream: "no leverage freedom to exploit")
        return X
    wide = m < n
    T = X.mT if wide else X
    M, N = T.shape[-2:]
    G = T.to(torch.promote_types(T.dtype, torch.float32))
    D = 1.0 / torch.linalg.vector_norm(G, dim=-1, keepdim=True).clamp(min=AURORA_EPS)
    polar = NS_METHODS[group["ns_method"]].function
    dtype = resolve_ns_dtype(group["ns_dtype"], G.device)
    for _ in range(group["pp_iterations"] - 1):
        U = polar(D * G, group["ns_steps"], group["ns_coefficients"], dtype, batched=True)
        row_sq = U.to(G.dtype).square().sum(dim=-1, keepdim=True).clamp(min=AURORA_EPS * AURORA_EPS)
        D = D * ((N / M) / row_sq).pow(group["pp_beta"])
    Y = D * G
    return Y.mT if wide else Y


class AuroraHidden(HiddenRule):
    """Aurora for hidden matrices: ``D = polar(aurora_input(X))`` (:func:`aurora_input`), stepped
    ``W <- (1 - lr wd) W - lr sqrt(max(1, m / n)) D`` (upstream's "spectral aspect-ratio scaling").

    Upstream keeps an EMA momentum ``M = lerp(M, G, 1 - mu)`` and a Nesterov input ``lerp(G, M, mu)``:
    ``(1 - mu)`` times Moonlight's ``G + mu B``, a scalar that the row normalisation ``D_0`` and the polar
    remove (exactly but for the clamps). ``pp_iterations`` (default 2) polars per step, ``pp_beta`` (0.5)
    the damping exponent, upstream's defaults. Deliberately not done: upstream's ``isfinite().all()`` check
    (a host-device sync each step)."""

    name = "aurora_hidden"
    #: The step multiplier is not symmetric in ``(m, n)``, and the batched forms give a stack one multiplier, that
    #: of its orientation: an ``(n, m)`` matrix must not join the ``(m, n)`` stack transposed.
    transposes = False
    defaults = {"pp_iterations": 2, "pp_beta": 0.5}

    def validate(self, group):
        """``pp_iterations`` an integer >= 1, ``pp_beta`` > 0."""
        positive_int("pp_iterations", group["pp_iterations"])
        group["pp_beta"] = number("pp_beta", group["pp_beta"], low=0.0, low_inclusive=False)

    def pre(self, X, group):
        return aurora_input(X, group)

    def lr_scale(self, m, n, group):
        return math.sqrt(max(1.0, m / n))
