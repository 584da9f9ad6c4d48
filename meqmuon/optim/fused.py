"""``torch.compile``-fused kernels for MeqMuon's hidden matrices (opt-in: ``compile=True``).

Two compiled graphs, both taking one parameter and its Newton-Schulz output ``U``:

``adaptive_update``  whole matrices (one process, or a DDP owner): the row/column RMS and CVs
                     (eq. 4-5), the row-or-column choice (eq. 8), the scaling, decoupled weight
                     decay and the step, ``W <- (1 - lr wd) W - lr rho U~``, in one graph. The
                     float32 direction is never materialised, and the ~30 small eager ops of the
                     CV statistics become part of the graph: a few percent faster than
                     ``scaled_update`` after eager statistics (docs/benchmarks.md).
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

import types

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


# ---- the batched step (foreach=True): one graph per shape bucket ----------------------------------
#
# Each function below is one MeqMuon rule over one bucket, from momentum to the update, written
# once with lists of tensors and compiled once per bucket (``bucket_step``). lr, weight decay,
# momentum and rho enter as 0-D float64 CPU tensors, so a schedule never recompiles; everything
# static (the bucket's layout, Nesterov, the Newton-Schulz settings) is a Python constant. The
# maths is the eager batched step's (rules.py); only the statistics are per bucket here (inside
# one graph the eager step's cross-bucket sharing saves nothing).


def _momentum_inputs(grads: list[Tensor], bufs: list[Tensor], mu: Tensor, nesterov: bool) -> list[Tensor]:
    """``B <- mu B + G`` in place; the direction inputs ``G + mu B`` (Nesterov) or ``B``."""
    grads = [g.to(b.dtype) for g, b in zip(grads, bufs, strict=True)]
    torch._foreach_mul_(bufs, mu)
    torch._foreach_add_(bufs, grads)
    if not nesterov:
        return bufs
    return torch._foreach_add(torch._foreach_mul(bufs, mu), grads)


def _apply(params: list[Tensor], directions: list[Tensor], lr: Tensor, wd: Tensor, step: Tensor) -> None:
    """``W <- (1 - lr wd) W - step D`` for every parameter."""
    torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_add_(params, torch._foreach_mul([d.reshape(p.shape) for d, p in zip(directions, params,
                                                                                        strict=True)], -step))


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
    _apply(params, directions, lr, wd, lr * rho)


def _equilibrate_bucket(params, grads, bufs, lr, wd, mu, rho, *, nesterov):
    inputs = _momentum_inputs(grads, bufs, mu, nesterov)
    X = torch.stack([x.reshape(x.shape[0], -1) for x in inputs])
    _apply(params, list(F.equilibrate(X).unbind(0)), lr, wd, lr * rho)


def _rms_bucket(params, grads, bufs, lr, wd, mu, rho, *, nesterov):
    inputs = _momentum_inputs(grads, bufs, mu, nesterov)
    X = torch.stack(inputs).to(F._stat_dtype(inputs[0]))
    flat = X.reshape(X.shape[0], -1)
    rms = torch.linalg.vector_norm(flat, dim=-1) / flat.shape[1] ** 0.5
    _apply(params, list((flat * F._inverse(rms, F.DELTA).unsqueeze(-1)).unbind(0)), lr, wd, lr * rho)


BUCKET_FUNCTIONS = {"meq_hidden": _meq_hidden_bucket, "equilibrate": _equilibrate_bucket, "rms_normalize": _rms_bucket}

#: The torch.compile backend of the bucket graphs (tests may use a cheaper one to count recompiles).
BACKEND = "inductor"
_bucket_graphs: dict[tuple, object] = {}


def bucket_step(rule: str, key: tuple, *args, **static) -> None:
    """Run rule ``rule``'s compiled graph for the bucket ``key`` (compiled on first use).

    ``args`` are the bucket's tensor lists and the 0-D hyperparameter tensors; ``static`` the rule's
    Python constants. One graph per bucket, compiled once, with no recompile limit on the number of
    buckets: dynamo caches graphs per code object (at most ``recompile_limit`` = 8 per code object,
    and ``fullgraph=True`` raises on the ninth), so each bucket compiles its own copy of the rule's
    function, with its own code object, and ``static`` baked in as its keyword defaults.

    The copy itself is what ``torch.compile`` gets: given a ``functools.partial`` (no source file,
    not a function), it compiles dynamo's ``external_utils.wrap_inline`` around it, whose ``inner``
    is one code object for every such callable; every bucket then landed in that code object's
    cache, its entries told apart by a guard on ``fn.func.__code__``, and the ninth bucket hit the
    limit whatever the copies' code objects. A graph is keyed on the
    member count and the first dtype of each tensor list as well (two param groups with the same
    shapes but another size or ``state_dtype`` get copies of their own, not a recompile of one
    copy), and on ``BACKEND``.
    """
    signature = tuple((len(a), a[0].dtype if a else None) if isinstance(a, list) else None for a in args)
    full = (rule, key, signature, tuple(sorted(static.items())), BACKEND)
    graph = _bucket_graphs.get(full)
    if graph is None:
        fn = BUCKET_FUNCTIONS[rule]
        # A readable name that is a function of the bucket: dynamo's automatic-dynamic state (pgo.py)
        # is keyed on (file, line, name), so two copies sharing a name could share it.
        code = fn.__code__.replace(co_name=f"{fn.__name__}{full[1:]}")
        clone = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        clone.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), **static}
        graph = _bucket_graphs[full] = torch.compile(clone, fullgraph=True, backend=BACKEND)
    graph(*args)
