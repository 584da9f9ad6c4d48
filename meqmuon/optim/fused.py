"""``torch.compile``-fused update kernel for MeqMuon's hidden matrices (opt-in: ``compile=True``).

The kernel takes one parameter, its Newton-Schulz output ``U`` and the row/column factors of eq. 8
(``functional.adaptive_scales``), and applies the scaling, decoupled weight decay and the step in
one compiled region, ``W <- (1 - lr wd) W - lr rho U~``: the float32 direction is never
materialised. The statistics (row/column RMS, CVs) stay eager. They are reductions to vectors,
and under FSDP2 they need cross-shard sums, which is why ``compile=True`` works there too. The
embedding and head need no kernel: their row-blocked eager update (``blockwise.py``) already runs
at memory bandwidth. ``lr``, ``weight_decay`` and ``rho`` enter as 0-D float64 CPU tensors, not
Python floats, so a schedule that changes them every step does not recompile (Python floats would
be guarded as constants; tested with ``torch._dynamo`` counters). The graph is
``fullgraph=True`` and the step makes no host-device synchronisation. Newton-Schulz itself is not
compiled: it is matmuls.

The maths is the same as the eager rule; only the rounding of the fused expression differs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import functional as F

_compiled: dict[str, object] = {}


def _compile(name: str, fn):
    # Compiled lazily on first use so that importing meqmuon never touches inductor.
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, fullgraph=True)
    return _compiled[name]


def scalar(x: float) -> Tensor:
    """A 0-D float64 CPU tensor: a graph input whose value may change without recompiling."""
    return torch.tensor(x, dtype=torch.float64)


def _scaled_update(param: Tensor, u: Tensor, row: Tensor, col: Tensor, lr: Tensor, wd: Tensor, scale: Tensor) -> None:
    direction = F.scale_matrix(u, row, col)
    param.mul_(1 - lr * wd).sub_((direction.reshape(param.shape) * (lr * scale)).to(param.dtype))


def scaled_update(param: Tensor, u: Tensor, row: Tensor, col: Tensor, group: dict, scale: float) -> None:
    """``W <- (1 - lr wd) W - lr scale (u * row * col)`` in one compiled kernel (one parameter)."""
    lr, wd = scalar(group["lr"]), scalar(group["weight_decay"])
    _compile("scaled_update", _scaled_update)(param, u, row, col, lr, wd, scalar(scale))
