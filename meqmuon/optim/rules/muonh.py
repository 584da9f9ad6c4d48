"""MuonH (hyperball) for hidden matrices (arXiv 2606.16899): Muon whose weights keep their initial Frobenius
norm, a :class:`~meqmuon.optim.driver.HiddenRule` with a step of its own
(:meth:`~meqmuon.optim.driver.HiddenRule.step_weights`): the projection reads each whole matrix's norm."""

from __future__ import annotations

import torch
from torch import Tensor

from ... import functional as F
from ..driver import HiddenRule

#: MuonH's lower bound on the update's Frobenius norm (levanter ``scale_invariant_update``: ``max(||u||, 1e-10)``).
MUONH_EPS = 1e-10


class MuonH(HiddenRule):
    r"""MuonH (hyperball) for hidden matrices (arXiv 2606.16899; official code marin-community/marin
    ab6e485, ``lib/levanter/src/levanter/optim/muonh.py``, ``scale_with_muonh``), per matrix::

        B <- mu B + G;  X = G + mu B (Nesterov) else B;  U = Orth(X)
        W' = W - lr U ||W||_F / max(||U||_F, 1e-10)
        W <- W' ||W||_F / ||W'||_F

    Every weight keeps its Frobenius norm (that of initialisation) and every step moves it by ``lr`` times
    that norm (before the projection): ``lr`` is a relative step. Upstream has no weight decay (the
    hyperball replaces it); with ``weight_decay > 0`` the decay ``W <- (1 - lr wd) W`` comes first, as in
    every rule here, and the projection then restores the norm, so it only enlarges the relative step by
    ``1 / (1 - lr wd)``. A matrix of a stacked or split view (3-D experts, fused projections) is its own
    hyperball, as levanter's stacked layers are."""

    name = "muonh_hidden"
    #: The weights keep their orientation: each matrix's projection reads its own norm.
    transposes = False

    def step_weights(self, W, D, scale, group):
        """The projection (:meth:`project`) of a stack of whole matrices: where they are not whole on one rank,
        their pieces travel to the owner with ``X`` and come back stepped (``exchange.py``)."""
        self.project(W, D, group)

    @staticmethod
    def project(W: Tensor, U: Tensor, group: dict, psum: F.PSum = None) -> None:
        """For every matrix of a stack ``W`` ``(K, ...)``, in place, with its direction ``U`` (same shape and
        dtype): ``R = ||W||`` (before the decay), the decay, the step ``lr R U / ||U||`` and the projection back
        to ``R``; the norms per matrix as ``(K, 1, ...)`` tensors on the device (no host sync), each line one
        kernel for the whole stack. ``psum``: ``W`` and ``U`` are row pieces of their matrices (FSDP2's or tensor
        parallelism's rows, ``placement.ROWS``), and each norm's sum of squares is summed over the pieces."""
        dims = tuple(range(1, W.ndim))

        def norm(t: Tensor) -> Tensor:
            if psum is None:
                return torch.linalg.vector_norm(t, dim=dims, keepdim=True)
            return psum(t.float().square().sum(dim=dims, keepdim=True)).sqrt().to(t.dtype)

        radii = norm(W)
        if group["weight_decay"] != 0:
            W.mul_(1.0 - group["lr"] * group["weight_decay"])  # the factor in float, as F.decay_ for bf16
        norms = norm(U).clamp_min_(MUONH_EPS)
        W.add_(U * (radii / norms), alpha=-group["lr"])
        new = norm(W)
        new.clamp_min_(MUONH_EPS)  # a zero matrix (R = 0) stays zero, where levanter gives NaN
        W.mul_(radii / new)
