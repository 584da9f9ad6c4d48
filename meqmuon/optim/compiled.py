"""``compile=True``: the driver's two forms with a bucket's directions compiled once.

The forms (:func:`compiled_per_tensor`, :func:`compiled_batched`, chosen by the engine's ``step`` as the
eager ``driver.per_tensor`` and ``driver.batched`` are) decide what runs where (DDP slices, FSDP2 owners)
and call the graphs: :func:`hidden_step` (a hidden rule's bucket: the seam's own body,
:func:`meqmuon.optim.driver.directions`; per-tensor with the update inside, batched on the bucket's stack with
momentum, the stack and the update eagerly around it), :func:`elementwise_step` (an elementwise rule's
``direction`` of a stack) and :func:`owner_directions` (FSDP2 owners). A batched graph takes the stack, not
the members as lists: at Llama-350M's 96-matrix bucket a graph over lists (momentum and update inside, foreach
kernels of 96 tensors) had not compiled after 38 s on an H100 (docs/benchmarks.md, GPU, issue 49).
Hyperparameters
(lr, weight decay, momentum, rho) enter the graphs as 0-D float64 CPU tensors (:func:`scalar`), not
Python floats, so a schedule that changes them every step does not recompile (Python floats would be
guarded as constants; tested with ``torch._dynamo`` counters). The graphs are ``fullgraph=True``;
choices stay tensors, and a step makes no host-device synchronisation. Newton-Schulz inside a graph
is matmuls; the maths is the eager forms', only the rounding of the fused expressions differs.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from .calls import Item, Path, StepContext
from .driver import (
    Bucket,
    Call,
    HiddenRule,
    batched,
    cost,
    directions,
    grads_like,
    make_buckets,
    needs_matrix,
    per_tensor,
    resolve_dtype,
)

__all__ = ["BACKEND", "bucket_step", "compiled_batched", "compiled_per_tensor", "elementwise_step", "hidden_step",
           "owner_directions", "scalar"]

def scalar(x: float | Tensor, like: Tensor | None = None) -> Tensor:
    """A 0-D float64 CPU tensor: a graph input whose value may change without recompiling. A tensor is
    taken as it is (``cuda_graph=True`` passes 0-D device tensors, read by the kernels at replay); a number
    beside such a device tensor ``like`` becomes one too (a fill kernel, which a capture records; no CPU
    tensor meets a CUDA one in the graph, and no host copy runs during a capture)."""
    if isinstance(x, Tensor):
        return x
    if like is not None and like.device.type != "cpu":
        return torch.full_like(like, x)
    return torch.tensor(x, dtype=torch.float64)


#: The torch.compile backend of the bucket graphs (tests may use a cheaper one to count recompiles).
BACKEND = "inductor"
#: Inductor options of the bucket graphs. Before torch 2.12, inductor's loop reordering after fusion
#: asserts on a foreach kernel node nested in another (pytorch/pytorch#176591, fixed by #176849: the
#: check returns False in 2.13): MeqMuon's compiled per-tensor step failed so on an H200 with torch
#: 2.11 (docs/benchmarks.md, GPU). Those versions compile without that pass.
INDUCTOR_OPTIONS: dict[str, object] = (
    {"loop_ordering_after_fusion": False} if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12)
    else {})
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
        options = INDUCTOR_OPTIONS if BACKEND == "inductor" and INDUCTOR_OPTIONS else None
        graph = _bucket_graphs[full] = torch.compile(clone, fullgraph=True, backend=BACKEND, options=options)
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
    """A hidden rule's step of one bucket, momentum to update (:func:`driver.directions` in between).

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
    rows = [r for d in D for r in d.unbind(0)]
    F.decay_and_update_(params, [d.reshape(p.shape) for d, p in zip(rows, params, strict=True)], lr, wd, scale)
    # The new per-matrix state into the inputs last, one copy_ each: not torch._foreach_copy_, whose inductor
    # lowering (mutate_to(..., unsafe_alias=True): "only encountered as outputs of the graph") makes the input's
    # storage the new value's buffer, so that on CUDA the later reads of NorMuon's v, inlined from the old v,
    # read the new one: v lerped twice, 5.5e-4 apart from eager after one step (float64, an H100, torch 2.11;
    # benchmarks/gpu_diag_compile.py). aten.copy_ lowers to a copy of its own.
    for k, v in states.items():
        for dst, src in zip(v, state[k].to(v[0].dtype).unbind(0), strict=True):
            dst.copy_(src)


