"""``torch.compile``-fused kernels for MeqMuon's hidden matrices (opt-in: ``compile=True``).

Two compiled graphs, both taking one parameter and its Newton-Schulz output ``U``:

``adaptive_update``  whole matrices (one process, or a DDP owner): the row/column RMS and CVs
                     (eq. 4-5), the row-or-column choice (eq. 8), the scaling, decoupled weight
                     decay and the step, ``W <- (1 - lr wd) W - lr rho U~``, in one graph. The
                     float32 direction is never materialised, and the ~30 small eager ops of the
                     CV statistics become part of the graph. In one process, alternating with
                     ``scaled_update`` after eager statistics, step by step on Llama-60M (2 CPU
                     threads, 20 steps each): per-step median ratio 0.94-0.97x in four runs,
                     faster in 15-18 of 20 steps.
``scaled_update``    row shards under FSDP2, whose statistics need cross-shard sums (``psum``, a
                     collective): the statistics stay eager (``functional.adaptive_scales``) and
                     only the scaling, decay and step are compiled.

The embedding and head need no kernel: their row-blocked eager update (``blockwise.py``) already
runs at memory bandwidth. ``lr``, ``weight_decay`` and ``rho`` enter as 0-D float64 CPU tensors,
not Python floats, so a schedule that changes them every step does not recompile (Python floats
would be guarded as constants; tested with ``torch._dynamo`` counters). The graphs are
``fullgraph=True`` and shape-generic (``dynamic=True``; parameters enter detached, see
``scaled_update``), the choice stays a tensor, and the step makes no host-device synchronisation.
Newton-Schulz itself is not compiled: it is matmuls.

The maths is the same as the eager rule; only the rounding of the fused expressions differs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import functional as F

_compiled: dict[str, object] = {}


def _compile(name: str, fn):
    # Compiled lazily on first use so that importing meqmuon never touches inductor. dynamic=True:
    # one shape-generic graph from the first call, used for every matrix shape. With per-shape
    # graphs, which shape a process meets first would decide which matrices run a static and which
    # the dynamic graph; DDP ranks meet different shapes first, and their bits could then differ
    # from one process's. It also keeps models with many shapes clear of dynamo's recompile limit.
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, fullgraph=True, dynamic=True)
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
    # detach(): the same storage, but a plain tensor. Dynamo compiles nn.Parameter inputs with static
    # shapes (force_parameter_static_shapes), one graph per parameter shape, and with fullgraph=True
    # the ninth shape raises FailOnRecompileLimitHit.
    _compile("scaled_update", _scaled_update)(param.detach(), u, row, col, lr, wd, scalar(scale))


def _adaptive_update(param: Tensor, u: Tensor, lr: Tensor, wd: Tensor, scale: Tensor) -> Tensor:
    row, col, chose_rows = F.adaptive_scales(u)  # without ``scratch``: inductor fuses the squares
    _scaled_update(param, u, row, col, lr, wd, scale)
    return chose_rows


#: (parameter dtype, NS output dtype, device, parameter ndim) for which the shape-generic graph exists.
_generic: set[tuple] = set()


def adaptive_update(param: Tensor, u: Tensor, group: dict, scale: float) -> Tensor:
    """Statistics (eq. 4-5), the row/column choice (eq. 8) and the step in one compiled graph, for a
    whole (unsharded) matrix; returns ``chose_rows``.

    One shape-generic graph serves every matrix shape (per dtypes, device and parameter rank, for
    contiguous parameters; another layout or a size of 1 gets a graph of its own, chosen by dynamo's
    guards), so that which code updates a matrix never depends on the order a process meets the
    matrices in: DDP ranks meet them in different orders and must match one process bit for bit.
    """
    fn = _compile("adaptive_update", _adaptive_update)
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
