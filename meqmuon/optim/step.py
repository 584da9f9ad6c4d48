"""The step machinery every rule shares: context, items, buffers, stacking, applying updates, the
batched orchestration across calls, the DDP cost model and the ``Rule`` base classes.

A rule (``rules/``) receives all parameters of its kind in one param group at once. Its per-tensor
form (:meth:`Rule.step`) works through them one at a time: each matrix's direction input is made
just before its Newton-Schulz and dropped after its update, so no model-sized temporary exists (on
CPU, fresh 64 MB temporaries cost more in page faults than the arithmetic; docs/benchmarks.md).
Its batched form (:meth:`Rule.step_foreach`, ``foreach=True``, the default on CUDA) does the same
maths over shape buckets (``buckets.py``), a fixed number of kernels per bucket instead of per
parameter; the per-tensor form is the reference it is tested against. Momentum rules also have a
compiled form (``compile=True``): one graph per bucket (:func:`meqmuon.optim.compiled.bucket_step`).
The hidden-matrix rules implement these hooks once, in the driver of ``hidden.py``, and are
themselves ``pre``/``post`` functions; the elementwise momentum rules (``rules/normalize.py``) write
their forms here. No rule makes a host-device sync: step counters are Python ints, choices are
tensors.

Every rule applies decoupled weight decay and its step the same way
(:func:`meqmuon.functional.decay_and_update_`), ``W <- (1 - lr * wd) * W - lr * scale * D``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import functional as F
from . import compiled
from .buckets import Bucket, make_buckets
from .distributed import LocalSplit, local
from .views import Layout


class StepContext:
    """Per-step extras the engine hands to rules. ``capture`` is an opt-in diagnostics hook.

    When ``capture`` is set, momentum rules call it as ``capture(name, kind, "momentum_input", x)``
    with the direction input (the pre-Newton-Schulz matrix for hidden weights), and Adam/SCALE
    rules with ``"gradient"`` and the raw gradient. Default ``None``: no call, no cost.
    """

    __slots__ = ("capture", "kind", "split", "compile", "workspace", "call")

    def __init__(
        self,
        capture: Callable[[str, str, str, Tensor], None] | None = None,
        kind: str = "",
        split: LocalSplit | None = None,
        compile: bool = False,
        workspace: dict | None = None,
        call: int = 0,
    ) -> None:
        self.capture = capture
        self.kind = kind
        #: Tensors the batched step keeps between steps (one input stack per bucket, statistics
        #: buffers); owned by the optimizer, never part of its state_dict.
        self.workspace = workspace if workspace is not None else {}
        #: This call's position among the step's batched calls: its input stacks are its own, since
        #: some rules' directions are those stacks and all calls' updates are applied together.
        self.call = call
        #: Run the rules' compiled forms (``compile=True``) where they have one.
        self.compile = compile
        #: Work splitter (see ``distributed.py``): who orthogonalises which matrix, sums over shards.
        self.split = split if split is not None else LocalSplit()

    def emit(self, items: Sequence[Item], tensors: Sequence[Tensor], what: str) -> None:
        if self.capture is not None:
            for it, x in zip(items, tensors, strict=True):
                self.capture(it.name, it.kind or self.kind, what, x)


class Item:
    """One parameter in a rule call: the tensor, its gradient, its state, its name and its global shape.

    Under FSDP2 ``param`` and ``grad`` are the local row shards (plain tensors sharing storage with
    the DTensors), ``shape`` the full shape, and state tensors are DTensors (read them with
    :func:`meqmuon.optim.distributed.local`).
    """

    __slots__ = ("param", "grad", "state", "name", "shape", "kind")

    def __init__(
        self, param: Tensor, grad: Tensor, state: dict[str, Any], name: str, shape: torch.Size | None = None,
        kind: str = "",
    ) -> None:
        self.param = param
        self.grad = grad
        self.state = state
        self.name = name
        self.shape = param.shape if shape is None else shape
        self.kind = kind


def apply_update(
    items: Sequence[Item],
    directions: Sequence[Tensor],
    scales: Sequence[float],
    group: dict,
    scratch: dict[tuple, Tensor] | None = None,
) -> None:
    """``W <- (1 - lr*wd) W - lr * scale * D`` for every item, one at a time (:func:`F.decay_and_update_`).

    Mixed dtypes compute in the wider one, as torch.optim.Muon's bf16 update into float32
    parameters. A narrower direction (bf16 Newton-Schulz output) is cast into a buffer kept in
    ``scratch`` per shape: ``p.add_(d)`` would cast it anyway, through a fresh parameter-sized
    temporary per call (TensorIterator promotes mixed-dtype inputs on CPU). Same bits.
    """
    lr, wd = group["lr"], group["weight_decay"]
    for it, d, s in zip(items, directions, scales, strict=True):
        p = it.param
        d = d.reshape(p.shape)
        if scratch is not None and d.dtype != p.dtype and torch.promote_types(d.dtype, p.dtype) == p.dtype:
            d = buffer(scratch, "direction", p.shape, p.dtype, p.device).copy_(d)
        F.decay_and_update_([p], [d], lr, wd, [s])


def buffer(
    scratch: dict[tuple, Tensor], role: str, shape: torch.Size, dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> Tensor:
    """A buffer for ``role`` kept in ``scratch`` and reused by same-shape matrices within a step."""
    key = (role, tuple(shape), dtype, device)
    if key not in scratch:
        scratch[key] = torch.empty(shape, dtype=dtype, device=device)
    return scratch[key]


def state_dtype(p: Tensor, group: dict) -> torch.dtype:
    """The dtype of a parameter's state tensors: the group's ``state_dtype``, else the parameter's."""
    return group.get("state_dtype") or p.dtype


