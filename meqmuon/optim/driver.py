"""The driver: how a momentum rule's step runs, in every form, as functions.

A rule (``rule.py``) says what it computes; the driver runs it. Every momentum rule updates
``B <- mu B + G`` (paper eq. 6; Moonlight's convention), takes the direction input ``X = G + mu B`` with
Nesterov (else ``B``), turns it into a direction ``D`` and steps ``W <- (1 - lr wd) W - lr s D``. A hidden
rule's direction is ``post(Orth(pre(X)))`` over stacks of matrices, cut at Newton-Schulz as
microsoft/dion cuts its Muon: the seam, :func:`~.newton_schulz.directions`, is the one body of every form;
an elementwise momentum rule's is its ``direction`` of a stack (batched, compiled) or its ``update``
(per-tensor).

**The forms** are four functions with one signature, a sequence of a step's rule calls
``(rule, items, group, ctx)``, as torch's ``_single_tensor_adam`` / ``_multi_tensor_adam`` /
``_fused_adam``:

- :func:`per_tensor` (``foreach=False``): each matrix a stack of one, made just before its Newton-Schulz
  and applied just after, so no model-sized temporary exists (on CPU fresh temporaries cost page
  faults); under DDP each parameter has one owner rank, which computes it and broadcasts it;
- :func:`batched` (``foreach=True``): momentum in a few ``torch._foreach_*`` kernels for all calls, one
  stack per shape bucket, one batched Newton-Schulz per bucket, ``post`` once for all stacks, one update
  for all calls; under DDP a slice of each bucket per rank, gathered (one collective per bucket);
- :func:`compiled_per_tensor`, :func:`compiled_batched` (``compile=True``): the same, with each matrix's
  or bucket's step one graph (``compiled.py``).

Under FSDP2 a hidden rule's row shards meet as whole matrices at owner ranks, a bucket at a time
(``sharded.py``), inside the batched forms; the elementwise rules sum their statistics over shards.
:func:`step` is **the one chooser** (the engine only resolves ``foreach``): it picks the form of each
call, and runs the rules that write their own forms (``SteppingRule``: AdamW, SCALE) as they say.

What a rule declares becomes what the driver needs by the functions under "what the driver reads of a
rule": its state (:func:`init_state`, from ``state_views``), its cost for balancing owners
(:func:`cost`). No function here makes a host-device
sync: step counters are Python ints, choices are tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from . import compiled
from .calls import Item, StepContext, state_dtype
from .distributed import state_like
from .newton_schulz import (
    Bucket,
    HiddenRule,
    buffer,
    directions,
    make_buckets,
    matrix_shape,
    ns_flops,
    resolve_dtype,
    unstack,
)
from .rule import MomentumRule, Rule, SteppingRule
from .sharded import Orth, eager_directions, hidden_at_owners
from .views import Layout

__all__ = ["ELEMENTWISE_COST", "FORMS", "Call", "apply_update", "batched", "compiled_batched", "compiled_per_tensor",
           "compiles", "cost", "direction_input", "elementwise", "grads_like", "init_state", "needs_matrix",
           "per_tensor", "stack_inputs", "stack_tensors", "state_elements", "step"]

#: One rule call of a step: the rule, its items (one param group's parameters of its kind, or several
#: groups' merged by the engine), the group, the call's context.
Call = tuple[Rule, Sequence[Item], dict, StepContext]

#: Cost of an elementwise update, in matmul-FLOP equivalents per element, for balancing DDP owners
#: (:func:`cost`): on CPU, the row-blocked equilibration of a 32000 x 512 matrix took as long
#: as 1000 Newton-Schulz FLOPs per element at the bf16 matmul rate. A heuristic: results never depend on it.
ELEMENTWISE_COST = 1000.0


# ---- what the driver reads of a rule -------------------------------------------------------------


def needs_matrix(rule: Rule) -> bool:
    """The rule sees >=2-D tensors as matrices (every hidden rule; an elementwise or stepping rule that says so)."""
    return isinstance(rule, HiddenRule) or (isinstance(rule, MomentumRule | SteppingRule) and rule.needs_matrix)


def elementwise(rule: Rule) -> bool:
    """Each element's update depends on that element alone (a stepping rule that says so: AdamW)."""
    return isinstance(rule, SteppingRule) and rule.elementwise


