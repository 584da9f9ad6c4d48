"""``compile=True``: the driver's two forms with a bucket's directions compiled once.

The forms (:func:`compiled_per_tensor`, :func:`compiled_batched`, named by ``placement.EXECUTORS`` beside the eager
``forms.per_tensor`` and ``forms.batched``) call the graphs: :func:`hidden_step` (a hidden rule's bucket: the
seam's own body, :func:`meqmuon.optim.driver.directions`; per-tensor with the update inside, batched on the bucket's
stack with momentum, the stack and the update eagerly around it), :func:`elementwise_step` (an elementwise rule's
``direction`` of a stack) and :func:`owner_directions` (the owners of ``exchange.py``). A batched graph takes the
stack, not the members as lists: at Llama-350M's 96-matrix bucket a graph over lists (momentum and update inside,
foreach kernels of 96 tensors) had not compiled after 38 s on an H100 (docs/benchmarks.md, GPU, issue 49).
Hyperparameters (lr, weight decay, momentum, rho) enter the graphs as 0-D float64 CPU tensors (:func:`scalar`), not
Python floats, so a schedule that changes them every step does not recompile (Python floats would be guarded as
constants; tested with ``torch._dynamo`` counters). The graphs are ``fullgraph=True``; choices stay tensors, and a
step makes no host-device synchronisation. Newton-Schulz inside a graph is matmuls; the maths is the eager forms',
only the rounding of the fused expressions differs.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from . import commit
from .calls import Item, StepContext
from .driver import (
    Call,
    HiddenRule,
    bucket_directions,
    directions,
    make_buckets,
    matrix_shape,
    needs_matrix,
    resolve_dtype,
)
from .forms import Inputs, held_factored, keep_directions, naming, per_tensor, stepped_weights, write_inputs

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


def _stacked_inputs(members, rule, group, plain: int | None = None, shape=None) -> Tensor:
    """The batched compiled form's eager prologue: the direction inputs of ``members`` from the unchanged momentum
    (:class:`forms.Inputs`: ``B' = mu B + G`` into a transient and ``G + mu B'``, or a hidden rule's own
    :meth:`HiddenRule.inputs` on copies of its state), stacked: matrix views with ``members[plain:]`` transposed, or
    each reshaped to ``shape``."""
    inputs = Inputs(rule, group)(members)
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


def hidden_step(rule, members, plain: int, shape: tuple[int, int], key: tuple, group: dict,
                ns_dtype: torch.dtype, step: commit.Commit) -> None:
    """A hidden rule's batched directions of ``members`` (one shape bucket of matrix view ``shape``, ``plain`` of
    them as they are, the rest transposed): the stack of direction inputs eagerly from the unchanged momentum (a
    few ``torch._foreach_*`` kernels, as the eager batched form), ``pre -> Newton-Schulz -> post`` of the stack as
    one graph keyed on ``key`` and the stack's shape (:func:`_hidden_stack`: its size does not grow with the
    bucket's, so neither does its compile time); the new per-matrix state and the update queued on ``step``, the
    step's commit."""
    per_matrix = {k: how for k, how in rule.state_views.items() if how in ("rows", "counter", "step")}
    states = {k: [it.state[k] for it in members] for k, how in per_matrix.items() if how != "step"}
    steps = next((F.on_device([it.state[k] for it in members], members[0].param.device)
                  for k, how in per_matrix.items() if how == "step"), None)
    X = _stacked_inputs(members, rule, group, plain)
    stacks = {k: torch.stack(v) for k, v in states.items()}
    graph = (key, id(rule), tuple(X.shape), X.dtype, tuple((k, v.dtype) for k, v in stacks.items()))
    D, new = bucket_step(rule.name, _hidden_stack, graph, X, stacks, steps, rule=rule, plain=plain,
                         group=static_group(rule, group, ns_dtype))
    for v, stack in zip(states.values(), new, strict=True):
        step.later(commit.copy_, v, list(stack.unbind(0)), parts=1)
    rows = [r for d in D for r in d.unbind(0)]
    n = len(members)
    params = [it.param.detach() for it in members]
    if rule._own_step:  # transposes = False: one side, the members' orientation
        step.later(commit.copy_, params, stepped_weights(rule, params, D[0], rule.lr_scale(*shape, group), group))
        return
    step.later(commit.update_, params, [d.reshape(it.param.shape) for d, it in zip(rows, members, strict=True)],
               [group["lr"]] * n, [group["weight_decay"]] * n, [rule.lr_scale(*shape, group)] * n, list(D))


