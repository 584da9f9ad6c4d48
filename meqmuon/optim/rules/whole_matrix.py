"""Hidden-matrix rules that need more than ``pre``/``post`` around the driver's Newton-Schulz, written as
:class:`~meqmuon.optim.rule.SteppingRule` s (both forms their own): Muon-VS (its element-wise variance of
the momentum, and the raw gradient, enter the Newton-Schulz input) and MuonH (the update and the projection
read the weight's norm). What a :class:`~meqmuon.optim.driver.HiddenRule` would need for each, so that
they also compile, split their Newton-Schulz over DDP ranks and run under FSDP2 (docs/algorithm.md):
Muon-VS a parameter-shaped state view and a hook that replaces the direction input ``G + mu B``
elementwise; MuonH a per-matrix weight norm read before the step and a projection after it.

Both forms here: the per-tensor ``step`` (one matrix at a time, Newton-Schulz matrix by matrix) and the
batched ``step_foreach``, whose dispatched ops do not grow with depth (benchmarks/op_count.py): the
elementwise parts in ``torch._foreach_*`` kernels over all matrices, and per shape bucket one stack, one
batched Newton-Schulz on every device (as the driver's batched form), one cast, and MuonH's norms and
rescales on the stack. ``compile=True`` runs them eagerly, as every stepping rule; under DDP every rank
repeats the (identical) step. Under FSDP2 a row shard is not a matrix: they raise ``ValueError`` at the
first step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from ... import functional as F
from ...precision import resolve_ns_dtype
from ..calls import Item, StepContext, state_dtype
from ..driver import Bucket, HiddenRule, make_buckets, matrix_shape, stack_tensors, unstack
from ..inputs import flag, number
from ..newton_schulz import NS_METHODS
from ..rule import MOMENTUM, RHO, SteppingRule


class _MatrixSteppingRule(SteppingRule):
    """What both rules share: the Newton-Schulz hyperparameters (``HiddenRule``'s, checked by it), the
    momentum ``mu`` and Nesterov flag, whole matrices only, and ``Orth`` of a stack."""

    needs_matrix = True
    orthogonalizes = True
    defaults = {**HiddenRule.defaults, "momentum": MOMENTUM, "nesterov": True}
    state_views: ClassVar[dict[str, str]] = {"momentum_buffer": "param"}

    def validate(self, group):
        """``momentum`` in [0, 1), ``nesterov`` a bool, and ``HiddenRule``'s checks of the ``ns_*`` keys."""
        group["momentum"] = number("momentum", group["momentum"], low=0.0, high=1.0)
        flag("nesterov", group["nesterov"])
        HiddenRule.validate(self, group)  # type: ignore[arg-type]  # reads the group's ns_* keys only

    def state_elements(self, layout):
        return len(self.state_views) * math.prod(layout.batch) * layout.rows * layout.cols

    def init_state(self, p, state, group, layout):
        state["step"] = 0
        for key in self.state_views:
            state[key] = torch.zeros_like(p, dtype=state_dtype(p, group), memory_format=torch.preserve_format)

    def _whole(self, items: Sequence[Item]) -> None:
        for it in items:
            if tuple(it.param.shape) != tuple(it.shape):
                raise ValueError(f"rule {self.name!r} needs whole matrices, but {it.name!r} is a row shard "
                                 f"{tuple(it.param.shape)} of {tuple(it.shape)} (FSDP2): its step reads whole-matrix "
                                 "norms; use DDP or one process")

    @staticmethod
    def orth(X: Tensor, group: dict, batched: bool = False) -> Tensor:
        """``Orth`` of a stack ``(K, m, n)`` by the group's Newton-Schulz method, steps, coefficients and dtype:
        matrix by matrix (the per-tensor form), or with ``batched`` as one batched call with ``X`` as scratch
        (the batched form: one call per shape bucket, not per matrix)."""
        dtype = resolve_ns_dtype(group["ns_dtype"], X.device)
        return NS_METHODS[group["ns_method"]].function(X, group["ns_steps"], group["ns_coefficients"], dtype,
                                                       batched=batched, inplace=batched)

    def bucket_directions(self, items: Sequence[Item], inputs: Sequence[Tensor], group: dict,
                          ctx: StepContext) -> Iterator[tuple[Bucket, Tensor]]:
        """Per shape bucket of ``items``, one after another: the bucket and ``Orth`` of its members' ``inputs``
        as one stack ``(K, m, n)`` in the parameters' dtype (one stack, one batched Newton-Schulz, one cast)."""
        by_item = dict(zip(map(id, items), inputs, strict=True))
        for b in make_buckets(items, matrix=True, transpose=False):
            X = stack_tensors(ctx, self.name, b, [by_item[id(it)] for it in b.items])
            yield b, self.orth(X, group, batched=True).to(b.items[0].param.dtype)

    @staticmethod
    def matrices(tensors: Sequence[Tensor]) -> list[Tensor]:
        """Each tensor as its matrix view ``(shape[0], prod(rest))``."""
        return [t.reshape(matrix_shape(t.shape)) for t in tensors]


class MuonVS(_MatrixSteppingRule):
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
    gradient rescaling ``G max(1, 1/||G||)``; the NanoGPT copy, whose scale is ours, is the one followed."""

    name = "muon_vs"
    defaults = {"rho": RHO, "vs_eps": 1e-8}
    state_views = {"momentum_buffer": "param", "variance_buffer": "param"}

    def validate(self, group):
        """``rho`` > 0, ``vs_eps`` > 0, ``nesterov`` True (upstream has no other input)."""
        if not group["nesterov"]:
            raise ValueError("Muon-VS has one input, the bias-corrected Nesterov one (upstream ignores its nesterov "
                             "flag); nesterov=False is not defined")
        group["rho"] = number("rho", group["rho"], low=0.0, low_inclusive=False)
        group["vs_eps"] = number("vs_eps", group["vs_eps"], low=0.0, low_inclusive=False)

    def _inputs(self, items: Sequence[Item], group: dict) -> list[Tensor]:
        """The moments' updates (in ``torch._foreach_*`` kernels) and the variance-stabilised inputs."""
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
        X = torch._foreach_div(Ms, [c * (1.0 - mu) / mu for c in corrections]) if mu > 0 else \
            torch._foreach_mul(Ms, 0.0)
        torch._foreach_add_(X, Gs)
        den = torch._foreach_div(Vs, corrections)
        torch._foreach_sqrt_(den)
        torch._foreach_add_(den, group["vs_eps"])
        torch._foreach_div_(X, den)
        return X

    def _scale(self, it: Item, group: dict) -> float:
        return group["rho"] * math.sqrt(max(matrix_shape(it.shape)))

    def step(self, items, group, ctx):
        """Per tensor: each matrix's input, ``Orth`` and update in turn."""
        self._whole(items)
        ctx.emit(items, [it.grad for it in items], "gradient")
        for it in items:
            (X,) = self._inputs([it], group)
            D = self.orth(self.matrices([X])[0][None], group)[0]
            F.decay_and_update_([it.param], [D.reshape(it.param.shape).to(it.param.dtype)], group["lr"],
                                group["weight_decay"], [self._scale(it, group)])

    def step_foreach(self, items, group, ctx):
        """Batched: the moments and inputs of all matrices in a few kernels, ``Orth`` per shape bucket, the
        update in one add per distinct scale."""
        self._whole(items)
        ctx.emit(items, [it.grad for it in items], "gradient")
        params, directions, scales = [], [], []
        for b, U in self.bucket_directions(items, self._inputs(items, group), group, ctx):
            params += [it.param for it in b.items]
            directions += unstack(b, U)
            scales += [self._scale(it, group) for it in b.items]
        F.decay_and_update_(params, directions, group["lr"], group["weight_decay"], scales)


#: MuonH's lower bound on the update's Frobenius norm (levanter ``scale_invariant_update``: ``max(||u||, 1e-10)``).
MUONH_EPS = 1e-10


class MuonH(_MatrixSteppingRule):
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

    def _inputs(self, items: Sequence[Item], group: dict) -> list[Tensor]:
        bufs = [it.state["momentum_buffer"] for it in items]
        grads = [it.grad.to(b.dtype) for it, b in zip(items, bufs, strict=True)]
        F.momentum_(bufs, grads, group["momentum"])
        return F.direction_input(grads, bufs, group["momentum"], group["nesterov"])

    @staticmethod
    def _project(W: Tensor, U: Tensor, group: dict) -> None:
        """For every matrix of a stack ``W`` ``(K, ...)``, in place, with its direction ``U`` (same shape and
        dtype): ``R = ||W||`` (before the decay), the decay, the step ``lr R U / ||U||`` and the projection back
        to ``R``; the norms per matrix as ``(K, 1, ...)`` tensors on the device (no host sync), each line one
        kernel for the whole stack."""
        dims = tuple(range(1, W.ndim))
        radii = torch.linalg.vector_norm(W, dim=dims, keepdim=True)
        if group["weight_decay"] != 0:
            W.mul_(1.0 - group["lr"] * group["weight_decay"])  # the factor in float, as F.decay_ for bf16
        norms = torch.linalg.vector_norm(U, dim=dims, keepdim=True).clamp_min_(MUONH_EPS)
        W.add_(U * (radii / norms), alpha=-group["lr"])
        new = torch.linalg.vector_norm(W, dim=dims, keepdim=True)
        new.clamp_min_(MUONH_EPS)  # a zero matrix (R = 0) stays zero, where levanter gives NaN
        W.mul_(radii / new)

    def step(self, items, group, ctx):
        """Per tensor: each matrix's momentum, ``Orth``, step and projection in turn (on the parameter itself,
        a stack of one)."""
        self._whole(items)
        ctx.emit(items, [it.grad for it in items], "gradient")
        for it in items:
            (X,) = self._inputs([it], group)
            D = self.orth(self.matrices([X])[0][None], group)[0]
            self._project(it.param[None], D.reshape(it.param.shape).to(it.param.dtype)[None], group)

    def step_foreach(self, items, group, ctx):
        """Batched: momentum in ``torch._foreach_*`` kernels, then per shape bucket ``Orth`` and the projection
        on a stack of the bucket's weights, copied back in one ``torch._foreach_copy_`` (a bucket at a time:
        the transient is one bucket's weights, not all of them)."""
        self._whole(items)
        ctx.emit(items, [it.grad for it in items], "gradient")
        for b, U in self.bucket_directions(items, self._inputs(items, group), group, ctx):
            W = torch.stack([it.param.reshape(b.shape) for it in b.items])
            self._project(W, U, group)
            torch._foreach_copy_([it.param for it in b.items], unstack(b, W))