def _update_momentum(items: Sequence[Item], group: dict) -> None:
    """``B <- mu B + G`` in place, one pass per tensor (:func:`F.momentum_`, fused form)."""
    bufs = [local(it.state["momentum_buffer"]) for it in items]
    F.momentum_(bufs, grads_like(items, bufs), group["momentum"], fused=True)


def direction_input(it: Item, group: dict, rows: slice = slice(None), out: Tensor | None = None) -> Tensor:
    """Rows ``rows`` of the direction input of a momentum rule (:func:`F.direction_input`): ``G + mu B``
    with Nesterov (into ``out`` if given, else a new tensor), else ``B`` itself. Made on demand, per
    parameter (or block of rows), so that no model-sized temporary exists at once and DDP ranks make
    only the inputs of what they own."""
    b, g = local(it.state["momentum_buffer"]), it.grad
    if rows != slice(None):  # a 0-D parameter (a vector of one element) cannot be sliced
        b, g = b[rows], g[rows]
    g = g if g.dtype == b.dtype else g.to(b.dtype)
    return F.direction_input([g], [b], group["momentum"], group["nesterov"], None if out is None else [out])[0]


# --------------------------------------------------------------------------------------------
# Batched (foreach) step: shared pieces.
# --------------------------------------------------------------------------------------------


def workspace(ctx: StepContext, key: tuple, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              zero: bool = False) -> Tensor:
    """A tensor kept between steps in the optimizer's workspace (made on first use, zeroed if ``zero``)."""
    full = (key, tuple(shape), dtype, device)
    t = ctx.workspace.get(full)
    if t is None:
        t = ctx.workspace[full] = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    return t


def grads_like(items: Sequence[Item], like: Sequence[Tensor]) -> list[Tensor]:
    """The items' gradients in the dtypes of ``like`` (their momentum buffers, say)."""
    return [it.grad if it.grad.dtype == b.dtype else it.grad.to(b.dtype) for it, b in zip(items, like, strict=True)]


def _foreach_momentum(items: Sequence[Item], mu: float) -> None:
    """``B <- mu B + G`` for every item in two ``torch._foreach_*`` kernels (:func:`F.momentum_`)."""
    bufs = [local(it.state["momentum_buffer"]) for it in items]
    F.momentum_(bufs, grads_like(items, bufs), mu)


def stack_inputs(ctx: StepContext, name: str, bucket: Bucket, lo: int, hi: int, group: dict,
                 dtype: torch.dtype) -> Tensor:
    """The direction inputs of members ``lo..hi`` (``G + mu B``, or ``B``) stacked in the bucket's
    persistent workspace, cast to ``dtype`` (the Newton-Schulz dtype for hidden matrices) on the way."""
    items = bucket.items[lo:hi]
    out = workspace(ctx, (name, "inputs", ctx.call, bucket.key, lo, hi), (hi - lo, *bucket.shape), dtype,
                    items[0].param.device)
    bufs = [local(it.state["momentum_buffer"]) for it in items]
    values = F.direction_input(grads_like(items, bufs), bufs, group["momentum"], group["nesterov"])
    return bucket.stack_into(out, values, start=lo)