def compiles(rule: Rule) -> bool:
    """``compile=True`` has a compiled form of the rule: the momentum rules (stepping rules run eagerly)."""
    return not isinstance(rule, SteppingRule)


def _splits(rule: Rule) -> bool:
    """The rule's work is split over DDP ranks (every hidden rule; an elementwise rule unless it says not)."""
    return isinstance(rule, HiddenRule) or (isinstance(rule, MomentumRule) and rule.split_work)


def cost(rule: Rule, shape: Sequence[int], group: dict) -> float:
    """Estimated cost of one parameter's update, for balancing owners: Newton-Schulz FLOPs (hidden rules)
    plus :data:`ELEMENTWISE_COST` per element (every momentum rule); a stepping rule's, its size."""
    if isinstance(rule, SteppingRule):
        return float(math.prod(shape))
    ns = ns_flops(*matrix_shape(shape), group["ns_steps"]) if isinstance(rule, HiddenRule) else 0
    return ns + ELEMENTWISE_COST * math.prod(shape)


def state_elements(rule: Rule, layout: Layout) -> int:
    """Number of state elements (excluding scalar counters) a rule keeps for a parameter of ``layout``."""
    if isinstance(rule, SteppingRule):
        return rule.state_elements(layout)
    rows = sum(math.prod(layout.rows_shape) for how in rule.state_views.values() if how == "rows")
    return math.prod(layout.batch) * layout.rows * layout.cols + rows


