"""``torch.compile``-fused normalisation + update kernels for MeqMuon's rules (opt-in: ``compile=True``).

Each kernel computes a MeqMuon direction and applies decoupled weight decay and the step in one
compiled region, ``W <- (1 - lr wd) W - lr rho U~``, so the direction is never materialised in
memory apart from what inductor keeps. ``lr``, ``weight_decay`` and ``rho`` enter as 0-D float64
CPU tensors, not Python floats: a schedule that changes them every step does not recompile
(Python floats would be guarded as constants; tested with ``torch._dynamo`` counters). The
row/column choice stays a tensor (``torch.where``), so the graphs are ``fullgraph=True`` and the
step makes no host-device synchronisation. Newton-Schulz itself is not compiled: it is matmuls.

The maths is the same as the eager rules (``functional.py``); only the rounding of the fused
elementwise expressions differs.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def _apply(params: Sequence[Tensor], directions: Tensor | Sequence[Tensor], lr: Tensor, wd: Tensor, scale: Tensor):
    for p, d in zip(params, directions, strict=True):
        p.mul_(1 - lr * wd).sub_((d.reshape(p.shape) * (lr * scale)).to(p.dtype))


def _meq_hidden(ortho: Tensor, params: list[Tensor], lr: Tensor, wd: Tensor, rho: Tensor) -> Tensor:
    normed, chose_rows = F.adaptive_normalize(ortho)
    _apply(params, normed.unbind(0), lr, wd, rho)
    return chose_rows


def _equilibrate(inputs: list[Tensor], params: list[Tensor], lr: Tensor, wd: Tensor, rho: Tensor) -> None:
    _apply(params, [F.equilibrate(F.as_matrix(x)) for x in inputs], lr, wd, rho)


def _rms(inputs: list[Tensor], params: list[Tensor], lr: Tensor, wd: Tensor, rho: Tensor) -> None:
    _apply(params, [F.rms_normalize(x) for x in inputs], lr, wd, rho)


def meq_hidden_update(ortho: Tensor, params: list[Tensor], lr: float, wd: float, rho: float) -> Tensor:
    """Adaptive one-sided normalisation (eq. 8) of a stack of NS outputs and the update of ``params``.

    Returns the bool tensor of row choices, one per matrix.
    """
    return _compile("meq_hidden", _meq_hidden)(ortho, list(params), scalar(lr), scalar(wd), scalar(rho))


def equilibrate_update(inputs: list[Tensor], params: list[Tensor], lr: float, wd: float, rho: float) -> None:
    """Two-sided normalisation (eq. 9) of ``inputs`` and the update of ``params``."""
    _compile("equilibrate", _equilibrate)(list(inputs), list(params), scalar(lr), scalar(wd), scalar(rho))


def rms_update(inputs: list[Tensor], params: list[Tensor], lr: float, wd: float, rho: float) -> None:
    """Global-RMS normalisation (eq. 10) of ``inputs`` and the update of ``params``."""
    _compile("rms", _rms)(list(inputs), list(params), scalar(lr), scalar(wd), scalar(rho))
