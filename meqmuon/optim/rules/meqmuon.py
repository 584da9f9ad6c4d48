"""MeqMuon's rules (paper *MeqMuon: Matrix-Equilibrating Muon for LLM Pretraining*, Algorithm 1):
hidden matrices (:class:`MeqHidden`, eq. 8), embeddings and LM heads (:class:`Equilibrate`, eq. 9)
and vectors (:class:`RmsNormalize`, eq. 10), each with its forms side by side: per-tensor
(``update``), batched (``directions_foreach``) and compiled (``compiled_bucket``, and for whole hidden
matrices :func:`adaptive_update`). The maths is :mod:`meqmuon.functional`'s and Newton-Schulz is
:mod:`meqmuon.optim.newton_schulz`'s; the forms differ only in how they batch and apply factors.

Every MeqMuon rule steps with ``W <- (1 - lr wd) W - lr rho D`` after ``B <- mu B + G`` (eq. 6).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import functional as F
from .. import blockwise
from .. import newton_schulz as NS
from ..buckets import Bucket
from ..compiled import compile_once, scalar
from ..distributed import state_like
from ..step import (
    HiddenRule,
    MomentumRule,
    StepContext,
    apply_update,
    buffer,
    direction_input,
    matrix_shape,
    stack_inputs,
    workspace,
)

# ---- hidden matrices (eq. 8) -------------------------------------------------------------------


def _scaled_step(
    param: Tensor, u: Tensor, row: Tensor, col: Tensor, group: dict, scale: float, scratch: dict[tuple, Tensor]
) -> None:
    """``W <- (1 - lr wd) W - lr scale (u * row) * col`` in two passes over the matrix (eager, per tensor).

    ``u * row`` goes into a float32 buffer kept in ``scratch`` per shape, and the column factor is
    applied inside the add (``addcmul_``), instead of a cast, two scalings and an add over four
    parameter-sized temporaries. ``param`` is updated through its matrix view; a non-contiguous 3-D+
    parameter has none (its matrix view would be a copy), so it is updated in its own shape.
    """
    lr, wd = group["lr"], group["weight_decay"]
    if param.ndim > 2 and not param.is_contiguous():
        F.decay_and_update_([param], [torch.mul(u, row).mul_(col).reshape(param.shape)], lr, wd, [scale])
        return
    # Cast, then scale in place: ``torch.mul(u, row, out=...)`` with a bf16 ``u`` and a float32 ``row``
    # would make a float32 copy of ``u`` first (CPU promotes mixed dtypes through a temporary).
    row_scaled = buffer(scratch, "row_scaled", u.shape, row.dtype, u.device).copy_(u).mul_(row)
    F.decay_and_update_([param.view(u.shape)], [row_scaled], lr, wd, [scale], col=col)


def _scaled_update(param: Tensor, u: Tensor, row: Tensor, col: Tensor, lr: Tensor, wd: Tensor, scale: Tensor) -> None:
    F.decay_and_update_([param], [F.scale_matrix(u, row, col).reshape(param.shape)], lr, wd, scale)


def scaled_update(param: Tensor, u: Tensor, row: Tensor, col: Tensor, group: dict, scale: float) -> None:
    """Compiled per-tensor form for row shards (FSDP2), whose statistics need cross-shard sums and stay
    eager: ``W <- (1 - lr wd) W - lr scale (u * row * col)`` in one compiled kernel (one parameter)."""
    lr, wd = scalar(group["lr"]), scalar(group["weight_decay"])
    # detach(): the same storage, but a plain tensor. Dynamo compiles nn.Parameter inputs with static
    # shapes (force_parameter_static_shapes), one graph per parameter shape, and with fullgraph=True
    # the ninth shape raises FailOnRecompileLimitHit.
    compile_once("scaled_update", _scaled_update)(param.detach(), u, row, col, lr, wd, scalar(scale))


def _adaptive_update(param: Tensor, u: Tensor, lr: Tensor, wd: Tensor, scale: Tensor) -> Tensor:
    row, col, chose_rows = F.adaptive_scales(u)  # without ``scratch``: inductor fuses the squares
    _scaled_update(param, u, row, col, lr, wd, scale)
    return chose_rows


#: (parameter dtype, NS output dtype, device, parameter ndim) for which the shape-generic graph exists.
_generic: set[tuple] = set()


def adaptive_update(param: Tensor, u: Tensor, group: dict, scale: float) -> Tensor:
    """Compiled per-tensor form for a whole (unsharded) matrix: statistics (eq. 4-5), the row/column
    choice (eq. 8) and the step in one graph; returns ``chose_rows``. The float32 direction is never
    materialised and the CV statistics' small ops join the graph (docs/benchmarks.md).

    One shape-generic graph serves every matrix shape (per dtypes, device and parameter rank, for
    contiguous parameters; another layout or a size of 1 gets a graph of its own, chosen by dynamo's
    guards), so that which code updates a matrix never depends on the order a process meets the
    matrices in: DDP ranks meet them in different orders and must match one process bit for bit.
    """
    fn = compile_once("adaptive_update", _adaptive_update)
    lr, wd, rho = scalar(group["lr"]), scalar(group["weight_decay"]), scalar(scale)
    key = (param.dtype, u.dtype, param.device, param.ndim)
    if key not in _generic:
        # Compile on distinct sizes (2 x 3, or 2 x 3 x 5 ...) first. Dynamo gives equal sizes one
        # symbol ("duck sizing"): had a square matrix come first, its graph would serve squares
        # only, and a second graph the rest.
        sizes = (2, 3, 5, 7, 11, 13, 17)[: param.ndim]
        dummy = torch.zeros(sizes, dtype=param.dtype, device=param.device)
        fn(dummy, torch.zeros((2, dummy[0].numel()), dtype=u.dtype, device=u.device), lr, wd, rho)
        _generic.add(key)
    # detach(): see scaled_update (nn.Parameter inputs would get one static graph per shape).
    return fn(param.detach(), u, lr, wd, rho)


def _momentum_inputs(grads: list[Tensor], bufs: list[Tensor], mu: Tensor, nesterov: bool) -> list[Tensor]:
    """Compiled forms: ``B <- mu B + G`` in place; the direction inputs ``G + mu B`` (Nesterov) or ``B``."""
    grads = [g.to(b.dtype) for g, b in zip(grads, bufs, strict=True)]
    F.momentum_(bufs, grads, mu)
    return F.direction_input(grads, bufs, mu, nesterov)


# The compiled forms of the batched step (``compiled_bucket``): one rule over one bucket, momentum to
# update, compiled once per bucket (``compiled.bucket_step``). lr, weight decay, momentum and rho are
# 0-D tensors; the bucket's layout, Nesterov and the Newton-Schulz settings are Python constants. The
# statistics are per bucket (inside one graph the eager step's cross-bucket sharing saves nothing).


def _meq_hidden_bucket(params, grads, bufs, counters, lr, wd, mu, rho, *, plain, nesterov, steps, coefficients,
                       ns_dtype):
    inputs = [x.reshape(x.shape[0], -1) for x in _momentum_inputs(grads, bufs, mu, nesterov)]
    flipped = [x.mT for x in inputs[plain:]]
    X = torch.stack(inputs[:plain] + flipped).to(ns_dtype)
    U = F.orthogonalize_stack(X, steps, coefficients, inplace=True)
    directions, chose = [], []
    for sub in (U[:plain], U[plain:].mT):  # the transposed members in their own orientation
        if sub.shape[0]:
            row, col, c = F.adaptive_scales(sub)
            directions.extend(F.scale_matrix(sub, row, col).unbind(0))
            chose.append(c)
    torch._foreach_add_(counters, torch.cat(chose).to(torch.int64).unbind(0))
    F.decay_and_update_(params, [d.reshape(p.shape) for d, p in zip(directions, params, strict=True)], lr, wd, rho)


class MeqHidden(HiddenRule):
    """MeqMuon for hidden matrices (paper Algorithm 1, eq. 8): ``U = Orth(B)``, then row- or
    column-normalise ``U``, whichever side has the larger CV (ties: rows). Scale ``rho``.

    Keeps a 0-D int64 counter ``rows_chosen`` per parameter on its device (no sync)."""

    name = "meq_hidden"
    hyperparameters = ("momentum", "nesterov", "rho", "ns_steps", "ns_coefficients", "ns_dtype")
    owner_state = ("rows_chosen",)
    state_views = {**MomentumRule.state_views, "rows_chosen": "counter"}

    def init_state(self, p, state, group, layout):
        super().init_state(p, state, group, layout)
        # One count per matrix. For one whole matrix a plain tensor even under FSDP2 (every rank
        # makes the same choice for it); stacked matrices are sharded with the parameter's dim 0.
        state["rows_chosen"] = state_like(p, layout.counter_shape, torch.int64) if layout.batch else torch.zeros(
            layout.counter_shape, dtype=torch.int64, device=p.device)

    def update(self, items, group, ctx):
        """Per-tensor form: ``U = Orth(X)`` matrix by matrix, the statistics, choice and step."""
        scratch: dict[tuple, Tensor] = {}
        for i, u in self.orthogonalized(items, group, ctx):
            it = items[i]
            if ctx.compile and ctx.split.psum is None:  # whole matrix: statistics and step in one graph
                chose_rows = adaptive_update(it.param, u, group, group["rho"])
            else:  # statistics eager (under FSDP2 they need cross-shard sums), then the scaled step
                squares = buffer(scratch, "squares", u.shape, F._stat_dtype(u), u.device)
                row, col, chose_rows = F.adaptive_scales(
                    u, psum=ctx.split.psum, rows=matrix_shape(it.shape)[0], scratch=squares
                )
                if ctx.compile:  # scaling, decay and step in one compiled kernel
                    scaled_update(it.param, u, row, col, group, group["rho"])
                else:
                    _scaled_step(it.param, u, row, col, group, group["rho"], scratch)
            it.state["rows_chosen"].add_(chose_rows)

    transposes = True

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Per bucket ``U = Orth(X)`` in one batched call, then the row/column choice (eq. 8) of every
        matrix of every bucket from one statistics pass (:func:`_meq_scales`), and ``U~ = U * row * col``."""
        us = self.orthogonalized_stacks(buckets, ranges, group, ctx)
        rho = group["rho"]
        if ctx.split.psum is not None:  # row shards (FSDP2): the statistics need sums over shards
            out = []
            for b, U in zip(buckets, us, strict=True):
                row, col, chose = F.adaptive_scales(U, psum=ctx.split.psum, rows=b.global_shape[0])
                out.append((F.scale_matrix(U, row, col).mul_(rho), [chose.to(torch.int64)]))
            return out
        chose, scales = _meq_scales(ctx, buckets, ranges, us, rho)
        out, o = [], 0
        for b, (lo, hi), U in zip(buckets, ranges, us, strict=True):
            k, m, n = hi - lo, *b.shape
            S = scales[o : o + k]
            D = torch.mul(U, S[:, 0, :m, None], out=torch.empty(U.shape, dtype=F._stat_dtype(U), device=U.device))
            out.append((D.mul_(S[:, 1, None, :n]), [chose[o : o + k]]))
            o += k
        return out

    def scale_foreach(self, bucket, group):
        return 1.0  # rho is folded into the factors

    def owner_stacks(self, bucket):
        return [torch.zeros(1, dtype=torch.int64, device=bucket.items[0].param.device)]

    def store_foreach(self, buckets, extras):
        counters = [it.state["rows_chosen"] for b in buckets for it in b.items]
        torch._foreach_add_(counters, [c for (chose,) in extras for c in chose.unbind(0)])

    compiled_bucket = staticmethod(_meq_hidden_bucket)

    def compiled_inputs(self, bucket, group):
        static = {"plain": bucket.plain, "steps": group["ns_steps"], "coefficients": group["ns_coefficients"],
                  "ns_dtype": NS.ns_dtype_of(group, bucket.items[0].param)}
        return [[it.state["rows_chosen"] for it in bucket.items]], static