def stack_tensors(ctx: StepContext, name: str, bucket: Bucket, tensors: Sequence[Tensor]) -> Tensor:
    """``tensors`` (one per member) stacked in the bucket's workspace, at least float32."""
    t0 = tensors[0]
    out = workspace(ctx, (name, "inputs", ctx.call, bucket.key), (len(tensors), *bucket.shape),
                    torch.promote_types(t0.dtype, torch.float32), t0.device)
    return bucket.stack_into(out, tensors)


class PendingUpdate(NamedTuple):
    """A batched call's update, ``W <- (1 - lr wd) W - lr s D`` per parameter, not yet applied."""

    params: list[Tensor]
    directions: list[Tensor]
    scales: list[float]
    lr: float
    weight_decay: float


def _foreach_apply(pending: Sequence[PendingUpdate]) -> None:
    """Apply several calls' updates together in one :func:`F.decay_and_update_`: one decay kernel per
    distinct ``1 - lr wd``, then one ``_foreach_add_`` per distinct ``lr s``. All decays come before
    all adds; each parameter is in one call, so its bits are those of ``decay, add``."""
    params, directions, scales, lrs, wds = [], [], [], [], []
    for u in pending:
        params += u.params
        directions += u.directions
        scales += u.scales
        lrs += [u.lr] * len(u.params)
        wds += [u.weight_decay] * len(u.params)
    F.decay_and_update_(params, directions, lrs, wds, scales)


def _slice(counts: Sequence[int], rank: int) -> tuple[int, int]:
    lo = sum(counts[:rank])
    return lo, lo + counts[rank]


#: One bucket's batched result: its direction stack (members of this rank's slice, in the bucket's
#: orientation) and per-member state the owner changed (stacks, gathered with it).
Directions = tuple[Tensor, list[Tensor]]


