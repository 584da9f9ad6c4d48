"""``compile=True``: a bucket's step, momentum to update, compiled once, without recompiles.

Graphs only: the driver's compiled forms (``driver.py``) decide what runs where (DDP slices, FSDP2 owners)
and call :func:`hidden_step` (a hidden rule's bucket: the seam's own body,
:func:`meqmuon.optim.newton_schulz.directions`, wrapped with momentum and the update), :func:`elementwise_step`
(an elementwise rule's ``direction`` of a stack likewise) and :func:`owner_directions` (FSDP2 owners).
Hyperparameters
(lr, weight decay, momentum, rho) enter the graphs as 0-D float64 CPU tensors (:func:`scalar`), not
Python floats, so a schedule that changes them every step does not recompile (Python floats would be
guarded as constants; tested with ``torch._dynamo`` counters). The graphs are ``fullgraph=True``;
choices stay tensors, and a step makes no host-device synchronisation. Newton-Schulz inside a graph
is matmuls; the maths is the eager forms', only the rounding of the fused expressions differs.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from .newton_schulz import directions, resolve_dtype

__all__ = ["BACKEND", "bucket_step", "elementwise_step", "hidden_step", "owner_directions", "scalar"]

def scalar(x: float) -> Tensor:
    """A 0-D float64 CPU tensor: a graph input whose value may change without recompiling."""
    return torch.tensor(x, dtype=torch.float64)


#: The torch.compile backend of the bucket graphs (tests may use a cheaper one to count recompiles).
BACKEND = "inductor"
_bucket_graphs: dict[tuple, object] = {}


def bucket_step(label: str, fn: Callable[..., Any], key: tuple, *args: object, **static: object) -> Any:
    """Run ``fn`` (a bucket body of this module, for the rule named ``label``) compiled for the bucket ``key``.

    ``args`` are the bucket's tensor lists and the 0-D hyperparameter tensors; ``static`` the rule's
    Python constants. One graph per bucket, compiled once, with no recompile limit on the number of
    buckets: dynamo caches graphs per code object (at most ``recompile_limit`` = 8 per code object,
    and ``fullgraph=True`` raises on the ninth), so each bucket compiles its own copy of ``fn``,
    with its own code object, and ``static`` baked in as its keyword defaults.

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
    full = (label, key, signature, tuple(sorted((k, repr(v)) for k, v in static.items())), BACKEND)
    graph = _bucket_graphs.get(full)
    if graph is None:
        # A readable name that is a function of the bucket: dynamo's automatic-dynamic state (pgo.py)
        # is keyed on (file, line, name), so two copies sharing a name could share it.
        code = fn.__code__.replace(co_name=f"{fn.__name__}{full[1:]}")
        clone = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        clone.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), **static}
        graph = _bucket_graphs[full] = torch.compile(clone, fullgraph=True, backend=BACKEND)
    return graph(*args)


def static_group(rule, group: dict, ns_dtype: torch.dtype) -> dict:
    """The hyperparameters a hidden rule's graph bakes in (all but ``momentum``, a graph input), with the
    Newton-Schulz dtype resolved."""
    return {**{k: group[k] for k in rule.hyperparameters if k != "momentum"}, "ns_dtype": ns_dtype}


def _momentum_inputs(grads, bufs, mu, nesterov, *, update: bool = True) -> list[Tensor]:
    """``B <- mu B + G`` in place (unless the momentum is already updated), then the direction inputs."""
    grads = [g.to(b.dtype) for g, b in zip(grads, bufs, strict=True)]
    if update:
        F.momentum_(bufs, grads, mu)
    return F.direction_input(grads, bufs, mu, nesterov)


def _hidden_bucket(params, grads, bufs, states, steps, lr, wd, mu, scale, *, rule, plain, nesterov, batched, group):
    """A hidden rule's step of one bucket, momentum to update (:func:`newton_schulz.directions` in between).

    Shapes, for ``K`` members of matrix view ``(m, n)`` (``plain`` as they are, the rest ``(n, m)``):
    ``params``, ``grads``, ``bufs``: ``K`` tensors each of its member's shape (momentum buffers in the state
    dtype); ``states``: ``{key: K tensors}`` (``(m,)`` per-row or ``()`` per-matrix state); ``steps``:
    ``(K,)`` int64 or ``None``; ``lr``, ``wd``, ``mu``, ``scale``: 0-D float64 CPU tensors (graph inputs, no
    recompile); ``rule``, ``plain``, ``nesterov``, ``batched``, ``group``: baked in (``static_group``).
    """
    # the per-tensor form's momentum is updated before (and its buffers are owners' too)
    inputs = [x.reshape(x.shape[0], -1) for x in _momentum_inputs(grads, bufs, mu, nesterov, update=batched)]
    X = torch.stack(inputs[:plain] + [x.mT for x in inputs[plain:]])
    state = {k: torch.stack(v) for k, v in states.items()}
    if steps is not None:
        state["step"] = steps
    (D,) = directions(rule, [(X, plain, state)], group, None, batched=batched, ns_dtype=group["ns_dtype"])
    for k, v in states.items():
        torch._foreach_copy_(v, list(state[k].to(v[0].dtype).unbind(0)))
    rows = [r for d in D for r in d.unbind(0)]
    F.decay_and_update_(params, [d.reshape(p.shape) for d, p in zip(rows, params, strict=True)], lr, wd, scale)