def _meq_scales(ctx: StepContext, buckets: list[Bucket], ranges: list[tuple[int, int]], us: list[Tensor],
                rho: float) -> tuple[Tensor, Tensor]:
    """MeqMuon's choice and factors (paper eq. 4-5, 8) for every matrix of every bucket at once.

    The row and column norms of all ``K`` matrices go into one zero-padded ``(K, 2, L)`` buffer in
    the bucket's orientation: slot 0 the norms of the stack's rows, slot 1 of its columns, two
    reductions per bucket. :func:`functional.cv_of_norms` then gives all ``2K`` CVs in one call
    (padding counts as zero and is excluded, as zero rows are). The choice is made on each member's
    *original* rows: a constant index swaps the two CVs of transposed members (one ``gather``), so
    eq. 8's tie rule (rows) holds for them too. The inverse RMS factors and the choice are a few more
    whole-buffer kernels: the statistics cost a fixed number of kernels per step, not ~30 per
    matrix. ``rho`` is folded into the factors.

    Returns:
        ``chose`` ``(K,)`` int64 (1 where the original rows were normalised) and ``scales``
        ``(K, 2, L)`` in the bucket's orientation: slot 0 the factors of the stack's rows, slot 1 of
        its columns, 1 on the side not chosen.
    """
    dtype, device = F._stat_dtype(us[0]), us[0].device
    layout = tuple((b.key, lo, hi) for b, (lo, hi) in zip(buckets, ranges, strict=True))
    K, L = sum(hi - lo for lo, hi in ranges), max(max(b.shape) for b in buckets)
    norms = workspace(ctx, ("meq_norms", layout), (K, 2, L), dtype, device, zero=True)
    # Filled once per layout, and again only when rho changes: rho * sqrt(length) of each slot's
    # vectors (RMS = norm / sqrt(length)), the zero thresholds, which slot holds the original rows
    # (1 there) and the CV order that puts the original rows first.
    factor, threshold, side = workspace(ctx, ("meq_consts", layout), (3, K, 2, 1), dtype, device)
    order = workspace(ctx, ("meq_order", layout), (K, 2), torch.int64, device)
    if ctx.workspace.get(("meq_rho", layout)) != rho:
        ctx.workspace[("meq_rho", layout)] = rho
        o = 0
        for b, (lo, hi) in zip(buckets, ranges, strict=True):
            k, m, n = hi - lo, *b.shape
            p = max(0, min(b.plain - lo, k))  # members stored as they are; the rest are transposed
            factor[o : o + k, 0], factor[o : o + k, 1] = math.sqrt(n), math.sqrt(m)  # a stack row has n entries
            side[o : o + p, 0], side[o : o + p, 1] = 1.0, 0.0
            side[o + p : o + k, 0], side[o + p : o + k, 1] = 0.0, 1.0
            order[o : o + p, 0], order[o : o + p, 1] = 0, 1
            order[o + p : o + k, 0], order[o + p : o + k, 1] = 1, 0
            o += k
        torch.mul(factor, F.DELTA, out=threshold)  # RMS <= delta counts as zero (eq. 5)
        factor.mul_(rho)
    o = 0
    for b, (lo, hi), U in zip(buckets, ranges, us, strict=True):
        k, m, n = hi - lo, *b.shape
        torch.linalg.vector_norm(U, dim=-1, dtype=dtype, out=norms[o : o + k, 0, :m])
        torch.linalg.vector_norm(U, dim=-2, dtype=dtype, out=norms[o : o + k, 1, :n])
        o += k
    gamma = F.cv_of_norms(norms, threshold).gather(1, order)  # (K, 2): CVs of the original rows, columns
    chose = F.choose_rows(gamma[:, 0], gamma[:, 1], out=torch.empty(K, dtype=torch.int64, device=device))
    # rho / RMS, 0 for zero rows/columns (F.inverse_rms in norm form, rho folded in); masked_fill takes
    # its value without a scalar tensor kernel.
    scales = torch.div(factor, norms).masked_fill_(norms <= threshold, 0.0)
    scales.masked_fill_(chose[:, None, None] != side, 1.0)  # 1 on the side not chosen
    return chose, scales