def _hidden_stack(X, states, steps, *, rule, plain, group):
    """A hidden rule's directions of one bucket's stacked direction inputs (the batched form's graph):
    :func:`driver.directions` (``pre -> Newton-Schulz -> post``) of ``X`` ``(K, m, n)`` (``plain`` as they
    are, the rest transposed), ``states`` ``{key: (K, m) or (K,)}`` stacks, ``steps`` ``(K,)`` or ``None``.
    Returns the directions (one stack per side) and the new state stacks: the graph mutates no input."""
    state = {k: v.clone() for k, v in states.items()}
    if steps is not None:
        state["step"] = steps
    (D,) = directions(rule, [(X, plain, state)], group, None, batched=True, ns_dtype=group["ns_dtype"])
    return D, [state[k] for k in states]


def _elementwise_stack(X, rho, *, rule, shape, group):
    """An elementwise momentum rule's :meth:`direction` of one bucket's stacked direction inputs ``X``
    ``(K, *shape)`` (at least float32); ``rho``: a 0-D tensor (a graph input: no recompile when it changes)."""
    return rule.direction(X, {**group, "rho": rho}, None, shape)


def _stacked_inputs(members, mu, nesterov, plain: int | None = None, shape=None) -> Tensor:
    """The batched compiled form's eager prologue: ``B <- mu B + G`` and the direction inputs of ``members``,
    stacked: matrix views with ``members[plain:]`` transposed, or each reshaped to ``shape``."""
    bufs = [it.state["momentum_buffer"] for it in members]
    inputs = _momentum_inputs(grads_like(members, bufs), bufs, mu, nesterov)
    if shape is not None:
        return torch.stack([x.reshape(shape) for x in inputs])
    inputs = [x.reshape(x.shape[0], -1) for x in inputs]
    return torch.stack(inputs[:plain] + [x.mT for x in inputs[plain:]])


def _owner_directions(W, state, *, rule, batched, group, factored):
    """FSDP2 owners' :func:`driver.directions` of whole matrices: ``W`` ``(j, m, n)``, the ``j`` matrices
    (:data:`~.sharded.Orth`): ``(U, row, col)``; ``state``: ``{key: (j, m) or (j,)}``."""
    ((D,),) = directions(rule, [(W, W.shape[0], state)], group, None, batched=batched,
                         ns_dtype=group["ns_dtype"], factored=factored)
    return D if isinstance(D, tuple) else (D, None, None)


