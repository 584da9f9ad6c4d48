"""The one driver of the momentum rules: momentum, shape stacks, the Newton-Schulz seam, the split over
ranks and the update, in every form.

A momentum rule updates ``B <- mu B + G`` (paper eq. 6; Moonlight's convention), takes the direction
input ``X = G + mu B`` with Nesterov (else ``B``), turns it into a direction ``D`` and steps
``W <- (1 - lr wd) W - lr s D``. A hidden rule (:class:`HiddenRule`) is two functions over a stack of
``K`` matrices ``(K, m, n)``, each in its own orientation, cut at Newton-Schulz as microsoft/dion cuts
its Muon into pre- and post-orthogonalisation:

    X = rule.pre(X, group)      the Newton-Schulz input (default: unchanged; MuonEq equilibrates)
    U = Orth(X)                 Newton-Schulz: NS_METHODS[group["ns_method"]] (newton_schulz.py;
                                "quintic", paper eq. 3, by default): the driver's
    D = rule.post(U, group)     the direction (MeqMuon: eq. 8; NorMuon: its row normalisation)
    s = rule.lr_scale(m, n, group)     a step multiplier (1 unless the rule says otherwise)

Everything else happens here, once, for every rule: momentum, stacking by shape, which members share a
Newton-Schulz stack transposed (:func:`~.newton_schulz.directions` hands ``pre`` and ``post`` each
orientation apart, so no rule sees a transposed member), the Newton-Schulz form, the DDP split and
gather, the FSDP2 all-to-all (``sharded.py``) and the update. The forms share one body, the seam's
:func:`~.newton_schulz.directions`:

- per-tensor (``foreach=False``, :meth:`HiddenRule.update`): each matrix a stack of one, made just
  before its Newton-Schulz and applied just after, so no model-sized temporary exists (on CPU fresh
  temporaries cost page faults), Newton-Schulz with fused ``addmm`` matrix by matrix;
- batched (``foreach=True``, :func:`step_foreach_calls`): one stack per shape bucket, one batched
  Newton-Schulz per bucket, ``post`` once for all stacks, one update for all calls;
- compiled (``compile=True``): the same body per bucket under ``torch.compile`` (``compiled.py``).

State: a rule that keeps per-matrix state names it in ``state_views`` (``"rows"``: one float per matrix
row, NorMuon's second moment; ``"counter"``: one int64 per matrix, MeqMuon's selection count;
``"step"``: the step count, read only) and receives ``state``, a dict of stacks ``(K, ...)`` in the order
of ``X``/``U``, in ``pre(X, group, state)`` and ``post(U, group, state)``; it updates them in place.

The elementwise momentum rules (``rules/meqmuon.py``, MeqMuon's eq. 9 and 10) give a direction of
the direction-input stack, :meth:`MomentumRule.directions_foreach`, and a per-tensor ``update``.
No rule makes a host-device sync: step counters are Python ints, choices are tensors.

Hyperparameters: each rule declares the keys it reads with their defaults (``defaults``) and checks them
(``validate``), beside its maths: the momentum rules' ``momentum``/``nesterov``/``rho`` here on
:class:`MomentumRule`, the seam's ``ns_steps``/``ns_coefficients``/``ns_dtype``/``ns_method`` on
:class:`HiddenRule` (``rule.py``: :class:`~.rule.Rule`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import functional as F
from . import compiled
from .distributed import state_like
from .inputs import flag, float_dtype, number, positive_int
from .newton_schulz import (
    NS_METHODS,
    Bucket,
    buffer,
    directions,
    make_buckets,
    matrix_shape,
    ns_flops,
    resolve_dtype,
    unstack,
)
from .rule import ELEMENTWISE_COST, Item, Rule, StepContext, state_dtype
from .sharded import hidden_at_owners
from .views import Layout

__all__ = ["MOMENTUM", "RHO", "HiddenRule", "MomentumRule", "apply_update", "direction_input", "grads_like",
           "stack_inputs", "stack_tensors", "step_foreach_calls"]


#: The paper's momentum and RMS alignment (section 4: Nesterov momentum 0.95, rho = 0.2), the momentum
#: rules' defaults.
MOMENTUM = 0.95
RHO = 0.2


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


# ---- the momentum rules --------------------------------------------------------------------------


#: One bucket's batched result: its direction stack (this rank's members, bucket orientation) and
#: the per-member state the owner changed (stacks, gathered with it).
Directions = tuple[Tensor | list[Tensor], list[Tensor]]


class MomentumRule(Rule):
    """Momentum ``B <- mu B + G`` on every rank for every parameter, then the direction and the step on
    the owned ones. Under DDP each parameter (per-tensor) or each slice of a bucket (batched) has one
    owner rank, which computes it; the owners' parameters are broadcast (per-tensor) or their
    directions gathered (batched), with the ``owner_state`` the rule changed."""

    defaults = {"momentum": MOMENTUM, "nesterov": True, "rho": RHO}
    state_views = {"momentum_buffer": "param"}
    #: Per-parameter state besides the momentum that the direction changes (sent by owners).
    owner_state: ClassVar[tuple[str, ...]] = ()
    #: Split the work over DDP ranks; False where repeating it is cheaper than sending it.
    split_work: ClassVar[bool] = True
    #: Batched path: may an ``(n, m)`` member join an ``(m, n)`` bucket transposed?
    transposes: ClassVar[bool] = False
    #: The direction passes through Newton-Schulz (hidden rules).
    needs_ns: ClassVar[bool] = False
    compiles = True

    def state_elements(self, layout: Layout) -> int:
        return math.prod(layout.batch) * layout.rows * layout.cols

    def init_state(self, p, state, group, layout):
        state["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype(p, group),
                                                    memory_format=torch.preserve_format)
        state["step"] = 0

    def validate(self, group: dict) -> None:
        """``momentum`` in [0, 1), ``nesterov`` a bool, ``rho`` > 0."""
        group["momentum"] = number("momentum", group["momentum"], low=0.0, high=1.0)
        flag("nesterov", group["nesterov"])
        group["rho"] = number("rho", group["rho"], low=0.0, low_inclusive=False)

    def cost(self, shape: Sequence[int], group: dict) -> float:
        """Estimated cost of one parameter's direction, for balancing DDP owners."""
        return ELEMENTWISE_COST * math.prod(shape)

    def update(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        """Per-tensor form: the directions of ``items`` (momentum already updated) and their steps."""
        raise NotImplementedError

    def direction(self, X: Tensor, group: dict, psum: F.PSum, shape: tuple[int, ...]) -> Tensor:
        """An elementwise rule's direction of a stack ``X`` ``(K, *shape)`` of direction inputs (float32 or
        float64, scratch: may be the result), its step multiplier folded in (the step adds it with ``s = 1``);
        ``psum`` sums statistics over row shards (FSDP2), ``shape`` is one member's unsharded shape."""
        raise NotImplementedError

    def directions_foreach(self, buckets: list[Bucket], ranges: list[tuple[int, int]], group: dict,
                           ctx: StepContext) -> list[Directions]:
        """Batched form: the directions of members ``lo..hi`` of each bucket (momentum already updated);
        here :meth:`direction` of each bucket's stack."""
        return [(self.direction(stack_inputs(ctx, self.name, b, lo, hi, F._stat_dtype(b.items[0].param)), group,
                                ctx.split.psum, b.global_shape), [])
                for b, (lo, hi) in zip(buckets, ranges, strict=True)]

    def step(self, items, group, ctx):
        if ctx.split.sharded and self.needs_ns:  # FSDP2: whole matrices meet at owners, a bucket at a time
            step_foreach_calls([(self, items, group, ctx)])
            return
        bufs = [it.state["momentum_buffer"] for it in items]
        F.momentum_(bufs, grads_like(items, bufs), group["momentum"], fused=True)
        if ctx.capture is not None:
            ctx.emit(items, [direction_input(it, group) for it in items], "momentum_input")
        if not self.split_work or ctx.split.world_size == 1:  # one process: this rank owns all
            self.update(items, group, ctx)
            return
        owners = ctx.split.owners([self.cost(it.shape, group) for it in items])
        mine = [it for it, o in zip(items, owners, strict=True) if o == ctx.split.rank]
        if mine:
            self.update(mine, group, ctx)
        ctx.split.publish([[it.param, *(it.state[k] for k in self.owner_state)] for it in items], owners)

    def step_foreach(self, items, group, ctx):
        """The batched form of this call alone; ``compile=True``: one compiled graph per bucket."""
        if ctx.compile:
            compiled.momentum_step(self, items, group, ctx, per_tensor=False)
        else:
            step_foreach_calls([(self, items, group, ctx)])

    def pending_foreach(self, items: Sequence[Item], group: dict, ctx: StepContext) -> tuple[list, list, list]:
        """The batched update of ``items`` (momentum already updated), not applied: per shape bucket the
        directions of this rank's slice, gathered across DDP ranks (one collective per bucket).
        Returns ``(params, directions, scales)``."""
        if ctx.capture is not None:
            ctx.emit(items, [ctx.inputs[id(it)] for it in items], "momentum_input")
        buckets = make_buckets(items, matrix=self.needs_matrix, transpose=self.transposes and not ctx.split.sharded)
        # DDP: a contiguous slice of each bucket per rank; FSDP2 ranks update their row shards of all
        # members (a hidden rule's whole matrices meet at owners: sharded.py).
        split = self.split_work and not ctx.split.sharded and ctx.split.world_size > 1
        plans = [ctx.split.bucket_plan(len(b.items), self.cost(b.global_shape, group)) if split else None
                 for b in buckets]
        ranges = [(sum(p[: ctx.split.rank]), sum(p[: ctx.split.rank + 1])) if split else (0, len(b.items))
                  for p, b in zip(plans, buckets, strict=True)]
        busy = [i for i, (lo, hi) in enumerate(ranges) if hi > lo]
        results = dict(zip(busy, self.directions_foreach([buckets[i] for i in busy], [ranges[i] for i in busy],
                                                         group, ctx), strict=True))
        params, dirs, scales, extras = [], [], [], []
        for i, (bucket, plan) in enumerate(zip(buckets, plans, strict=True)):
            D, owned = results[i] if i in results else self.empty_directions(bucket)
            if split:  # one stack per bucket travels (a hidden rule's sides: flattened into one)
                D = D if isinstance(D, Tensor) else torch.cat([d.flatten(1) for d in D])
                D, *owned = ctx.split.gather([D, *owned], plan)
            extras.append(owned)
            params += [it.param for it in bucket.items]
            dirs += unstack(bucket, D)
            # A hidden rule's step multiplier (:meth:`HiddenRule.lr_scale`); the elementwise rules fold theirs in.
            scales += [self.lr_scale(*bucket.global_shape, group) if self.needs_ns else 1.0] * len(bucket.items)
        for j, key in enumerate(self.owner_state):  # the gathered owner state back: one copy kernel per key
            states = [it.state[key] for b in buckets for it in b.items]
            torch._foreach_copy_(states, [s for owned in extras for s in owned[j].to(states[0].dtype).unbind(0)])
        return params, dirs, scales

    def empty_directions(self, bucket: Bucket) -> Directions:
        """What a rank that owns no member of ``bucket`` contributes to its gather."""
        p = bucket.items[0].param
        D = torch.empty((0, math.prod(bucket.shape)), dtype=p.dtype, device=p.device)
        return D, [bucket.items[0].state[k][None][:0] for k in self.owner_state]



def step_foreach_calls(calls: Sequence[tuple[Rule, Sequence[Item], dict, StepContext]]) -> None:
    """The batched step of several rule calls of one optimizer step (``(rule, items, group, ctx)``).

    Momentum rules share kernels: every momentum buffer of every call is updated in two
    ``torch._foreach_*`` kernels per distinct ``mu`` and every direction input made in one more (with
    Nesterov; a transient copy of the parameters, as ``torch.optim``'s multi-tensor forms make, which
    each bucket's stack then lets go), then each call computes its directions
    (:meth:`MomentumRule.pending_foreach`), and all updates are applied together: one decay kernel per
    distinct ``1 - lr wd`` and one add per distinct ``lr s``. Directions depend on gradients and momentum
    only, so computing them all before any parameter changes gives the bits of stepping the calls one by
    one. Other rules (Adam-type, SCALE) and ``compile=True`` step alone.
    """
    shared = []
    for call in calls:
        rule, ctx = call[0], call[3]
        # compile=True: one graph per bucket, momentum inside; FSDP2's hidden owners compile their part
        if isinstance(rule, MomentumRule) and (not ctx.compile or (ctx.split.sharded and rule.needs_ns)):
            shared.append(call)
        else:
            call[0].step_foreach(*call[1:])
    by_mu: dict[tuple[float, bool], tuple[list[Item], list[Tensor], list[Tensor]]] = {}
    for _, items, group, _ in shared:
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
    for call in shared:
        call[3].inputs = inputs
    params, dirs, lrs, wds, scales = [], [], [], [], []
    for rule, items, group, ctx in shared:
        ps, ds, ss = rule.pending_foreach(items, group, ctx)
        params += ps
        dirs += ds
        scales += ss
        lrs += [group["lr"]] * len(ps)
        wds += [group["weight_decay"]] * len(ps)
    inputs.clear()  # what DDP ranks did not stack: not kept past the step
    F.decay_and_update_(params, dirs, lrs, wds, scales)


# ---- hidden matrices: the seam -------------------------------------------------------------------


class HiddenRule(MomentumRule):
    """A rule for hidden matrices: ``post(Orth(pre(X)))`` (see the module docstring).

    Subclass it, set ``name`` and override :meth:`post` (and :meth:`pre` if the rule changes the
    Newton-Schulz input); pass an instance as ``rules={"hidden": MyRule()}`` to any optimizer.
    """

    needs_matrix = True
    needs_ns = True
    defaults = {"ns_steps": F.NS_STEPS, "ns_coefficients": F.NS_COEFFICIENTS, "ns_dtype": None, "ns_method": "quintic"}
    #: ``pre`` is overridden (set for each subclass): the driver skips the identity ``pre``, and the batched
    #: form stacks the inputs of a rule that rewrites them in float32.
    rewrites_input: ClassVar[bool] = False
    #: May an ``(n, m)`` matrix share the Newton-Schulz stack of ``(m, n)`` matrices, transposed? Exact for
    #: every rule (``pre``/``post`` see each orientation apart); it saves a Newton-Schulz stack and costs a
    #: second ``pre``/``post`` call. Per-row state cannot: its rows would change length.
    transposes: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.rewrites_input = cls.pre is not HiddenRule.pre
        cls.owner_state = tuple(k for k, how in cls.state_views.items() if how in ("rows", "counter"))
        if cls.transposes and "rows" in cls.state_views.values():
            raise TypeError(f"{cls.__name__}: per-row state needs transposes = False (rows would change length)")

    def pre(self, X: Tensor, group: dict, state: dict[str, Tensor] | None = None) -> Tensor:
        """The Newton-Schulz input from the direction input ``X`` ``(K, m, n)``: here ``X``. Must not
        write into ``X`` (without Nesterov it is the momentum buffer)."""
        return X

    def post(self, U: Tensor, group: dict, state: dict[str, Tensor] | None = None) -> Tensor:
        """The direction ``D`` ``(K, m, n)`` from ``U = Orth(X)``: here ``U``."""
        return U

    def post_all(self, Us: list[Tensor], group: dict, states: list[dict[str, Tensor]]) -> list[Tensor]:
        """:meth:`post` of every stack of a call (one per shape and orientation), called once: here one
        ``post`` each. A rule whose statistics can be taken for all matrices in a fixed number of kernels
        (MeqMuon's eq. 8) overrides it: on a GPU a step is launch-bound."""
        if type(self).post is HiddenRule.post:
            return Us
        return [self.post(U, group, st) if st else self.post(U, group) for U, st in zip(Us, states, strict=True)]

    def validate(self, group: dict) -> None:
        """``ns_steps`` an integer >= 1, ``ns_coefficients`` a form :func:`F.ns_schedule` takes, ``ns_dtype``
        a floating dtype or ``None``, ``ns_method`` a name of :data:`NS_METHODS`."""
        positive_int("ns_steps", group["ns_steps"])
        F.ns_schedule(group["ns_coefficients"], group["ns_steps"])  # raises ValueError naming the valid forms
        float_dtype("ns_dtype", group["ns_dtype"])
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(f"Invalid ns_method: {group['ns_method']!r} (known methods: {', '.join(NS_METHODS)})")

    def lr_scale(self, m: int, n: int, group: dict) -> float:
        """A step multiplier ``s`` of an ``m x n`` matrix, applied inside the update (``-lr s D``) instead
        of as a pass over ``D``; 1 here."""
        return 1.0

    # ---- what the engine and the driver ask of every hidden rule ---------------------------------

    def state_elements(self, layout):
        return super().state_elements(layout) + sum(
            math.prod(layout.rows_shape) for how in self.state_views.values() if how == "rows")

    def init_state(self, p, state, group, layout):
        super().init_state(p, state, group, layout)
        for key, how in self.state_views.items():
            if how == "rows":
                state[key] = state_like(p, layout.rows_shape, torch.promote_types(p.dtype, torch.float32),
                                        aligned=not layout.folded and (bool(layout.batch) or not layout.transposed))
            elif how == "counter":  # a whole matrix's counter is a plain tensor even under FSDP2
                state[key] = state_like(p, layout.counter_shape, torch.int64, aligned=not layout.folded) \
                    if layout.batch else torch.zeros(layout.counter_shape, dtype=torch.int64, device=p.device)

    def cost(self, shape, group):
        return ns_flops(*matrix_shape(shape), group["ns_steps"]) + super().cost(shape, group)

    def update(self, items, group, ctx):
        """Per-tensor form: every matrix a stack of one, made just before its Newton-Schulz."""
        if ctx.compile:
            compiled.momentum_step(self, items, group, ctx, per_tensor=True)
            return
        scratch: dict[tuple, Tensor] = {}
        per_matrix = [(k, how) for k, how in self.state_views.items() if how in ("rows", "counter", "step")]
        for it in items:
            b, shape = it.state["momentum_buffer"], it.shape
            x = direction_input(it, group, out=buffer(scratch, "nesterov", b.shape, b.dtype, b.device))
            X = x.reshape(x.shape[0], -1) if x.ndim > 2 else x
            state = {k: torch.tensor([it.state[k]], device=b.device) if how == "step" else it.state[k][None]
                     for k, how in per_matrix}
            ((D,),) = directions(self, [(X[None], 1, state)], group, ctx, batched=False, scratch=scratch)
            apply_update([it], [D[0]], [self.lr_scale(shape[0], math.prod(shape[1:]), group)], group, scratch)

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Batched form: per bucket the stack of members ``lo..hi``, then :func:`directions` of all."""
        # Per-matrix values (counters, steps) of all buckets in one stack, each bucket's a view of it.
        mine = [it for b, (lo, hi) in zip(buckets, ranges, strict=True) for it in b.items[lo:hi]]
        device = mine[0].param.device
        scalars = {k: torch.tensor([it.state[k] for it in mine], device=device) if how == "step" else
                   torch.stack([it.state[k] for it in mine]) for k, how in self.state_views.items()
                   if how in ("counter", "step")}
        stacks, o = [], 0
        for b, (lo, hi) in zip(buckets, ranges, strict=True):
            items = b.items[lo:hi]
            carry = ctx.split.sharded or self.rewrites_input  # pre works in float32
            dtype = F._stat_dtype(items[0].param) if carry else resolve_dtype(group, items[0].param, ctx)
            state = {k: torch.stack([it.state[k] for it in items]) for k, how in self.state_views.items()
                     if how == "rows"}
            state.update({k: v[o : o + hi - lo] for k, v in scalars.items()})
            stacks.append((stack_inputs(ctx, self.name, b, lo, hi, dtype), max(0, min(b.plain - lo, hi - lo)), state))
            o += hi - lo
        if ctx.split.sharded:
            ds = [hidden_at_owners(self, X, state, b.global_shape[0], group, ctx)
                  for (X, _, state), b in zip(stacks, buckets, strict=True)]
        else:
            ds = directions(self, stacks, group, ctx, batched=True, dtype=buckets[0].items[0].param.dtype)
        return [(D, [state[k] for k in self.owner_state]) for D, (_, _, state) in zip(ds, stacks, strict=True)]