# ---- embeddings and LM heads (eq. 9), vectors (eq. 10) --------------------------------------------


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
            X = stack_inputs(ctx, self.name, b, lo, hi, group, F._stat_dtype(p))
            m, n = b.global_shape
            X.div_(F.divisor_of_norms(torch.linalg.vector_norm(X, dim=-1), F.DELTA * math.sqrt(n)).unsqueeze(-1))
            col = _norms_along(X, -2, ctx.split.psum)  # under FSDP2: over all row shards
            # The step scale rho * sqrt(m) rides on the column divisor, so every MeqMuon rule steps
            # with scale 1 and their updates share one add (step_foreach_calls).
            col = F.divisor_of_norms(col, F.DELTA * math.sqrt(m / n)).div_(group["rho"] * math.sqrt(m))
            X.div_(col.unsqueeze(-2))
            out.append((X, []))
        return out

    def scale_foreach(self, bucket, group):
        return 1.0  # rho * sqrt(m) is folded into the column divisor

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
            X = stack_inputs(ctx, self.name, b, lo, hi, group, F._stat_dtype(b.items[0].param))
            flat = X.view(hi - lo, -1)
            d = math.prod(b.global_shape)
            norm = _norms_along(flat, -1, ctx.split.psum)
            # The step scale rho * sqrt(d) rides on the divisor (scale 1, as the other MeqMuon rules).
            flat.div_(F.divisor_of_norms(norm, F.DELTA * math.sqrt(d)).div_(group["rho"] * math.sqrt(d)).unsqueeze(-1))
            out.append((X, []))
        return out

    def scale_foreach(self, bucket, group):
        return 1.0  # rho * sqrt(d) is folded into the divisor

    compiled_bucket = staticmethod(_rms_bucket)