def hidden_step(rule, members, plain: int, shape: tuple[int, int], key: tuple, group: dict, ns_dtype: torch.dtype,
                *, batched: bool) -> None:
    """A hidden rule's step of ``members`` (of one shape bucket of matrix view ``shape``, ``plain`` of them
    as they are, the rest transposed).

    Batched: momentum and the stack of direction inputs eagerly (a few ``torch._foreach_*`` kernels, as the
    eager batched form), ``pre -> Newton-Schulz -> post`` of the stack as one graph keyed on ``key`` and the
    stack's shape (:func:`_hidden_stack`: its size does not grow with the bucket's, so neither does its
    compile time), the per-matrix state written back and the update eagerly. Per-tensor (one matrix, momentum
    updated before): one graph of :func:`_hidden_bucket`, the update inside."""
    per_matrix = {k: how for k, how in rule.state_views.items() if how in ("rows", "counter", "step")}
    states = {k: [it.state[k] for it in members] for k, how in per_matrix.items() if how != "step"}
    steps = next((F.on_device([it.state[k] for it in members], members[0].param.device)
                  for k, how in per_matrix.items() if how == "step"), None)
    lr, scale = group["lr"], rule.lr_scale(*shape, group)
    if batched:
        X = _stacked_inputs(members, group["momentum"], group["nesterov"], plain)
        stacks = {k: torch.stack(v) for k, v in states.items()}
        graph = (key, id(rule), tuple(X.shape), X.dtype, tuple((k, v.dtype) for k, v in stacks.items()))
        D, new = bucket_step(rule.name, _hidden_stack, graph, X, stacks, steps, rule=rule, plain=plain,
                             group=static_group(rule, group, ns_dtype))
        for v, stack in zip(states.values(), new, strict=True):
            torch._foreach_copy_(v, list(stack.to(v[0].dtype).unbind(0)))
        rows = [r for d in D for r in d.unbind(0)]
        n = len(members)
        F.decay_and_update_([it.param.detach() for it in members],
                            [d.reshape(it.param.shape) for d, it in zip(rows, members, strict=True)],
                            [lr] * n, [group["weight_decay"]] * n, [scale] * n)
        return
    lr = scalar(lr)
    bucket_step(rule.name, _hidden_bucket, (key, id(rule), tuple(it.param.ndim for it in members)),
                [it.param.detach() for it in members], [it.grad for it in members],
                [it.state["momentum_buffer"] for it in members], states, steps, lr, scalar(group["weight_decay"], lr),
                scalar(group["momentum"], lr), scalar(scale, lr),
                rule=rule, plain=plain, nesterov=group["nesterov"], batched=False,
                group=static_group(rule, group, ns_dtype))


def elementwise_step(rule, bucket, group: dict) -> None:
    """An elementwise momentum rule's step of one shape bucket: momentum and the stack eagerly, its
    :meth:`direction` of the stack as one graph (:func:`_elementwise_stack`), the update eagerly."""
    static = {k: group[k] for k in rule.hyperparameters if k not in ("momentum", "rho", "nesterov")}
    shape = tuple(bucket.global_shape)
    X = _stacked_inputs(bucket.items, group["momentum"], group["nesterov"], shape=shape)
    X = X.to(F._stat_dtype(X))
    D = bucket_step(rule.name, _elementwise_stack, (bucket.key, tuple(X.shape), X.dtype), X,
                    scalar(group["rho"], group["lr"] if isinstance(group["lr"], Tensor) else None),
                    rule=rule, shape=shape, group=static)
    n = len(bucket.items)
    F.decay_and_update_([it.param.detach() for it in bucket.items],
                        [d.reshape(it.param.shape) for d, it in zip(D.unbind(0), bucket.items, strict=True)],
                        [group["lr"]] * n, [group["weight_decay"]] * n, [1.0] * n)