def _elementwise_bucket(params, grads, bufs, lr, wd, mu, rho, *, rule, shape, nesterov, group):
    """An elementwise momentum rule's step of one bucket: momentum, :meth:`direction` of the stack, update.

    Shapes: ``params``, ``grads``, ``bufs``: ``K`` tensors of one shape; ``lr``, ``wd``, ``mu``, ``rho``: 0-D
    float64 CPU tensors; ``shape``: one member's unsharded shape, the stack ``(K, *shape)``; ``rule``,
    ``nesterov``, ``group`` (the rule's other hyperparameters): baked in."""
    inputs = _momentum_inputs(grads, bufs, mu, nesterov)
    X = torch.stack([x.reshape(shape) for x in inputs]).to(F._stat_dtype(inputs[0]))
    D = rule.direction(X, {**group, "rho": rho}, None, shape)
    F.decay_and_update_(params, [d.reshape(p.shape) for d, p in zip(D.unbind(0), params, strict=True)], lr, wd, 1.0)


def _owner_directions(W, state, *, rule, n, batched, group):
    """FSDP2 owners' :func:`newton_schulz.directions` of whole matrices: ``W`` ``(j, m, n + s)``, the ``j``
    matrices with ``s`` state columns after their ``n`` columns; ``state``: ``{key: (j, m) or (j,)}``."""
    (D,) = directions(rule, [(W[..., :n], W.shape[0], state)], group, None, batched=batched,
                      ns_dtype=group["ns_dtype"])
    return D


def hidden_step(rule, members, plain: int, shape: tuple[int, int], key: tuple, group: dict, ns_dtype: torch.dtype,
                *, batched: bool) -> None:
    """A hidden rule's step of ``members`` (of one shape bucket of matrix view ``shape``, ``plain`` of them
    as they are, the rest transposed) as one graph keyed on ``key``: momentum (``batched``; the per-tensor
    form updated it before), :func:`newton_schulz.directions`, the update, the per-matrix state written back."""
    per_matrix = {k: how for k, how in rule.state_views.items() if how in ("rows", "counter", "step")}
    states = {k: [it.state[k] for it in members] for k, how in per_matrix.items() if how != "step"}
    steps = next((torch.tensor([it.state[k] for it in members], device=members[0].param.device)
                  for k, how in per_matrix.items() if how == "step"), None)
    bucket_step(rule.name, _hidden_bucket, (key, id(rule), tuple(it.param.ndim for it in members)),
                [it.param.detach() for it in members], [it.grad for it in members],
                [it.state["momentum_buffer"] for it in members], states, steps, scalar(group["lr"]),
                scalar(group["weight_decay"]), scalar(group["momentum"]), scalar(rule.lr_scale(*shape, group)),
                rule=rule, plain=plain, nesterov=group["nesterov"], batched=batched,
                group=static_group(rule, group, ns_dtype))


def elementwise_step(rule, bucket, group: dict) -> None:
    """An elementwise momentum rule's step of one shape bucket as one graph: momentum, :meth:`direction`
    of the stack, the update."""
    static = {k: group[k] for k in rule.hyperparameters if k not in ("momentum", "rho", "nesterov")}
    bucket_step(rule.name, _elementwise_bucket, bucket.key, [it.param.detach() for it in bucket.items],
                [it.grad for it in bucket.items], [it.state["momentum_buffer"] for it in bucket.items],
                scalar(group["lr"]), scalar(group["weight_decay"]), scalar(group["momentum"]), scalar(group["rho"]),
                rule=rule, shape=tuple(bucket.global_shape), nesterov=group["nesterov"], group=static)


def owner_directions(rule, W: Tensor, n: int, state: dict[str, Tensor], group: dict, ctx, *, batched: bool) -> Tensor:
    """FSDP2 owners' directions of whole matrices ``W`` ``(j, m, n + s)`` as one graph per stack shape
    (``sharded.hidden_at_owners``' ``orth`` under ``compile=True``)."""
    static = static_group(rule, group, resolve_dtype(group, W, ctx))
    return bucket_step(rule.name, _owner_directions, (tuple(W.shape), W.dtype, id(rule)), W, state,
                       rule=rule, n=n, batched=batched, group=static)
