"""MeqMuon's elementwise rules (paper Algorithm 1): embeddings and LM heads (:class:`Equilibrate`,
two-sided normalisation, eq. 9) and vectors (:class:`RmsNormalize`, eq. 10), each with its forms
side by side: per-tensor (``update``), batched (``directions_foreach``) and compiled
(``compiled_bucket``). Every MeqMuon rule steps with ``W <- (1 - lr wd) W - lr rho D`` after
``B <- mu B + G`` (eq. 6).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import functional as F
from .. import blockwise
from ..driver import MomentumRule, apply_update, direction_input, matrix_shape, stack_inputs


def _momentum_inputs(grads: list[Tensor], bufs: list[Tensor], mu: Tensor, nesterov: bool) -> list[Tensor]:
    """Compiled forms: ``B <- mu B + G`` in place; the direction inputs ``G + mu B`` (Nesterov) or ``B``."""
    grads = [g.to(b.dtype) for g, b in zip(grads, bufs, strict=True)]
    F.momentum_(bufs, grads, mu)
    return F.direction_input(grads, bufs, mu, nesterov)


def _equilibrate_bucket(params, grads, bufs, lr, wd, mu, rho, *, nesterov):
    inputs = _momentum_inputs(grads, bufs, mu, nesterov)
    X = torch.stack([x.reshape(x.shape[0], -1) for x in inputs])
    F.decay_and_update_(params, [d.reshape(p.shape) for d, p in zip(F.equilibrate(X).unbind(0), params,
                                                                      strict=True)], lr, wd, rho)


def _rms_bucket(params, grads, bufs, lr, wd, mu, rho, *, nesterov):
    inputs = _momentum_inputs(grads, bufs, mu, nesterov)
    X = torch.stack(inputs).to(F._stat_dtype(inputs[0]))
    flat = F.rms_normalize(X.reshape(X.shape[0], -1), dim=-1)
    F.decay_and_update_(params, [d.reshape(p.shape) for d, p in zip(flat.unbind(0), params, strict=True)],
                        lr, wd, rho)


def _norms_along(x: Tensor, dim: int, psum) -> Tensor:
    """L2 norms of ``x`` along ``dim``; with ``psum`` (FSDP2 row shards) over all shards' sums of squares."""
    return torch.linalg.vector_norm(x, dim=dim) if psum is None else psum(x.square().sum(dim=dim)).sqrt_()


class Equilibrate(MomentumRule):
    """MeqMuon for embeddings and LM heads (paper eq. 9): ``N_c(N_r(B))``, scale ``rho``.

    Per tensor row-blocked (``blockwise.equilibrate_step_``), so the 32000 x d direction is never
    materialised; ``compile=True`` leaves that form eager, as its two blocked passes already run at
    memory bandwidth (docs/benchmarks.md), and compiles the batched one (:func:`_equilibrate_bucket`)."""

    name = "equilibrate"
    needs_matrix = True
    hyperparameters = ("momentum", "nesterov", "rho")

    def update(self, items, group, ctx):
        """Per-tensor form: two row-blocked passes (``blockwise.equilibrate_step_``)."""
        for it in items:
            blockwise.equilibrate_step_(
                it.param,
                lambda rows, it=it: direction_input(it, group, rows),
                group["lr"],
                group["weight_decay"],
                group["rho"],
                psum=ctx.split.psum,
                rows=matrix_shape(it.shape)[0],
            )

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Whole-matrix form (the row blocks are a CPU cache device): with ``Y = X / ||X_i,:||``,
        ``N_c(N_r(X)) = sqrt(m) Y / ||Y_:,j||``, so only norms and two scalings touch the stack;
        ``r_i <= delta`` is ``||X_i,:|| <= delta sqrt(n)``, ``c_j <= delta`` is
        ``||Y_:,j|| <= delta sqrt(m / n)``."""
        out = []
        for b, (lo, hi) in zip(buckets, ranges, strict=True):
            p = b.items[0].param
            X = stack_inputs(ctx, self.name, b, lo, hi, F._stat_dtype(p))
            m, n = b.global_shape
            X.div_(F.divisor_of_norms(torch.linalg.vector_norm(X, dim=-1), F.DELTA * math.sqrt(n)).unsqueeze(-1))
            col = _norms_along(X, -2, ctx.split.psum)  # under FSDP2: over all row shards
            # The step scale rho * sqrt(m) rides on the column divisor, so every MeqMuon rule steps
            # with scale 1 and their updates share one add (step_foreach_calls).
            col = F.divisor_of_norms(col, F.DELTA * math.sqrt(m / n)).div_(group["rho"] * math.sqrt(m))
            X.div_(col.unsqueeze(-2))
            out.append((X, []))
        return out


    compiled_bucket = staticmethod(_equilibrate_bucket)


class RmsNormalize(MomentumRule):
    """MeqMuon for 1-D parameters (paper eq. 10): ``B / (||B||_2 / sqrt(d))``, scale ``rho``.

    Not split over DDP ranks: 1-D parameters are small, so repeating the update on every rank is
    cheaper than one broadcast per tensor."""

    name = "rms_normalize"
    hyperparameters = ("momentum", "nesterov", "rho")
    split_work = False

    def update(self, items, group, ctx):
        psum = ctx.split.psum
        for it in items:
            direction = F.rms_normalize(direction_input(it, group), psum=psum, numel=math.prod(it.shape))
            apply_update([it], [direction], [group["rho"]], group)

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Same-shape vectors as one ``(k, d)`` stack: ``B / ||B||_2 * sqrt(d)`` row by row."""
        out = []
        for b, (lo, hi) in zip(buckets, ranges, strict=True):
            X = stack_inputs(ctx, self.name, b, lo, hi, F._stat_dtype(b.items[0].param))
            flat = X.view(hi - lo, -1)
            d = math.prod(b.global_shape)
            norm = _norms_along(flat, -1, ctx.split.psum)
            # The step scale rho * sqrt(d) rides on the divisor (scale 1, as the other MeqMuon rules).
            flat.div_(F.divisor_of_norms(norm, F.DELTA * math.sqrt(d)).div_(group["rho"] * math.sqrt(d)).unsqueeze(-1))
            out.append((X, []))
        return out


    compiled_bucket = staticmethod(_rms_bucket)