def owner_directions(rule, handed: list[Tensor], state: dict[str, Tensor], group: dict, ctx, *,
                     batched: bool, factored: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """FSDP2 owners' directions of whole matrices ``W`` ``(j, m, n)``, handed over as ``handed == [W]``, as one
    graph per stack shape (``sharded.hidden_at_owners``' ``orth`` under ``compile=True``)."""
    W = handed.pop()
    static = static_group(rule, group, resolve_dtype(group, W, ctx))
    return bucket_step(rule.name, _owner_directions, (tuple(W.shape), W.dtype, id(rule)), W, state,
                       rule=rule, batched=batched, group=static, factored=factored)


# ---- the forms ---------------------------------------------------------------------------------------


def _hidden_compiled(rule: HiddenRule, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
    """A hidden rule's per-tensor update as one graph per matrix (same-shape matrices share it), so that a
    matrix's bits do not depend on its neighbours (the DDP owners rely on it)."""
    ns_dtype = resolve_dtype(group, items[0].param, ctx)
    for it in items:
        (b,) = make_buckets([it], matrix=True, transpose=False)
        hidden_step(rule, [it], 1, b.global_shape, b.key, group, ns_dtype, batched=False)


def compiled_per_tensor(calls: Sequence[Call]) -> None:
    """The per-tensor form with ``compile=True``: a hidden rule's matrices one graph each; the elementwise
    rules' per-tensor forms stay eager (eq. 9's two row-blocked passes already run at memory bandwidth,
    docs/benchmarks.md)."""
    per_tensor(calls, _hidden_compiled)


def rows_batched(calls: Sequence[Call]) -> None:
    """A hidden rule's FSDP2 row shards with ``compile=True`` (``placement.ROWS``): the eager batched form with
    each owner's directions one graph (:func:`owner_directions`)."""
    batched(calls, owner_directions)


def compiled_batched(calls: Sequence[Call]) -> None:
    """The batched form with ``compile=True``: one graph per shape bucket (:func:`hidden_step`).

    Under DDP (every rank holds every tensor) a hidden rule's bucket is split into contiguous slices as
    the eager batched form splits it; each rank updates the momentum of the other members eagerly, runs
    the bucket's graph on its slice, and one ``all_gather_into_tensor`` per bucket and dtype brings every
    slice's new parameters and owner state to every rank. An elementwise rule's buckets (memory-bound) run
    whole on every rank. FSDP2's hidden row shards are not here: the engine runs them in :func:`rows_batched`;
    it sends the elementwise rules' row shards to the owner path (``placement.PIECES``, ``owners.py``), where
    they see whole tensors.
    """
    for rule, items, group, ctx in calls:
        if ctx.path is Path.ROWS:
            raise NotImplementedError("compile=True with foreach=True on row shards: the engine runs these rules at "
                                      "owner ranks (owners.py); this call is a bug")
        if ctx.capture is not None:
            raise NotImplementedError("the capture hook needs the eager step: build the optimizer without compile=True")
        if not isinstance(rule, HiddenRule):
            for b in make_buckets(items, matrix=needs_matrix(rule), transpose=False):
                elementwise_step(rule, b, group)
            continue
        ns_dtype = resolve_dtype(group, items[0].param, ctx)
        split = ctx.split.world_size > 1  # DDP: a slice of each bucket per rank
        for b in make_buckets(items, matrix=True, transpose=rule.transposes):
            members, plain = b.items, b.plain
            if split:
                counts = ctx.split.bucket_plan(len(b.items), cost(rule, b.global_shape, group))
                lo = sum(counts[: ctx.split.rank])
                hi = lo + counts[ctx.split.rank]
                members, plain = b.items[lo:hi], max(0, min(b.plain - lo, hi - lo))
                others = b.items[:lo] + b.items[hi:]
                bufs = [it.state["momentum_buffer"] for it in others]
                F.momentum_(bufs, grads_like(others, bufs), group["momentum"])
            if members:
                hidden_step(rule, members, plain, b.global_shape, b.key, group, ns_dtype, batched=True)
            if split:
                _gather_slices(b, members, counts, rule._owner_state, ctx)


def _gather_slices(bucket: Bucket, members: Sequence[Item], counts: list[int], keys: tuple[str, ...],
                   ctx: StepContext) -> None:
    """Every rank's slice of a bucket's new parameters and owner state ``keys``, to every rank (DDP): one
    ``all_gather_into_tensor`` of the flattened members per dtype (transposed members flatten to the same size)."""
    p0 = bucket.items[0].param
    stacks = [torch.stack([it.param.detach().reshape(-1) for it in members]) if members else
              p0.new_empty((0, p0.numel()))]
    for key in keys:
        s0 = bucket.items[0].state[key]
        stacks.append(torch.stack([it.state[key].reshape(-1) for it in members]) if members else
                      s0.new_empty((0, s0.numel())))
    full: list[Tensor] = [None] * len(stacks)  # type: ignore[list-item]
    # one gather per dtype (an int64 counter never rounds through bf16), in the same order on every rank
    for dtype in dict.fromkeys(s.dtype for s in stacks):
        which = [i for i, s in enumerate(stacks) if s.dtype == dtype]
        for i, t in zip(which, ctx.split.gather([stacks[i] for i in which], counts), strict=True):
            full[i] = t
    torch._foreach_copy_([it.param.detach() for it in bucket.items],
                         [row.view(it.param.shape) for row, it in zip(full[0].unbind(0), bucket.items, strict=True)])
    for key, stack in zip(keys, full[1:], strict=True):
        torch._foreach_copy_([it.state[key] for it in bucket.items],
                             [row.view(it.state[key].shape) for row, it in zip(stack.unbind(0), bucket.items,
                                                                                 strict=True)])
