"""Muon-VS for hidden matrices (arXiv 2601.14603): Moonlight's Muon whose Newton-Schulz input is the momentum
divided elementwise by the root of its bias-corrected variance, a :class:`~meqmuon.optim.driver.HiddenRule` with
its own direction input (:meth:`~meqmuon.optim.driver.HiddenRule.inputs`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..driver import HiddenRule
from ..inputs import number
from .muon import MoonlightHidden


class MuonVS(MoonlightHidden):
    r"""Muon-VS for hidden matrices (arXiv 2601.14603; official code jingru-lee/Variance-Adaptive-Muon
    75f78ad, ``NanoGPT/gpt2/models/optimizers/muon_vs.py``, ``Muon_VS.step``), with ``t`` the step count::

        V <- mu V + mu (1 - mu) (M - G)^2          (M before its update)
        M <- mu M + (1 - mu) G
        X = (mu / (1 - mu)) M / (1 - mu^t) + G     (bias-corrected Nesterov input)
        X <- X / (sqrt(V / (1 - mu^t)) + eps)      (the variance-stabilised input, elementwise)
        W <- (1 - lr wd) W - lr rho sqrt(max(m, n)) Orth(X)

    ``M`` is upstream's EMA (``momentum_buffer``), ``V`` its ``variance_buffer``; ``eps`` is ``vs_eps``
    (1e-8; named apart from AdamW's ``eps``). The step multiplier is Moonlight's (upstream's
    ``adjust_lr_for_muon(lr, 0.2, shape)``), so Muon-VS shares Muon's lr grid. Upstream ignores its
    ``nesterov`` flag (always this input); this rule refuses ``nesterov=False`` rather than ignore it. The
    repository's Suite_B copy (``Suite_B/muon_vs.py``) differs: ``sqrt(max(1, m/n))`` scale and a per-matrix
    gradient rescaling ``G max(1, 1/||G||)``; the NanoGPT copy, whose scale is ours, is the one followed.

    The input is elementwise in the gradient and both buffers, so it is made where the pieces lie (every layout:
    an FSDP2 row shard's, a tensor-parallel piece's, DDP's whole tensor) and only ``X`` travels to the owner."""

    name = "muon_vs"
    defaults = {"vs_eps": 1e-8}
    state_views: ClassVar[dict[str, str]] = {**HiddenRule.state_views, "variance_buffer": "param"}

    def validate(self, group):
        """``vs_eps`` > 0, ``nesterov`` True (upstream has no other input)."""
        if not group["nesterov"]:
            raise ValueError("Muon-VS has one input, the bias-corrected Nesterov one (upstream ignores its nesterov "
                             "flag); nesterov=False is not defined")
        group["vs_eps"] = number("vs_eps", group["vs_eps"], low=0.0, low_inclusive=False)

    def inputs(self, items, group):
        """The moments' updates and the variance-stabilised inputs of all ``items`` in ``torch._foreach_*``
        kernels (a fixed number, whatever the count)."""
        mu = group["momentum"]
        Ms = [it.state["momentum_buffer"] for it in items]
        Vs = [it.state["variance_buffer"] for it in items]
        Gs = [it.grad.to(m.dtype) for it, m in zip(items, Ms, strict=True)]
        diff = torch._foreach_sub(Ms, Gs)
        torch._foreach_mul_(Vs, mu)
        torch._foreach_addcmul_(Vs, diff, diff, value=mu * (1.0 - mu))
        torch._foreach_mul_(Ms, mu)
        torch._foreach_add_(Ms, Gs, alpha=1.0 - mu)
        corrections = [1.0 - mu ** it.state["step"] for it in items]
        X = (torch._foreach_div(Ms, [c * (1.0 - mu) / mu for c in corrections]) if mu > 0 else
             torch._foreach_mul(Ms, 0.0))
        torch._foreach_add_(X, Gs)
        den = torch._foreach_div(Vs, corrections)
        torch._foreach_sqrt_(den)
        torch._foreach_add_(den, group["vs_eps"])
        torch._foreach_div_(X, den)
        return X