def elementwise_step(rule, bucket, group: dict, step: commit.Commit) -> None:
    """An elementwise momentum rule's directions of one shape bucket: the stack eagerly from the unchanged momentum,
    its :meth:`direction` of the stack as one graph (:func:`_elementwise_stack`), the update queued on ``step``."""
    static = {k: group[k] for k in rule.hyperparameters if k not in ("momentum", "rho", "nesterov")}
    shape = tuple(bucket.global_shape)
    X = _stacked_inputs(bucket.items, rule, group, shape=shape)
    X = X.to(F.stat_dtype(X))
    D = bucket_step(rule.name, _elementwise_stack, (bucket.key, tuple(X.shape), X.dtype), X,
                    scalar(group["rho"], group["lr"] if isinstance(group["lr"], Tensor) else None),
                    rule=rule, shape=shape, group=static)
    n = len(bucket.items)
    step.later(commit.update_, [it.param.detach() for it in bucket.items],
               [d.reshape(it.param.shape) for d, it in zip(D.unbind(0), bucket.items, strict=True)],
               [group["lr"]] * n, [group["weight_decay"]] * n, [1.0] * n, [D])


def owner_directions(rule, handed: list[Tensor], state: dict[str, Tensor], group: dict, ctx, *,
                     batched: bool, factored: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """An owner rank's directions of whole matrices ``W`` ``(j, m, n)``, handed over as ``handed == [W]``, as one
    graph per stack shape (``driver.bucket_directions``' ``orth`` under ``compile=True`` on ``placement.OWNERS``)."""
    W = handed.pop()
    static = static_group(rule, group, resolve_dtype(group, W, ctx))
    return bucket_step(rule.name, _owner_directions, (tuple(W.shape), W.dtype, id(rule)), W, state,
                       rule=rule, batched=batched, group=static, factored=factored)


# ---- the forms ---------------------------------------------------------------------------------------


def _hidden_compiled(rule: HiddenRule, items: Sequence[Item], group: dict, ctx: StepContext, x_of: Inputs) -> None:
    """A hidden rule's per-tensor directions: each matrix's one graph (:func:`owner_directions`, which same-shape
    matrices share), kept for the step's writes (``forms.keep_directions``): the body and the graph an owner rank
    runs on a matrix of the per-tensor form (``exchange.py``), so that DDP's shared step gives one process's bits."""
    kept = []
    for it in items:
        with naming(rule, [it]):
            shape = matrix_shape(it.shape)
            (b,) = make_buckets([it], matrix=True, transpose=False)
            factored = held_factored(rule, group, ctx, it.param.reshape(shape))
            found = bucket_directions(rule, [b], group, ctx, batched=False,
                                      inputs=lambda its: [x_of.one(i) for i in its], orth=owner_directions,
                                      factored=factored)
            for targets, news in found.writes:
                ctx.commit.later(commit.copy_, targets, news, parts=1)
            d = found.directions[0][0]
            kept.append((it.param, d if factored else d.reshape(1, *shape), rule.lr_scale(*shape, group)))
    keep_directions(rule, kept, group, ctx)


def compiled_per_tensor(calls: Sequence[Call]) -> None:
    """The per-tensor form with ``compile=True``: a hidden rule's matrices one graph each; the elementwise
    rules' per-tensor forms stay eager (eq. 9's two row-blocked passes already run at memory bandwidth,
    docs/benchmarks.md)."""
    per_tensor(calls, _hidden_compiled)


def compiled_batched(calls: Sequence[Call]) -> None:
    """The batched form with ``compile=True``: one graph per shape bucket (:func:`hidden_step`); an elementwise
    rule's buckets one graph each (:func:`elementwise_step`); then the momentum of every call queued after the
    updates (``forms.write_inputs``). Under ``placement.OWNERS`` the exchange's forms run instead, each owner's
    directions one graph (:func:`owner_directions`)."""
    if not calls:
        return
    step = calls[0][3].commit
    for rule, items, group, ctx in calls:
        if ctx.capture is not None:
            raise NotImplementedError("the capture hook needs the eager step: build the optimizer without compile=True")
        with naming(rule, items):
            if not isinstance(rule, HiddenRule):
                for b in make_buckets(items, matrix=needs_matrix(rule), transpose=False):
                    elementwise_step(rule, b, group, step)
                continue
            ns_dtype = resolve_dtype(group, items[0].param, ctx)
            for b in make_buckets(items, matrix=True, transpose=rule.transposes):
                hidden_step(rule, b.items, b.plain, b.global_shape, b.key, group, ns_dtype, step)
    step.later(write_inputs, list(calls), batched=True)
