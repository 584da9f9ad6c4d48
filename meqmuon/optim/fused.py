"""``torch.compile``-fused normalisation + update kernels for MeqMuon's rules (opt-in: ``compile=True``).

Each kernel takes one parameter, computes its MeqMuon direction and applies decoupled weight decay
and the step in one compiled region, ``W <- (1 - lr wd) W - lr rho U~``, so the direction is never materialised in
memory apart from what inductor keeps. ``lr``, ``weight_decay`` and ``rho`` enter as 0-D float64
CPU tensors, not Python floats: a schedule that changes them every step does not recompile
(Python floats would be guarded as constants; tested with ``torch._dynamo`` counters). The
row/column choice stays a tensor (``torch.where``), so the graphs are ``fullgraph=True`` and the
step makes no host-device synchronisation. Newton-Schulz itself is not compiled: it is matmuls.

The maths is the same as the eager rules (``functional.py``); only the rounding of the fused
elementwise expressions differs.
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


def _apply(param: Tensor, direction: Tensor, lr: Tensor, wd: Tensor, scale: Tensor) -> None:
    param.mul_(1 - lr * wd).sub_((direction.reshape(param.shape) * (lr * scale)).to(param.dtype))


def _meq_hidden(u: Tensor, param: Tensor, rows_chosen: Tensor, lr: Tensor, wd: Tensor, rho: Tensor) -> None:
    normed, chose_rows = F.adaptive_normalize(u)
    _apply(param, normed, lr, wd, rho)
    rows_chosen.add_(chose_rows)


def _equilibrate(x: Tensor, param: Tensor, lr: Tensor, wd: Tensor, rho: Tensor) -> None:
    _apply(param, F.equilibrate(F.as_matrix(x)), lr, wd, rho)


def _rms(x: Tensor, param: Tensor, lr: Tensor, wd: Tensor, rho: Tensor) -> None:
    _apply(param, F.rms_normalize(x), lr, wd, rho)


def _step_scalars(group: dict) -> tuple[Tensor, Tensor, Tensor]:
    return scalar(group["lr"]), scalar(group["weight_decay"]), scalar(group["rho"])


def meq_hidden_update(u: Tensor, param: Tensor, rows_chosen: Tensor, group: dict) -> None:
    """Adaptive one-sided normalisation (eq. 8) of one NS output ``u`` and the update of ``param``;
    adds the row choice (0 or 1) to the counter ``rows_chosen``."""
    _compile("meq_hidden", _meq_hidden)(u, param, rows_chosen, *_step_scalars(group))


def equilibrate_update(x: Tensor, param: Tensor, group: dict) -> None:
    """Two-sided normalisation (eq. 9) of ``x`` and the update of ``param``."""
    _compile("equilibrate", _equilibrate)(x, param, *_step_scalars(group))


def rms_update(x: Tensor, param: Tensor, group: dict) -> None:
    """Global-RMS normalisation (eq. 10) of ``x`` and the update of ``param``."""
    _compile("rms", _rms)(x, param, *_step_scalars(group))