def init_state(rule: Rule, p: Tensor, state: dict[str, Any], group: dict, layout: Layout) -> None:
    """Create the state of parameter ``p``: a stepping rule's own; a momentum rule's from its
    ``state_views``: the momentum buffer (in the group's ``state_dtype``), per-row state (at least
    float32) and per-matrix counters (int64); ``state["step"]`` counted by the engine."""
    if isinstance(rule, SteppingRule):
        rule.init_state(p, state, group, layout)
        return
    state["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype(p, group), memory_format=torch.preserve_format)
    state["step"] = 0
    for key, how in rule.state_views.items():
        if how == "rows":
            state[key] = state_like(p, layout.rows_shape, torch.promote_types(p.dtype, torch.float32),
                                    aligned=not layout.folded and (bool(layout.batch) or not layout.transposed))
        elif how == "counter":  # a whole matrix's counter is a plain tensor even under FSDP2
            state[key] = state_like(p, layout.counter_shape, torch.int64, aligned=not layout.folded) \
                if layout.batch else torch.zeros(layout.counter_shape, dtype=torch.int64, device=p.device)


# ---- what every form uses --------------------------------------------------------------------------


def grads_like(items: Sequence[Item], like: Sequence[Tensor]) -> list[Tensor]:
    """The items' gradients in the dtypes of ``like`` (their momentum buffers, say)."""
    return [it.grad if it.grad.dtype == b.dtype else it.grad.to(b.dtype) for it, b in zip(items, like, strict=True)]


def direction_input(it: Item, group: dict, rows: slice = slice(None), out: Tensor | None = None) -> Tensor:
    """Rows ``rows`` of one item's direction input (:func:`F.direction_input`), into ``out`` if given:
    made on demand, so that no model-sized temporary exists and DDP owners make only their own."""
    b, g = it.state["momentum_buffer"], it.grad
    if rows != slice(None):  # a 0-D parameter (a vector of one element) cannot be sliced
        b, g = b[rows], g[rows]
    g = g if g.dtype == b.dtype else g.to(b.dtype)
    return F.direction_input([g], [b], group["momentum"], group["nesterov"], None if out is None else [out])[0]


def stack_inputs(ctx: StepContext, name: str, bucket: Bucket, lo: int, hi: int, dtype: torch.dtype) -> Tensor:
    """The direction inputs of members ``lo..hi`` (made by :func:`step_foreach_calls`, handed over and let
    go here), stacked (cast to ``dtype``) in the bucket's persistent workspace, in the bucket's
    orientation: one ``stack`` reads the transposed members as strided views."""
    items = bucket.items[lo:hi]
    xs = [ctx.inputs.pop(id(it)) for it in items]
    if len(bucket.shape) == 2:
        xs = [x.reshape(x.shape[0], -1) if x.ndim > 2 else x for x in xs]
    cut = max(0, bucket.plain - lo)
    out = buffer(ctx.workspace, (name, "inputs", ctx.call, bucket.key, lo), (hi - lo, *bucket.shape), dtype,
                 items[0].param.device)
    return torch.stack([*xs[:cut], *(x.mT for x in xs[cut:])], out=out)


def stack_tensors(ctx: StepContext, name: str, bucket: Bucket, tensors: Sequence[Tensor]) -> Tensor:
    """``tensors`` (one per member, not transposed) stacked in the bucket's workspace, at least float32."""
    t0 = tensors[0]
    out = buffer(ctx.workspace, (name, "inputs", ctx.call, bucket.key), (len(tensors), *bucket.shape),
                 torch.promote_types(t0.dtype, torch.float32), t0.device)
    return torch.stack([t.reshape(bucket.shape) for t in tensors], out=out)


def apply_update(items: Sequence[Item], directions: Sequence[Tensor], scales: Sequence[float], group: dict,
                 scratch: dict | None = None) -> None:
    """``W <- (1 - lr wd) W - lr s D`` for each item (:func:`F.decay_and_update_`), mixed dtypes in the wider
    one as torch.optim.Muon's bf16 update of float32 weights; a narrower direction goes through a buffer
    of ``scratch``, since ``p.add_(d)`` would cast it through a fresh parameter-sized temporary. Same bits."""
    for it, d, s in zip(items, directions, scales, strict=True):
        p = it.param
        d = d.reshape(p.shape)
        if scratch is not None and d.dtype != p.dtype and torch.promote_types(d.dtype, p.dtype) == p.dtype:
            d = buffer(scratch, "direction", p.shape, p.dtype, p.device).copy_(d)
        F.decay_and_update_([p], [d], group["lr"], group["weight_decay"], [s])


# ---- the per-tensor forms ----------------------------------------------------------------------------


def per_tensor(calls: Sequence[Call], hidden: Callable[[HiddenRule, Sequence[Item], dict, StepContext], None]
               | None = None) -> None:
    """The per-tensor form (``foreach=False``). Per call: momentum (one fused kernel), then the update of
    the items this rank owns: ``hidden`` (default :func:`_hidden_eager`) for a hidden rule's, the rule's own
    :meth:`MomentumRule.update` for an elementwise one; under DDP each parameter has one owner rank
    (balanced by :func:`cost`), which publishes it with its owner state."""
    hidden = hidden or _hidden_eager
    for rule, items, group, ctx in calls:
        bufs = [it.state["momentum_buffer"] for it in items]
        F.momentum_(bufs, grads_like(items, bufs), group["momentum"], fused=True)
        if ctx.capture is not None:
            ctx.emit(items, [direction_input(it, group) for it in items], "momentum_input")
        update = (lambda its, g, c, rule=rule: hidden(rule, its, g, c)) if isinstance(rule, HiddenRule) else rule.update
        if ctx.split.world_size == 1 or not _splits(rule):  # one process: this rank owns all
            update(items, group, ctx)
            continue
        owners = ctx.split.owners([cost(rule, it.shape, group) for it in items])
        mine = [it for it, o in zip(items, owners, strict=True) if o == ctx.split.rank]
        if mine:
            update(mine, group, ctx)
        ctx.split.publish([[it.param, *(it.state[k] for k in rule._owner_state)] for it in items], owners)


def _hidden_eager(rule: HiddenRule, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
    """A hidden rule's per-tensor update: every matrix a stack of one, made just before its Newton-Schulz."""
    scratch: dict[tuple, Tensor] = {}
    per_matrix = [(k, how) for k, how in rule.state_views.items() if how in ("rows", "counter", "step")]
    for it in items:
        b, shape = it.state["momentum_buffer"], it.shape
        x = direction_input(it, group, out=buffer(scratch, "nesterov", b.shape, b.dtype, b.device))
        X = x.reshape(x.shape[0], -1) if x.ndim > 2 else x
        state = {k: torch.tensor([it.state[k]], device=b.device) if how == "step" else it.state[k][None]
                 for k, how in per_matrix}
        ((D,),) = directions(rule, [(X[None], 1, state)], group, ctx, batched=False, scratch=scratch)
        apply_update([it], [D[0]], [rule.lr_scale(shape[0], math.prod(shape[1:]), group)], group, scratch)


def _hidden_compiled(rule: HiddenRule, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
    """A hidden rule's per-tensor update as one graph per matrix (same-shape matrices share it), so that a
    matrix's bits do not depend on its neighbours (the DDP owners rely on it)."""
    ns_dtype = resolve_dtype(group, items[0].param, ctx)
    for it in items:
        (b,) = make_buckets([it], matrix=True, transpose=False)
        compiled.hidden_step(rule, [it], 1, b.global_shape, b.key, group, ns_dtype, batched=False)


def compiled_per_tensor(calls: Sequence[Call]) -> None:
    """The per-tensor form with ``compile=True``: a hidden rule's matrices one graph each; the elementwise
    rules' per-tensor forms stay eager (eq. 9's two row-blocked passes already run at memory bandwidth,
    docs/benchmarks.md)."""
    per_tensor(calls, _hidden_compiled)


# ---- the batched forms -----------------------------------------------------------------------------

#: One bucket's batched result: its direction stack (this rank's members, bucket orientation) and
#: the per-member state the owner changed (stacks, gathered with it).
Directions = tuple[Tensor | list[Tensor], list[Tensor]]


def batched(calls: Sequence[Call], orth: Orth = eager_directions) -> None:
    """The batched form (``foreach=True``) of several momentum rule calls of one optimizer step.

    Every momentum buffer of every call is updated in two ``torch._foreach_*`` kernels per distinct ``mu``
    and every direction input made in one more (with Nesterov; a transient copy of the parameters, as
    ``torch.optim``'s multi-tensor forms make, which each bucket's stack then lets go), then each call
    computes its directions (:func:`_pending`; ``orth`` at FSDP2's owners), and all updates are applied
    together: one decay kernel per distinct ``1 - lr wd`` and one add per distinct ``lr s``. Directions
    depend on gradients and momentum only, so computing them all before any parameter changes gives the
    bits of stepping the calls one by one.
    """
    by_mu: dict[tuple[float, bool], tuple[list[Item], list[Tensor], list[Tensor]]] = {}
    for _, items, group, _ in calls:
        members, bufs, grads = by_mu.setdefault((group["momentum"], group["nesterov"]), ([], [], []))
        for it in items:
            b = it.state["momentum_buffer"]
            members.append(it)
            bufs.append(b)
            grads.append(it.grad if it.grad.dtype == b.dtype else it.grad.to(b.dtype))
    inputs: dict[int, Tensor] = {}
    for (mu, nesterov), (members, bufs, grads) in by_mu.items():
        F.momentum_(bufs, grads, mu)
        inputs.update(zip(map(id, members), F.direction_input(grads, bufs, mu, nesterov), strict=True))
    for call in calls:
        call[3].inputs = inputs
    params, dirs, lrs, wds, scales = [], [], [], [], []
    for rule, items, group, ctx in calls:
        ps, ds, ss = _pending(rule, items, group, ctx, orth)
        params += ps
        dirs += ds
        scales += ss
        lrs += [group["lr"]] * len(ps)
        wds += [group["weight_decay"]] * len(ps)
    inputs.clear()  # what DDP ranks did not stack: not kept past the step
    F.decay_and_update_(params, dirs, lrs, wds, scales)


def _pending(rule: Rule, items: Sequence[Item], group: dict, ctx: StepContext, orth: Orth) -> tuple[list, list, list]:
    """The batched update of one call's ``items`` (momentum already updated), not applied: per shape bucket
    the directions of this rank's slice, gathered across DDP ranks (one collective per bucket).
    Returns ``(params, directions, scales)``."""
    if ctx.capture is not None:
        ctx.emit(items, [ctx.inputs[id(it)] for it in items], "momentum_input")
    hidden = isinstance(rule, HiddenRule)
    buckets = make_buckets(items, matrix=hidden or needs_matrix(rule),
                           transpose=hidden and rule.transposes and not ctx.split.sharded)
    # DDP: a contiguous slice of each bucket per rank; FSDP2 ranks update their row shards of all
    # members (a hidden rule's whole matrices meet at owners: sharded.py).
    split = ctx.split.world_size > 1 and not ctx.split.sharded and _splits(rule)
    plans = [ctx.split.bucket_plan(len(b.items), cost(rule, b.global_shape, group)) if split else None
             for b in buckets]
    ranges = [(sum(p[: ctx.split.rank]), sum(p[: ctx.split.rank + 1])) if split else (0, len(b.items))
              for p, b in zip(plans, buckets, strict=True)]
    busy = [i for i, (lo, hi) in enumerate(ranges) if hi > lo]
    mine = ([buckets[i] for i in busy], [ranges[i] for i in busy])
    keys = rule._owner_state
    found = _hidden_directions(rule, *mine, group, ctx, orth, keys) if hidden else _elementwise_directions(
        rule, *mine, group, ctx)
    results = dict(zip(busy, found, strict=True))
    params, dirs, scales, extras = [], [], [], []
    for i, (bucket, plan) in enumerate(zip(buckets, plans, strict=True)):
        D, owned = results[i] if i in results else _no_directions(bucket, keys)
        if split:  # one stack per bucket travels (a hidden rule's sides: flattened into one)
            D = D if isinstance(D, Tensor) else torch.cat([d.flatten(1) for d in D])
            D, *owned = ctx.split.gather([D, *owned], plan)
        extras.append(owned)
        params += [it.param for it in bucket.items]
        dirs += unstack(bucket, D)
        # A hidden rule's step multiplier (:meth:`HiddenRule.lr_scale`); the elementwise rules fold theirs in.
        scales += [rule.lr_scale(*bucket.global_shape, group) if hidden else 1.0] * len(bucket.items)
    for j, key in enumerate(keys):  # the gathered owner state back: one copy kernel per key
        states = [it.state[key] for b in buckets for it in b.items]
        torch._foreach_copy_(states, [s for owned in extras for s in owned[j].to(states[0].dtype).unbind(0)])
    return params, dirs, scales


def _elementwise_directions(rule: MomentumRule, buckets: list[Bucket], ranges: list[tuple[int, int]], group: dict,
                            ctx: StepContext) -> list[Directions]:
    """The directions of members ``lo..hi`` of each bucket: :meth:`MomentumRule.direction` of its stack."""
    return [(rule.direction(stack_inputs(ctx, rule.name, b, lo, hi, F._stat_dtype(b.items[0].param)), group,
                            ctx.split.psum, b.global_shape), [])
            for b, (lo, hi) in zip(buckets, ranges, strict=True)]


def _hidden_directions(rule: HiddenRule, buckets: list[Bucket], ranges: list[tuple[int, int]], group: dict,
                       ctx: StepContext, orth: Orth, keys: tuple[str, ...]) -> list[Directions]:
    """Per bucket the stack of members ``lo..hi``, then :func:`directions` of all (FSDP2: ``orth`` of each
    bucket's whole matrices at its owners, :func:`hidden_at_owners`)."""
    # Per-matrix values (counters, steps) of all buckets in one stack, each bucket's a view of it.
    mine = [it for b, (lo, hi) in zip(buckets, ranges, strict=True) for it in b.items[lo:hi]]
    device = mine[0].param.device
    scalars = {k: torch.tensor([it.state[k] for it in mine], device=device) if how == "step" else
               torch.stack([it.state[k] for it in mine]) for k, how in rule.state_views.items()
               if how in ("counter", "step")}
    stacks, o = [], 0
    for b, (lo, hi) in zip(buckets, ranges, strict=True):
        items = b.items[lo:hi]
        carry = ctx.split.sharded or rule._rewrites_input  # pre works in float32
        dtype = F._stat_dtype(items[0].param) if carry else resolve_dtype(group, items[0].param, ctx)
        state = {k: torch.stack([it.state[k] for it in items]) for k, how in rule.state_views.items()
                 if how == "rows"}
        state.update({k: v[o : o + hi - lo] for k, v in scalars.items()})
        stacks.append((stack_inputs(ctx, rule.name, b, lo, hi, dtype), max(0, min(b.plain - lo, hi - lo)), state))
        o += hi - lo
    if ctx.split.sharded:
        ds = [hidden_at_owners(rule, X, state, b.global_shape[0], group, ctx, orth)
              for (X, _, state), b in zip(stacks, buckets, strict=True)]
    else:
        ds = directions(rule, stacks, group, ctx, batched=True, dtype=buckets[0].items[0].param.dtype)
    return [(D, [state[k] for k in keys]) for D, (_, _, state) in zip(ds, stacks, strict=True)]


def _no_directions(bucket: Bucket, keys: tuple[str, ...]) -> Directions:
    """What a rank that owns no member of ``bucket`` contributes to its gather."""
    p = bucket.items[0].param
    D = torch.empty((0, math.prod(bucket.shape)), dtype=p.dtype, device=p.device)
    return D, [bucket.items[0].state[k][None][:0] for k in keys]


def compiled_batched(calls: Sequence[Call]) -> None:
    """The batched form with ``compile=True``: one graph per shape bucket, momentum inside.

    Under DDP (every rank holds every tensor) a hidden rule's bucket is split into contiguous slices as
    the eager batched form splits it; each rank updates the momentum of the other members eagerly, runs
    the bucket's graph on its slice, and one ``all_gather_into_tensor`` per bucket and dtype brings every
    slice's new parameters and owner state to every rank. An elementwise rule's buckets (memory-bound) run
    whole on every rank. FSDP2's hidden row shards take the eager batched form with each owner's
    directions one graph (``compiled.owner_directions``); the engine sends the elementwise rules' row
    shards to the owner path (``owners.py``), where the graphs see whole tensors.
    """
    at_owners = [c for c in calls if isinstance(c[0], HiddenRule) and c[3].split.sharded]
    if at_owners:
        batched(at_owners, compiled.owner_directions)
    for rule, items, group, ctx in calls:
        if isinstance(rule, HiddenRule) and ctx.split.sharded:
            continue
        if ctx.split.sharded:
            raise NotImplementedError("compile=True with foreach=True on row shards: the engine runs these rules at "
                                      "owner ranks (owners.py); this call is a bug")
        if ctx.capture is not None:
            raise NotImplementedError("the capture hook needs the eager step: build the optimizer without compile=True")
        if not isinstance(rule, HiddenRule):
            for b in make_buckets(items, matrix=needs_matrix(rule), transpose=False):
                compiled.elementwise_step(rule, b, group)
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
                compiled.hidden_step(rule, members, plain, b.global_shape, b.key, group, ns_dtype, batched=True)
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


# ---- the chooser -------------------------------------------------------------------------------------

#: The forms of a momentum rule's step by ``(foreach, compile)``.
FORMS: dict[tuple[bool, bool], Callable[[Sequence[Call]], None]] = {
    (False, False): per_tensor,
    (True, False): batched,
    (False, True): compiled_per_tensor,
    (True, True): compiled_batched,
}


def step(calls: Sequence[Call], *, foreach: bool, compile: bool) -> None:
    """Run a step's rule calls, each in its form: the one place a form is chosen (as torch's ``adam()``
    picks among its siblings).

    A :class:`SteppingRule` (AdamW, SCALE) runs its own ``step`` or ``step_foreach`` (eagerly, whatever
    ``compile``); the momentum rules run in :data:`FORMS` ``[foreach, compile]``, except that a hidden
    rule's FSDP2 row shards take the batched form whatever ``foreach``: their whole matrices meet at owner
    ranks a bucket at a time (``sharded.py``), and each matrix still gets the per-matrix Newton-Schulz of
    the per-tensor form on CPU (``newton_schulz.BATCHED_NS_DEVICES``). The calls are independent (no
    parameter in two), so the order among them changes no bits; it is the same on every rank, which
    the collectives need.
    """
    momentum, at_owners = [], []
    for call in calls:
        rule = call[0]
        if isinstance(rule, SteppingRule):
            (rule.step_foreach if foreach else rule.step)(*call[1:])
        elif isinstance(rule, HiddenRule) and call[3].split.sharded:
            at_owners.append(call)
        else:
            momentum.append(call)
    if momentum:
        FORMS[foreach, compile](momentum)
    if at_owners:
        FORMS[True, compile](at_owners)
