"""Row-block eager update of the embedding and LM head (MeqMuon's two-sided rule, paper eq. 9).

The direction ``N_c(N_r(X))`` of a ``32000 x d`` matrix is ``X_ij / (r_i c_j)``, with ``r`` the row
RMS of ``X`` and ``c`` the column RMS of the row-normalised ``X``. Computed whole, it takes several
matrix-sized float32 temporaries; on CPU each fresh 64 MB temporary is memory the allocator hands
back to the OS and page-faults in again, which costs more than the arithmetic (docs/benchmarks.md). This
module computes the same update in two passes over blocks of rows small enough to stay in cache
(``BLOCK_ELEMENTS``):

1. per block: ``X_b`` (made on demand), ``r_b``, and the block's column sums of ``(X_b / r_b)^2``;
2. ``c`` from the summed column sums (reduced across shards with ``psum`` under FSDP2), then per
   block: ``W_b <- (1 - lr wd) W_b - lr rho (X_b / r_b) / c``.

The result equals ``functional.equilibrate`` followed by the step except for the summation order
of the column sums (float rounding; ``tests/test_blockwise.py`` checks it against a float64
reference written from eq. 9).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import functional as F
from .commit import Gate, update_

#: Elements per block (2 MiB of float32): the block's few temporaries stay in cache, and there are
#: few enough blocks that per-op dispatch does not dominate; the fastest size timed (docs/benchmarks.md).
BLOCK_ELEMENTS = 1 << 19


def row_blocks(m: int, n: int, block_elements: int = BLOCK_ELEMENTS) -> list[slice]:
    """Contiguous row ranges of at most ``max(1, block_elements // n)`` rows covering ``range(m)``."""
    step = max(1, block_elements // max(n, 1))
    return [slice(i, min(i + step, m)) for i in range(0, m, step)]


def equilibrate_step_(
    param: Tensor,
    input_rows: Callable[[slice, Tensor], Tensor],
    lr: float,
    weight_decay: float,
    rho: float,
    delta: float = F.DELTA,
    psum: F.PSum = None,
    rows: int | None = None,
    block_elements: int = BLOCK_ELEMENTS,
    gate: Gate | None = None,
) -> None:
    """``W <- (1 - lr wd) W - lr rho N_c(N_r(X))`` in place, block of rows by block of rows.

    Args:
        param: the parameter (any layout; rows are its first dimension, as in ``as_matrix``).
        input_rows: ``input_rows(rows, out)`` returns rows ``rows`` of the direction input ``X`` (shaped
            like ``param[rows]``), written into ``out`` (a float32, or float64, buffer of that shape) or
            as a tensor of its own, which is only read; called twice per row.
        lr, weight_decay, rho: the step.
        delta: rows/columns with RMS at or below ``delta`` are treated as zero (paper eq. 4-5).
        psum, rows: under FSDP2, ``param`` is a row shard; ``psum`` sums the column statistics
            over shards and ``rows`` is the global row count.
        block_elements: elements per block of rows (see :func:`row_blocks`).
        gate: the step's skip flag (``commit.Gate``): a skipped step writes nothing (``commit.update_``).
    """
    m = param.shape[0]
    n = param[:1].numel() if m else param.numel()
    stat = F.stat_dtype(param)
    blocks = row_blocks(m, n, block_elements)
    inv_r = torch.empty(m, dtype=stat, device=param.device)
    col_sumsq = torch.zeros(n, dtype=stat, device=param.device)
    # One block's buffer, reused by every block of both passes: fresh block-sized temporaries cost
    # page faults on CPU, and a reused one stays in cache.
    buf = torch.empty(max(b.stop - b.start for b in blocks) * n if blocks else 0, dtype=stat, device=param.device)

    def block(b: slice) -> tuple[Tensor, Tensor]:
        """Rows ``b`` of ``X`` (at least float32; ``buf`` or a tensor only read) and ``buf``'s matrix for them."""
        k = b.stop - b.start
        out = buf[: k * n]
        x = input_rows(b, out.view(k, *param.shape[1:])).reshape(k, n)
        out = out.view(k, n)
        return (x if x.dtype == stat else out.copy_(x)), out

    for b in blocks:
        x, out = block(b)
        inv_r[b] = F.row_factors(x, delta)
        y = torch.mul(x, inv_r[b].unsqueeze(-1), out=out)
        col_sumsq += y.mul_(y).sum(dim=0)
    inv_c = F.inverse_rms(F.rms_of_sumsq(col_sumsq, rows if psum is not None else m, psum), delta)
    for b in blocks:
        x, out = block(b)
        direction = torch.mul(x, inv_r[b].unsqueeze(-1), out=out).mul_(inv_c)
        w = param[b]
        update_([w], [direction.reshape(w.shape).to(w.dtype)], lr, weight_decay, [rho], gate=gate)