class Rule:
    """Base class. Subclasses set ``name``, the state they keep and implement ``step``."""

    name: ClassVar[str]
    #: Parameter kinds this rule accepts (matrix rules need >=2-D tensors).
    needs_matrix: ClassVar[bool] = False
    #: Hyperparameter keys the rule reads from its group (validated by the engine).
    hyperparameters: ClassVar[tuple[str, ...]] = ()
    #: Each element's update depends on that element alone (AdamW): the engine hands a vector rule
    #: a stack of vectors (view ``"vectors"``) whole, where any other vector rule gets each vector.
    elementwise: ClassVar[bool] = False

    #: How each state tensor divides among a parameter's matrices (``views.py``): ``"param"`` (shaped
    #: like the parameter), ``"rows"`` (one value per matrix row), ``"counter"`` (one per matrix).
    state_views: ClassVar[dict[str, str]] = {}

    def state_elements(self, layout: Layout) -> int:
        """Number of state elements (excluding scalar counters) kept for a parameter of ``layout``."""
        raise NotImplementedError

    def init_state(self, p: Tensor, state: dict[str, Any], group: dict, layout: Layout) -> None:
        """Create the state of parameter ``p``; ``state["step"]`` is counted by the engine."""
        raise NotImplementedError

    def step(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        raise NotImplementedError

    def step_foreach(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        """The batched form of :meth:`step` (``foreach=True``): the same maths over shape buckets."""
        raise NotImplementedError


#: Cost of an elementwise update, in matmul-FLOP equivalents per element, for balancing DDP owners
#: (``MomentumRule.cost``): on CPU, the row-blocked equilibration of a 32000 x 512 matrix took as long
#: as 1000 Newton-Schulz FLOPs per element at the bf16 matmul rate. A heuristic: results never depend on it.
ELEMENTWISE_COST = 1000.0


class MomentumRule(Rule):
    """Momentum ``B <- mu B + G`` (every rank, every parameter), then ``update`` on the owned ones.

    Under DDP (``ReplicatedSplit``) each parameter's ``update`` runs on one owner rank, which then
    broadcasts the parameter and the ``owner_state`` entries; everywhere else every rank owns all.
    """

    hyperparameters = ("momentum", "nesterov")
    #: Per-parameter state besides the momentum that ``update`` changes (broadcast by the owner).
    owner_state: ClassVar[tuple[str, ...]] = ()
    #: Split updates over DDP ranks; False where repeating the work is cheaper than sending it.
    split_work: ClassVar[bool] = True

    state_views = {"momentum_buffer": "param"}

    def state_elements(self, layout):
        return math.prod(layout.batch) * layout.rows * layout.cols

    def init_state(self, p, state, group, layout):
        state["momentum_buffer"] = torch.zeros_like(
            p, dtype=state_dtype(p, group), memory_format=torch.preserve_format
        )
        state["step"] = 0

    def cost(self, shape: torch.Size | tuple[int, ...], group: dict) -> float:
        """Estimated cost of one ``update`` of a parameter of (global) ``shape``, for owner balancing."""
        return ELEMENTWISE_COST * math.prod(shape)

    def update(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        """Compute the directions of ``items`` (momentum already updated) and apply the step."""
        raise NotImplementedError

    def step(self, items, group, ctx):
        _update_momentum(items, group)
        if ctx.capture is not None:
            ctx.emit(items, [direction_input(it, group) for it in items], "momentum_input")
        if not self.split_work or ctx.split.world_size == 1:  # one process: this rank owns all
            self.update(items, group, ctx)
            return
        owners = ctx.split.owners([self.cost(it.shape, group) for it in items])
        mine = [it for it, o in zip(items, owners, strict=True) if o == ctx.split.rank]
        if mine:
            self.update(mine, group, ctx)
        ctx.split.publish([[it.param, *(local(it.state[k]) for k in self.owner_state)] for it in items], owners)

    #: Batched path: may a 2-D ``(n, m)`` parameter join an ``(m, n)`` bucket transposed?
    transposes: ClassVar[bool] = False

    def step_foreach(self, items, group, ctx):
        """Batched :meth:`step` of this call alone (:func:`step_foreach_calls` with one call); with
        ``compile=True`` one compiled graph per bucket (:meth:`step_compiled`)."""
        if not ctx.compile:
            step_foreach_calls([(self, items, group, ctx)])
            return
        self.step_compiled(items, group, ctx)

    def pending_foreach(self, items: Sequence[Item], group: dict, ctx: StepContext) -> PendingUpdate:
        """The batched update of ``items`` (momentum already updated): per shape bucket the
        directions of this rank's slice of the bucket (:meth:`directions_foreach`), gathered across
        DDP ranks with one collective per bucket, and the owner state stored (:meth:`store_foreach`)."""
        if ctx.capture is not None:
            ctx.emit(items, [direction_input(it, group) for it in items], "momentum_input")
        buckets = make_buckets(items, matrix=self.needs_matrix, transpose=self.transposes and not ctx.split.sharded)
        # DDP splits buckets into per-rank slices; FSDP2 ranks each update their row shards of all
        # members (a hidden rule's directions move whole matrices to owners: hidden.py).
        split = self.split_work and not ctx.split.sharded and ctx.split.world_size > 1
        plans = [ctx.split.bucket_plan(len(b), self.cost(b.global_shape, group)) if split else [len(b)]
                 for b in buckets]
        ranges = [_slice(plan, ctx.split.rank) if split else (0, len(b))
                  for plan, b in zip(plans, buckets, strict=True)]
        busy = [i for i, (lo, hi) in enumerate(ranges) if hi > lo]
        results = dict(zip(busy, self.directions_foreach([buckets[i] for i in busy], [ranges[i] for i in busy],
                                                         group, ctx), strict=True))
        params: list[Tensor] = []
        directions: list[Tensor] = []
        scales: list[float] = []
        extras: list[list[Tensor]] = []
        for i, (bucket, plan) in enumerate(zip(buckets, plans, strict=True)):
            D, owned = results[i] if i in results else self.empty_directions(bucket)
            if split:  # one stack per bucket travels (a hidden rule's sides: one each)
                D = D if isinstance(D, Tensor) else torch.cat([d.flatten(1) for d in D])
                D, *owned = ctx.split.gather([D, *owned], plan)
            extras.append(owned)
            params += [it.param for it in bucket.items]
            directions += bucket.unstack(D)
            scales += [self.scale_foreach(bucket, group)] * len(bucket)
        if self.owner_state:
            self.store_foreach(buckets, extras)
        return PendingUpdate(params, directions, scales, group["lr"], group["weight_decay"])

    #: The compiled form (``compile=True`` with ``foreach=True``): a function of one bucket's
    #: parameters, gradients, momentum buffers, the lists of :meth:`compiled_inputs` and the 0-D
    #: tensors ``lr, weight_decay, momentum, rho``, from momentum to update; ``None``: none.
    compiled_bucket: ClassVar[Callable[..., None] | None] = None

    def compiled_inputs(self, bucket: Bucket, group: dict) -> tuple[list[list[Tensor]], dict[str, Any]]:
        """Extra tensor lists (state the graph changes) and Python constants of ``compiled_bucket``."""
        return [], {}

    def step_compiled(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        """``compile=True``: each bucket's whole step, momentum to update, as one compiled graph of
        :attr:`compiled_bucket` (:func:`compiled.bucket_step`); one process only, since a gather
        cannot sit inside the graph."""
        if self.compiled_bucket is None:
            raise NotImplementedError(f"compile=True with foreach=True: rule {self.name!r} has no compiled form")
        if ctx.split.world_size > 1:
            raise NotImplementedError(
                "compile=True with foreach=True is one process only (DDP/FSDP2 gather between the directions and "
                "the update); use foreach=True without compile, or compile=True with foreach=False"
            )
        if ctx.capture is not None:
            raise NotImplementedError("the capture hook needs the eager step: build the optimizer without compile=True")
        scalars = [compiled.scalar(group[k]) for k in ("lr", "weight_decay", "momentum", "rho")]
        for b in make_buckets(items, matrix=self.needs_matrix, transpose=self.transposes):
            tensors = [[it.param.detach() for it in b.items], [it.grad for it in b.items],
                       [local(it.state["momentum_buffer"]) for it in b.items]]
            extra, static = self.compiled_inputs(b, group)
            compiled.bucket_step(self.name, type(self).compiled_bucket, b.key, *tensors, *extra, *scalars,
                                 nesterov=group["nesterov"], **static)

    def directions_foreach(self, buckets: list[Bucket], ranges: list[tuple[int, int]], group: dict,
                           ctx: StepContext) -> list[Directions]:
        """The batched directions of members ``lo..hi`` of each bucket (momentum already updated)."""
        raise NotImplementedError

    def scale_foreach(self, bucket: Bucket, group: dict) -> float:
        """The step scale of the batched directions of ``bucket`` (``W <- W - lr * scale * D``)."""
        raise NotImplementedError

    def empty_directions(self, bucket: Bucket) -> Directions:
        """What a rank that owns no member of ``bucket`` contributes to its gather."""
        p = bucket.items[0].param
        D = torch.empty((0, *bucket.shape), dtype=p.dtype, device=p.device)
        return D, [torch.empty((0, *t.shape[1:]), dtype=t.dtype, device=p.device) for t in self.owner_stacks(bucket)]

    def owner_stacks(self, bucket: Bucket) -> list[Tensor]:
        """Shape and dtype examples (one member each) of the owner state gathered with the directions."""
        return []

    def store_foreach(self, buckets: list[Bucket], extras: list[list[Tensor]]) -> None:
        """Write the gathered owner state into the state: ``extras[i]`` holds bucket ``i``'s stacks
        over all its members (one kernel for all buckets where the dtypes allow)."""


def step_foreach_calls(calls: Sequence[tuple[Rule, Sequence[Item], dict, StepContext]]) -> None:
    """The batched step of several rule calls of one optimizer step (``(rule, items, group, ctx)``).

    The calls of momentum rules share kernels: every momentum buffer of every call is updated in two
    ``torch._foreach_*`` kernels per distinct ``mu`` (MeqMuon's hidden, embedding and vector rules
    make one), then each call computes its directions (:meth:`MomentumRule.pending_foreach`), and
    all updates are applied together: one decay kernel per distinct ``1 - lr wd`` and one add per
    distinct ``lr * scale``. Directions depend on gradients and momentum only, so computing them all
    before any parameter changes gives the bits of stepping the calls one by one. Other rules
    (Adam-type, SCALE) and ``compile=True`` (one graph per bucket, momentum inside) step alone.
    """
    shared = []
    for rule, items, group, ctx in calls:
        if isinstance(rule, MomentumRule) and not ctx.compile:
            shared.append((rule, items, group, ctx))
        else:
            rule.step_foreach(items, group, ctx)
    by_mu: dict[float, list[Item]] = {}
    for _rule, items, group, _ctx in shared:
        by_mu.setdefault(group["momentum"], []).extend(items)
    for mu, items in by_mu.items():
        _foreach_momentum(items, mu)
    _foreach_apply([rule.pending_foreach(items, group, ctx) for rule, items, group, ctx in shared])
