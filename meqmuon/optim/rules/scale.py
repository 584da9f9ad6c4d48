"""SCALE (Glentis et al.; official code OptimAI-Lab/Minimalist_LLM_Pretraining f5bd4e7,
mem_eff_pt/pt_scale/scale_optimizer.py): slice-wise RMS normalisation of the raw gradient (hidden
rows, embedding columns) and of an EMA momentum (LM head rows), per-tensor and batched forms side
by side. The 1-D parameters use SCALE's Adam (``adam.AdamScale``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from ... import functional as F
from .. import commit
from ..calls import state_dtype
from ..driver import apply_update, grads_like, make_buckets, matrix_shape, stack_tensors, unstack
from ..inputs import number
from ..rule import SteppingRule

# SCALE divides by the slice RMS clamped at this value (OptimAI-Lab/Minimalist_LLM_Pretraining
# f5bd4e7, mem_eff_pt/pt_scale/scale_optimizer.py: ``.clamp_min(1e-8)``).
SCALE_EPS = 1e-8


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _row_rms_divisor(x: Tensor) -> Tensor:
    """SCALE's row divisor ``max(RMS of each row, 1e-8)`` of a matrix or a stack of matrices."""
    # Row statistics are local to a row shard: no sums over shards are needed.
    return x.square().mean(dim=-1, keepdim=True).sqrt_().clamp_(min=SCALE_EPS)


def _col_rms_divisor(x: Tensor, psum: F.PSum = None, rows: int | None = None) -> Tensor:
    """SCALE's column divisor ``max(RMS of each column, 1e-8)``; with ``psum`` over all row shards."""
    if psum is None:
        ms = x.square().mean(dim=-2, keepdim=True)
    else:  # column sums of squares over all row shards
        ms = psum(x.square().sum(dim=-2, keepdim=True)) / rows
    return ms.sqrt_().clamp_(min=SCALE_EPS)


def _scale_row(x: Tensor, psum: F.PSum = None, rows: int | None = None) -> Tensor:
    x = _at_least_fp32(F.as_matrix(x))
    return x / _row_rms_divisor(x)


def _scale_col(x: Tensor, psum: F.PSum = None, rows: int | None = None) -> Tensor:
    x = _at_least_fp32(F.as_matrix(x))
    return x / _col_rms_divisor(x, psum, rows)


class _ScaleRaw(SteppingRule):
    """SCALE without momentum: normalise the raw gradient slice-wise; no state. Its writes read the step's skip
    flag (``ctx.gate``)."""

    normalise: ClassVar[Callable[[Tensor], Tensor]]
    needs_matrix = True
    gates_itself = True

    def state_elements(self, layout):
        return 0

    def init_state(self, p, state, group, layout):
        state["step"] = 0

    def step(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        psum = ctx.split.psum
        directions = [type(self).normalise(it.grad, psum, matrix_shape(it.shape)[0]) for it in items]
        apply_update(items, directions, [1.0] * len(items), group, gate=ctx.gate)

    #: The batched form's divisor of a gradient stack ``(k, m, n)`` (psum, global rows).
    divisor: ClassVar[Callable[..., Tensor]]

    def step_foreach(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        params, directions, stacks = [], [], []
        for b in make_buckets(items, matrix=True, transpose=False):
            G = stack_tensors(ctx, self.name, b, [it.grad for it in b.items])
            G.div_(type(self).divisor(G, ctx.split.psum, b.global_shape[0]))
            params += [it.param for it in b.items]
            directions += unstack(b, G)
            stacks.append(G)
        commit.update_(params, directions, group["lr"], group["weight_decay"], [1.0] * len(params), stacks,
                       gate=ctx.gate)


class ScaleRow(_ScaleRaw):
    """SCALE for hidden matrices: raw gradient, each row (output neuron) to unit RMS over inputs."""

    name = "scale_row"
    normalise = staticmethod(_scale_row)
    divisor = staticmethod(lambda x, psum=None, rows=None: _row_rms_divisor(x))


class ScaleCol(_ScaleRaw):
    """SCALE for the input embedding ``(vocab, d)``: each column (hidden coordinate) to unit RMS over the vocabulary."""

    name = "scale_col"
    normalise = staticmethod(_scale_col)
    divisor = staticmethod(_col_rms_divisor)


class ScaleHead(SteppingRule):
    """SCALE for the LM head: EMA momentum ``m <- lerp(m, g, 1 - beta)`` (no Nesterov, no bias
    correction), then each vocabulary row to unit RMS. Its writes read the step's skip flag (``ctx.gate``)."""

    name = "scale_head"
    needs_matrix = True
    gates_itself = True
    defaults = {"momentum": 0.9}  # upstream's beta for the head's EMA

    def validate(self, group):
        """``momentum`` in [0, 1)."""
        group["momentum"] = number("momentum", group["momentum"], low=0.0, high=1.0)

    state_views = {"momentum_buffer": "param"}

    def state_elements(self, layout):
        return math.prod(layout.batch) * layout.rows * layout.cols

    def init_state(self, p, state, group, layout):
        state["step"] = 0
        state["momentum_buffer"] = torch.zeros_like(
            p, dtype=state_dtype(p, group), memory_format=torch.preserve_format
        )

    def step(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        directions = []
        for it in items:
            m = it.state["momentum_buffer"]
            commit.lerp_([m], [it.grad.to(m.dtype)], 1.0 - group["momentum"], fused=True, gate=ctx.gate)
            directions.append(_scale_row(m))
        apply_update(items, directions, [1.0] * len(items), group, gate=ctx.gate)

    def step_foreach(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        ms = [it.state["momentum_buffer"] for it in items]
        commit.lerp_(ms, grads_like(items, ms), 1.0 - group["momentum"], fused=False, gate=ctx.gate)
        params, directions, stacks = [], [], []
        for b in make_buckets(items, matrix=True, transpose=False):
            M = stack_tensors(ctx, self.name, b, [it.state["momentum_buffer"] for it in b.items])
            M.div_(_row_rms_divisor(M))
            params += [it.param for it in b.items]
            directions += unstack(b, M)
            stacks.append(M)
        commit.update_(params, directions, group["lr"], group["weight_decay"], [1.0] * len(params), stacks,
                       gate=ctx.gate)
