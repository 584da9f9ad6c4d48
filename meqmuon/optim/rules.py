"""Update rules: one object per rule, each turning gradients (and its state) into a parameter update.

An optimizer in this package is an assignment of rules to parameter kinds (see ``presets.py``).
Every rule applies decoupled weight decay and its step the same way,

    W <- (1 - lr * wd) * W - lr * scale * D,

where ``D`` is the rule's direction and ``scale`` its multiplier (``rho`` for MeqMuon's rules,
``rho * sqrt(max(m, n))`` for Moonlight's Muon, 1 for Adam-type and SCALE rules).

A rule receives all parameters of its kind in one param group at once and works through them one
at a time: each matrix's direction input is made just before its Newton-Schulz and dropped after
its update, so no model-sized temporary exists (on CPU, fresh 64 MB temporaries cost more in page
faults than the arithmetic; docs/benchmarks.md). On CPU Newton-Schulz runs matrix by matrix with
fused ``addmm`` (torch.optim.Muon's form): faster there than one batched call per shape, and it
makes each matrix's bits independent of its neighbours, which the DDP split relies on. On GPUs
each shape bucket is one batched call (``distributed.BATCHED_NS_DEVICES``). No rule makes a
host-device sync: step counters are Python ints, choices are tensors.

Every rule also has a batched form, ``step_foreach`` (``foreach=True``, the default on CUDA), beside
its per-tensor form: the same maths over shape buckets (``buckets.py``), a fixed number of kernels
per bucket instead of per parameter. The per-tensor form is the reference it is tested against.

Momentum convention (paper eq. 6 and Moonlight): ``B_t = mu * B_{t-1} + G_t``; the direction input
is ``G_t + mu * B_t`` with Nesterov, else ``B_t``. torch.optim.Muon and NorMuon keep an EMA
``M = lerp(M, G, 1 - mu)`` instead; the two differ by the scalar ``1 - mu`` only, which every
normalising rule removes (Newton-Schulz, row/column/RMS normalisation are scale-invariant).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import functional as F
from . import blockwise, fused
from .buckets import Bucket, make_buckets
from .distributed import LocalSplit, local, ns_dtype_of, ns_flops, state_like
from .views import Layout

# SCALE divides by the slice RMS clamped at this value (OptimAI-Lab/Minimalist_LLM_Pretraining
# f5bd4e7, mem_eff_pt/pt_scale/scale_optimizer.py: ``.clamp_min(1e-8)``).
SCALE_EPS = 1e-8
# NorMuon's epsilons (zichongli5/NorMuon d45c9a4, normuon.py): 1e-10 in the row scaling and in the
# Frobenius-norm restore.
NORMUON_EPS = 1e-10


def _matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))


def _shape_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """Moonlight's RMS-matching factor ``sqrt(max(m, n))`` of the matrix view of a (global) shape."""
    m, n = _matrix_shape(shape)
    return math.sqrt(max(m, n))


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
        #: Use the torch.compile-fused normalise+update kernels of ``fused.py`` where a rule has one.
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
    """``W <- (1 - lr*wd) W - lr * scale * D`` for every item (decoupled weight decay, unadjusted lr).

    Mixed dtypes compute in the wider one, as torch.optim.Muon's bf16 update into float32
    parameters. A narrower direction (bf16 Newton-Schulz output) is cast into a buffer kept in
    ``scratch`` per shape: ``p.add_(d)`` would cast it anyway, through a fresh parameter-sized
    temporary per call (TensorIterator promotes mixed-dtype inputs on CPU). Same bits.
    """
    lr, wd = group["lr"], group["weight_decay"]
    for it, d, s in zip(items, directions, scales, strict=True):
        p = it.param
        _decay_(p, lr, wd)
        d = d.reshape(p.shape)
        if scratch is not None and d.dtype != p.dtype and torch.promote_types(d.dtype, p.dtype) == p.dtype:
            d = _buffer(scratch, "direction", p.shape, p.dtype, p.device).copy_(d)
        p.add_(d, alpha=-lr * s)


def _decay_(param: Tensor, lr: float, wd: float) -> None:
    """Decoupled weight decay ``W <- (1 - lr wd) W`` in place, one tensor at a time as torch's
    single-tensor optimizers do: ``torch._foreach_mul_`` rounds the factor to the tensor's dtype,
    which for bf16 parameters turned 1 - 3e-3 into 0.9961 (30% more decay) and 1 - 1e-3 into 1."""
    if wd != 0:
        param.mul_(1.0 - lr * wd)


def _scaled_step(
    param: Tensor, u: Tensor, row: Tensor, col: Tensor, group: dict, scale: float, scratch: dict[tuple, Tensor]
) -> None:
    """``W <- (1 - lr wd) W - lr scale (u * row) * col`` in two passes over the matrix.

    Eager counterpart of ``fused.scaled_update``: ``u * row`` goes into a float32 buffer kept in
    ``scratch`` per shape, and the column factor is applied inside ``addcmul_``, instead of a cast,
    two scalings and an add over four parameter-sized temporaries. ``param`` is updated through its
    matrix view; a non-contiguous 3-D+ parameter has none (its matrix view would be a copy), so it
    is updated in its own shape from a whole direction tensor (same maths).
    """
    lr, wd = group["lr"], group["weight_decay"]
    _decay_(param, lr, wd)
    if param.ndim > 2 and not param.is_contiguous():
        param.add_(torch.mul(u, row).mul_(col).reshape(param.shape), alpha=-lr * scale)
        return
    W = param.view(u.shape)
    # Cast, then scale in place: ``torch.mul(u, row, out=...)`` with a bf16 ``u`` and a float32
    # ``row`` would make a float32 copy of ``u`` anyway (TensorIterator promotes mixed-dtype inputs
    # on CPU through a temporary), one fresh matrix per call. Same bits.
    row_scaled = _buffer(scratch, "row_scaled", u.shape, row.dtype, u.device).copy_(u).mul_(row)
    W.addcmul_(row_scaled, col, value=-lr * scale)


def _buffer(
    scratch: dict[tuple, Tensor], role: str, shape: torch.Size, dtype: torch.dtype = torch.float32, device=None
) -> Tensor:
    """A buffer for ``role`` kept in ``scratch`` and reused by same-shape matrices within a step."""
    key = (role, tuple(shape), dtype, device)
    if key not in scratch:
        scratch[key] = torch.empty(shape, dtype=dtype, device=device)
    return scratch[key]


def _state_dtype(p: Tensor, group: dict) -> torch.dtype:
    return group.get("state_dtype") or p.dtype


def _update_momentum(items: Sequence[Item], group: dict) -> None:
    """``B <- mu B + G`` in place, one pass per tensor (``torch.add(G, B, alpha=mu, out=B)``)."""
    mu = group["momentum"]
    for it in items:
        b = local(it.state["momentum_buffer"])
        g = it.grad if it.grad.dtype == b.dtype else it.grad.to(b.dtype)
        torch.add(g, b, alpha=mu, out=b)


def _direction_input(it: Item, group: dict, rows: slice = slice(None), out: Tensor | None = None) -> Tensor:
    """Rows ``rows`` of the direction input of a momentum rule: ``G + mu B`` with Nesterov (into
    ``out`` if given, else a new tensor), else ``B`` itself. Made on demand, per parameter (or block
    of rows), so that no model-sized temporary exists at once and DDP ranks make only the inputs of
    what they own."""
    b = local(it.state["momentum_buffer"])[rows]
    if not group["nesterov"]:
        return b
    g = it.grad[rows]
    return torch.add(g if g.dtype == b.dtype else g.to(b.dtype), b, alpha=group["momentum"], out=out)


# --------------------------------------------------------------------------------------------
# Batched (foreach) step: shared pieces. Each rule's batched form sits beside its per-tensor form
# below; the per-tensor form stays the reference it is tested against (tests/test_foreach.py).
# --------------------------------------------------------------------------------------------


def _workspace(ctx: StepContext, key: tuple, shape: tuple[int, ...], dtype: torch.dtype, device,
               zero: bool = False) -> Tensor:
    """A tensor kept between steps in the optimizer's workspace (made on first use, zeroed if ``zero``)."""
    full = (key, tuple(shape), dtype, device)
    t = ctx.workspace.get(full)
    if t is None:
        t = ctx.workspace[full] = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    return t


def _grads_like(items: Sequence[Item], like: Sequence[Tensor]) -> list[Tensor]:
    return [it.grad if it.grad.dtype == b.dtype else it.grad.to(b.dtype) for it, b in zip(items, like, strict=True)]


def _foreach_momentum(items: Sequence[Item], mu: float) -> None:
    """``B <- mu B + G`` for every item in two ``torch._foreach_*`` kernels."""
    bufs = [local(it.state["momentum_buffer"]) for it in items]
    torch._foreach_mul_(bufs, mu)
    torch._foreach_add_(bufs, _grads_like(items, bufs))


def _stack_inputs(ctx: StepContext, name: str, bucket: Bucket, lo: int, hi: int, group: dict,
                  dtype: torch.dtype) -> Tensor:
    """The direction inputs of members ``lo..hi`` (``G + mu B``, or ``B``) stacked in the bucket's
    persistent workspace, cast to ``dtype`` (the Newton-Schulz dtype for hidden matrices) on the way."""
    items = bucket.items[lo:hi]
    out = _workspace(ctx, (name, "inputs", ctx.call, bucket.key, lo, hi), (hi - lo, *bucket.shape), dtype,
                        items[0].param.device)
    bufs = [local(it.state["momentum_buffer"]) for it in items]
    values = torch._foreach_add(_grads_like(items, bufs), bufs, alpha=group["momentum"]) if group["nesterov"] else bufs
    return bucket.stack_into(out, values, start=lo)


def _stack_tensors(ctx: StepContext, name: str, bucket: Bucket, tensors: Sequence[Tensor]) -> Tensor:
    """``tensors`` (one per member) stacked in the bucket's workspace, at least float32."""
    t0 = tensors[0]
    out = _workspace(ctx, (name, "inputs", ctx.call, bucket.key), (len(tensors), *bucket.shape),
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
    """Apply several calls' updates together: one decay kernel per distinct ``1 - lr wd``
    (:func:`_foreach_decay_`), then one ``_foreach_add_`` per distinct ``lr s``. All decays come
    before all adds; each parameter is in one call, so its bits are those of ``decay, add``."""
    decays: dict[float, list[Tensor]] = {}
    adds: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for u in pending:
        if u.weight_decay != 0:
            decays.setdefault(1.0 - u.lr * u.weight_decay, []).extend(u.params)
        for p, d, s in zip(u.params, u.directions, u.scales, strict=True):
            ps, ds = adds.setdefault(-u.lr * s, ([], []))
            ps.append(p)
            ds.append(d)
    for factor, params in decays.items():
        _foreach_decay_(params, factor)
    for alpha, (ps, ds) in adds.items():
        torch._foreach_add_(ps, ds, alpha=alpha)


def _foreach_update(params: list[Tensor], directions: list[Tensor], scales: list[float], group: dict) -> None:
    """``W <- (1 - lr wd) W - lr s D`` for every parameter of one call (:func:`_foreach_apply`)."""
    _foreach_apply([PendingUpdate(params, directions, scales, group["lr"], group["weight_decay"])])


def _foreach_decay_(params: list[Tensor], factor: float) -> None:
    """``W <- factor W`` (``factor = 1 - lr wd``) for every parameter in one kernel where that keeps
    the bits of :func:`_decay_`: ``torch._foreach_mul_`` rounds the factor to a narrower dtype (bf16)."""
    if all(p.dtype in (torch.float32, torch.float64) for p in params):
        torch._foreach_mul_(params, factor)
    else:
        for p in params:
            p.mul_(factor)


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


# --------------------------------------------------------------------------------------------
# Momentum-based normalising rules (MeqMuon, Moonlight Muon, NorMuon)
# --------------------------------------------------------------------------------------------

#: Cost of an elementwise update, in matmul-FLOP equivalents per element, for balancing DDP owners
#: (``_MomentumRule.cost``). Measured on this package's CPU (2-core EPYC, 1 thread per rank): the
#: row-blocked equilibration of a 32000 x 512 matrix took about as long as 1000 FLOPs per element
#: of Newton-Schulz at the bf16 matmul rate. A balance heuristic only; results never depend on it.
ELEMENTWISE_COST = 1000.0


class _MomentumRule(Rule):
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
            p, dtype=_state_dtype(p, group), memory_format=torch.preserve_format
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
            ctx.emit(items, [_direction_input(it, group) for it in items], "momentum_input")
        if not self.split_work:
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
        ``compile=True`` one compiled graph per bucket (:meth:`_step_compiled`)."""
        if not ctx.compile:
            step_foreach_calls([(self, items, group, ctx)])
            return
        self._step_compiled(items, group, ctx)

    def pending_foreach(self, items: Sequence[Item], group: dict, ctx: StepContext) -> PendingUpdate:
        """The batched update of ``items`` (momentum already updated): per shape bucket the
        directions of this rank's slice of the bucket (:meth:`directions_foreach`), gathered across
        DDP ranks with one collective per bucket, and the owner state stored (:meth:`store_foreach`)."""
        if ctx.capture is not None:
            ctx.emit(items, [_direction_input(it, group) for it in items], "momentum_input")
        buckets = make_buckets(items, matrix=self.needs_matrix, transpose=self.transposes and not ctx.split.sharded)
        # DDP splits buckets into per-rank slices; FSDP2 ranks each update their row shards of all
        # members (its Newton-Schulz moves whole matrices to owners inside orthogonalize_stack).
        split = self.split_work and not ctx.split.sharded
        plans = [ctx.split.bucket_plan(len(b), self.cost(b.global_shape, group)) if split else [len(b)]
                 for b in buckets]
        ranges = [_slice(plan, ctx.split.rank if split else 0) for plan in plans]
        busy = [i for i, (lo, hi) in enumerate(ranges) if hi > lo]
        results = dict(zip(busy, self.directions_foreach([buckets[i] for i in busy], [ranges[i] for i in busy],
                                                         group, ctx), strict=True))
        params: list[Tensor] = []
        directions: list[Tensor] = []
        scales: list[float] = []
        extras: list[list[Tensor]] = []
        for i, (bucket, plan) in enumerate(zip(buckets, plans, strict=True)):
            D, owned = results[i] if i in results else self.empty_directions(bucket)
            if split:
                D, *owned = ctx.split.gather([D, *owned], plan)
            extras.append(owned)
            params += [it.param for it in bucket.items]
            directions += bucket.unstack(D)
            scales += [self.scale_foreach(bucket, group)] * len(bucket)
        if self.owner_state:
            self.store_foreach(buckets, extras)
        return PendingUpdate(params, directions, scales, group["lr"], group["weight_decay"])

    def _step_compiled(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        """``compile=True``: each bucket's whole step, momentum to update, as one compiled graph
        (``fused.bucket_step``); one process only, since a gather cannot sit inside the graph."""
        if self.name not in fused.BUCKET_FUNCTIONS:
            raise NotImplementedError(f"compile=True with foreach=True: rule {self.name!r} has no compiled form")
        if ctx.split.world_size > 1:
            raise NotImplementedError(
                "compile=True with foreach=True is one process only (DDP/FSDP2 gather between the directions and "
                "the update); use foreach=True without compile, or compile=True with foreach=False"
            )
        if ctx.capture is not None:
            raise NotImplementedError("the capture hook needs the eager step: build the optimizer without compile=True")
        scalars = [fused.scalar(group[k]) for k in ("lr", "weight_decay", "momentum", "rho")]
        for b in make_buckets(items, matrix=self.needs_matrix, transpose=self.transposes):
            tensors = [[it.param.detach() for it in b.items], [it.grad for it in b.items],
                       [local(it.state["momentum_buffer"]) for it in b.items]]
            static: dict[str, Any] = {"nesterov": group["nesterov"]}
            if self.name == "meq_hidden":
                tensors.append([it.state["rows_chosen"] for it in b.items])
                static.update(plain=b.plain, steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                              ns_dtype=ns_dtype_of(group, b.items[0].param))
            fused.bucket_step(self.name, b.key, *tensors, *scalars, **static)

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
    make one), then each call computes its directions (:meth:`_MomentumRule.pending_foreach`), and
    all updates are applied together: one decay kernel per distinct ``1 - lr wd`` and one add per
    distinct ``lr * scale``. Directions depend on gradients and momentum only, so computing them all
    before any parameter changes gives the bits of stepping the calls one by one. Other rules
    (Adam-type, SCALE) and ``compile=True`` (one graph per bucket, momentum inside) step alone.
    """
    shared = []
    for rule, items, group, ctx in calls:
        if isinstance(rule, _MomentumRule) and not ctx.compile:
            shared.append((rule, items, group, ctx))
        else:
            rule.step_foreach(items, group, ctx)
    by_mu: dict[float, list[Item]] = {}
    for _rule, items, group, _ctx in shared:
        by_mu.setdefault(group["momentum"], []).extend(items)
    for mu, items in by_mu.items():
        _foreach_momentum(items, mu)
    _foreach_apply([rule.pending_foreach(items, group, ctx) for rule, items, group, ctx in shared])


class _HiddenRule(_MomentumRule):
    """A rule that orthogonalises (Newton-Schulz, paper eq. 3) each hidden matrix's direction input."""

    needs_matrix = True

    def cost(self, shape, group):
        return ns_flops(*_matrix_shape(shape), group["ns_steps"]) + super().cost(shape, group)

    def orthogonalized(self, items: Sequence[Item], group: dict, ctx: StepContext) -> Iterator[tuple[int, Tensor]]:
        """``(i, Orth(X_i))`` for every item, one at a time; ``X_i`` is made just before its NS."""
        shapes = [_matrix_shape(it.shape) for it in items]
        if ctx.split.sharded:  # ShardedSplit gathers all inputs before its all-to-all: no sharing
            return ctx.split.orthogonalize(
                lambda i: self.pre_ns(F.as_matrix(_direction_input(items[i], group)), [items[i]], group, ctx),
                shapes, group,
            )
        # Otherwise each input is consumed (copied into the NS buffer) before the next is made, so
        # same-shape inputs can share one buffer: fresh temporaries are page faults on CPU.
        scratch: dict[tuple, Tensor] = {}

        def input_of(i: int) -> Tensor:
            b = local(items[i].state["momentum_buffer"])
            x = _direction_input(items[i], group, out=_buffer(scratch, "nesterov", b.shape, b.dtype, b.device))
            return self.pre_ns(F.as_matrix(x), [items[i]], group, ctx)

        return ctx.split.orthogonalize(input_of, shapes, group)

    def pre_ns(self, x: Tensor, items: Sequence[Item], group: dict, ctx: StepContext) -> Tensor:
        """A transform of the Newton-Schulz input (a matrix, or a stack of ``items``' inputs); here
        none. Must not write into ``x`` (without Nesterov it is the momentum buffer itself)."""
        return x

    def orthogonalized_stacks(self, buckets: list[Bucket], ranges: list[tuple[int, int]], group: dict,
                              ctx: StepContext) -> list[Tensor]:
        """Batched form of :meth:`orthogonalized`: per bucket, ``Orth`` of the stacked inputs of
        members ``lo..hi``, one batched Newton-Schulz call each (the inputs are made in the NS dtype,
        or first in float32 where :meth:`pre_ns` transforms them)."""
        out = []
        for b, (lo, hi) in zip(buckets, ranges, strict=True):
            p = b.items[0].param
            dtype = ns_dtype_of(group, p)
            if type(self).pre_ns is _HiddenRule.pre_ns:
                X = _stack_inputs(ctx, self.name, b, lo, hi, group, dtype)
            else:
                X = self.pre_ns(_stack_inputs(ctx, self.name, b, lo, hi, group, F._stat_dtype(p)), b.items[lo:hi],
                                group, ctx).to(dtype)
            out.append(ctx.split.orthogonalize_stack(X, group, b.global_shape))
        return out


class MeqHidden(_HiddenRule):
    """MeqMuon for hidden matrices (paper Algorithm 1, eq. 8): ``U = Orth(B)``, then row- or
    column-normalise ``U``, whichever side has the larger CV (ties: rows). Scale ``rho``.

    Keeps a 0-D int64 counter ``rows_chosen`` per parameter on its device (no sync)."""

    name = "meq_hidden"
    hyperparameters = ("momentum", "nesterov", "rho", "ns_steps", "ns_coefficients", "ns_dtype")
    owner_state = ("rows_chosen",)
    state_views = {**_MomentumRule.state_views, "rows_chosen": "counter"}

    def init_state(self, p, state, group, layout):
        super().init_state(p, state, group, layout)
        # One count per matrix. For one whole matrix a plain tensor even under FSDP2 (every rank
        # makes the same choice for it); stacked matrices are sharded with the parameter's dim 0.
        state["rows_chosen"] = state_like(p, layout.counter_shape, torch.int64) if layout.batch else torch.zeros(
            layout.counter_shape, dtype=torch.int64, device=p.device)

    def update(self, items, group, ctx):
        scratch: dict[tuple, Tensor] = {}
        for i, u in self.orthogonalized(items, group, ctx):
            it = items[i]
            if ctx.compile and ctx.split.psum is None:  # whole matrix: statistics and step in one graph
                chose_rows = fused.adaptive_update(it.param, u, group, group["rho"])
            else:  # statistics eager (under FSDP2 they need cross-shard sums), then the scaled step
                squares = _buffer(scratch, "squares", u.shape, F._stat_dtype(u), u.device)
                row, col, chose_rows = F.adaptive_scales(
                    u, psum=ctx.split.psum, rows=_matrix_shape(it.shape)[0], scratch=squares
                )
                if ctx.compile:  # scaling, decay and step in one compiled kernel
                    fused.scaled_update(it.param, u, row, col, group, group["rho"])
                else:
                    _scaled_step(it.param, u, row, col, group, group["rho"], scratch)
            it.state["rows_chosen"].add_(chose_rows)

    transposes = True

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Per bucket ``U = Orth(X)`` in one batched call, then the row/column choice (eq. 8) of every
        matrix of every bucket from one statistics pass (:func:`_meq_scales`), and ``U~ = U * row * col``."""
        us = self.orthogonalized_stacks(buckets, ranges, group, ctx)
        rho = group["rho"]
        if ctx.split.psum is not None:  # row shards (FSDP2): the statistics need sums over shards
            out = []
            for b, U in zip(buckets, us, strict=True):
                row, col, chose = F.adaptive_scales(U, psum=ctx.split.psum, rows=b.global_shape[0])
                out.append((F.scale_matrix(U, row, col).mul_(rho), [chose.to(torch.int64)]))
            return out
        chose, scales = _meq_scales(ctx, buckets, ranges, us, rho)
        out, o = [], 0
        for b, (lo, hi), U in zip(buckets, ranges, us, strict=True):
            k, m, n = hi - lo, *b.shape
            S = scales[o : o + k]
            D = torch.mul(U, S[:, 0, :m, None], out=torch.empty(U.shape, dtype=F._stat_dtype(U), device=U.device))
            out.append((D.mul_(S[:, 1, None, :n]), [chose[o : o + k]]))
            o += k
        return out

    def scale_foreach(self, bucket, group):
        return 1.0  # rho is folded into the factors

    def owner_stacks(self, bucket):
        return [torch.zeros(1, dtype=torch.int64, device=bucket.items[0].param.device)]

    def store_foreach(self, buckets, extras):
        counters = [it.state["rows_chosen"] for b in buckets for it in b.items]
        torch._foreach_add_(counters, [c for (chose,) in extras for c in chose.unbind(0)])


def _meq_scales(ctx: StepContext, buckets: list[Bucket], ranges: list[tuple[int, int]], us: list[Tensor],
                rho: float) -> tuple[Tensor, Tensor]:
    """MeqMuon's choice and factors (paper eq. 4-5, 8) for every matrix of every bucket at once.

    The row and column norms of all ``K`` matrices go into one zero-padded ``(K, 2, L)`` buffer in
    the bucket's orientation: slot 0 the norms of the stack's rows, slot 1 of its columns, two
    reductions per bucket. :func:`functional.cv_of_norms` then gives all ``2K`` CVs in one call
    (padding counts as zero and is excluded, as zero rows are). The choice is made on each member's
    *original* rows: a constant index swaps the two CVs of transposed members (one ``gather``), so
    eq. 8's tie rule (rows) holds for them too. The inverse RMS factors and the choice are a few more
    whole-buffer kernels: the statistics cost a fixed number of kernels per step, not ~30 per
    matrix. ``rho`` is folded into the factors.

    Returns:
        ``chose`` ``(K,)`` int64 (1 where the original rows were normalised) and ``scales``
        ``(K, 2, L)`` in the bucket's orientation: slot 0 the factors of the stack's rows, slot 1 of
        its columns, 1 on the side not chosen.
    """
    dtype, device = F._stat_dtype(us[0]), us[0].device
    layout = tuple((b.key, lo, hi) for b, (lo, hi) in zip(buckets, ranges, strict=True))
    K, L = sum(hi - lo for lo, hi in ranges), max(max(b.shape) for b in buckets)
    norms = _workspace(ctx, ("meq_norms", layout), (K, 2, L), dtype, device, zero=True)
    # Filled once per layout, and again only when rho changes: rho * sqrt(length) of each slot's
    # vectors (RMS = norm / sqrt(length)), the zero thresholds, which slot holds the original rows
    # (1 there) and the CV order that puts the original rows first.
    factor, threshold, side = _workspace(ctx, ("meq_consts", layout), (3, K, 2, 1), dtype, device)
    order = _workspace(ctx, ("meq_order", layout), (K, 2), torch.int64, device)
    if ctx.workspace.get(("meq_rho", layout)) != rho:
        ctx.workspace[("meq_rho", layout)] = rho
        o = 0
        for b, (lo, hi) in zip(buckets, ranges, strict=True):
            k, m, n = hi - lo, *b.shape
            p = max(0, min(b.plain - lo, k))  # members stored as they are; the rest are transposed
            factor[o : o + k, 0], factor[o : o + k, 1] = math.sqrt(n), math.sqrt(m)  # a stack row has n entries
            side[o : o + p, 0], side[o : o + p, 1] = 1.0, 0.0
            side[o + p : o + k, 0], side[o + p : o + k, 1] = 0.0, 1.0
            order[o : o + p, 0], order[o : o + p, 1] = 0, 1
            order[o + p : o + k, 0], order[o + p : o + k, 1] = 1, 0
            o += k
        torch.mul(factor, F.DELTA, out=threshold)  # RMS <= delta counts as zero (eq. 5)
        factor.mul_(rho)
    o = 0
    for b, (lo, hi), U in zip(buckets, ranges, us, strict=True):
        k, m, n = hi - lo, *b.shape
        torch.linalg.vector_norm(U, dim=-1, dtype=dtype, out=norms[o : o + k, 0, :m])
        torch.linalg.vector_norm(U, dim=-2, dtype=dtype, out=norms[o : o + k, 1, :n])
        o += k
    gamma = F.cv_of_norms(norms, threshold).gather(1, order)  # (K, 2): CVs of the original rows, columns
    chose = torch.ge(gamma[:, 0], gamma[:, 1], out=torch.empty(K, dtype=torch.int64, device=device))  # eq. 8
    # rho / RMS, 0 for zero rows/columns; masked_fill takes its value without a scalar tensor kernel.
    scales = torch.div(factor, norms).masked_fill_(norms <= threshold, 0.0)
    scales.masked_fill_(chose[:, None, None] != side, 1.0)  # 1 on the side not chosen
    return chose, scales


class MoonlightHidden(_HiddenRule):
    """Muon in Moonlight's form (paper eq. 2; MoonshotAI/Moonlight c2ad5b2 examples/toy_train.py):
    ``W <- (1 - lr wd) W - lr * rho * sqrt(max(m, n)) * Orth(B)``."""

    name = "moonlight_hidden"
    hyperparameters = ("momentum", "nesterov", "rho", "ns_steps", "ns_coefficients", "ns_dtype")

    def update(self, items, group, ctx):
        scratch: dict[tuple, Tensor] = {}
        for i, u in self.orthogonalized(items, group, ctx):
            apply_update([items[i]], [u], [group["rho"] * _shape_scale(items[i].shape)], group, scratch)

    transposes = True

    def directions_foreach(self, buckets, ranges, group, ctx):
        us = self.orthogonalized_stacks(buckets, ranges, group, ctx)
        out = []
        for b, U in zip(buckets, us, strict=True):
            dtype = b.items[0].param.dtype  # cast once per bucket, so the update keeps to foreach's fast path
            out.append((U if U.dtype == dtype else U.to(dtype), []))
        return out

    def scale_foreach(self, bucket, group):
        return group["rho"] * _shape_scale(bucket.global_shape)


class MuonEqHidden(MoonlightHidden):
    """MuonEq for hidden matrices (arXiv 2603.28254; MaeChd/muon-eq 99b6c8b ``muoneq.py``): Moonlight's
    Muon with the direction input equilibrated before Newton-Schulz,
    ``O = Orth(E(G + mu B))`` with ``E`` = :func:`functional.muoneq_equilibrate` in mode ``eq_mode``;
    in mode RC with ``eq_phase = P``, steps ``P, P+1, ...`` use R (upstream's phase switch: RC for
    the first ``P - 1`` steps). Everything else is :class:`MoonlightHidden`, so the only difference
    from ``muon`` is ``E``. Buckets never transpose: R on a transposed member would be C."""

    name = "muoneq_hidden"
    hyperparameters = MoonlightHidden.hyperparameters + ("eq_mode", "eq_phase")
    transposes = False

    @staticmethod
    def mode_at(group: dict, step: int) -> str:
        mode, phase = group["eq_mode"], group["eq_phase"]
        return "R" if mode == "RC" and phase is not None and step >= phase else mode

    def pre_ns(self, x, items, group, ctx):
        modes = {self.mode_at(group, it.state["step"]) for it in items}
        if len(modes) == 1:
            return F.muoneq_equilibrate(x, modes.pop(), ctx.split.psum)
        # Members past and before the phase switch in one stack (parameters that skipped steps):
        # R, or R and C, per member from the same input.
        rows = F.muoneq_equilibrate(x, "R", ctx.split.psum)
        both = F.muoneq_equilibrate(x, "RC", ctx.split.psum)
        use_rows = [self.mode_at(group, it.state["step"]) == "R" for it in items]
        return torch.stack([r if u else b for r, b, u in zip(rows, both, use_rows, strict=True)])


class NorMuonHidden(_HiddenRule):
    """NorMuon for hidden matrices (zichongli5/NorMuon d45c9a4 ``normuon_update``; Li et al. 2025).

    ``O = Orth(B)``; per-row second moment ``v <- lerp(v, mean_j O_ij^2, 1 - beta2)`` (no bias
    correction, as upstream; it would be a global scalar that the restore below cancels);
    ``O' = O / (sqrt(v) + 1e-10)``; ``O' <- O' * ||O||_F / (||O'||_F + 1e-10)``; scale
    ``rho * sqrt(max(m, n))`` (dion's "rms_norm" adjust_lr, so NorMuon shares Muon's lr grid;
    upstream's single file uses ``sqrt(max(1, m/n))`` with a 10-20x larger lr instead).

    Deliberate deviation: ``v`` and the normalisation are at least float32 whatever the parameter dtype,
    avoiding the upstream bf16/fp32 ``lerp`` dtype failure (zichongli5/NorMuon issue 7, PR 10).
    """

    name = "normuon_hidden"
    hyperparameters = ("momentum", "nesterov", "rho", "beta2", "ns_steps", "ns_coefficients", "ns_dtype")
    owner_state = ("second_moment",)
    state_views = {**_MomentumRule.state_views, "second_moment": "rows"}

    def state_elements(self, layout):
        return super().state_elements(layout) + math.prod(layout.rows_shape)

    def init_state(self, p, state, group, layout):
        super().init_state(p, state, group, layout)
        state["second_moment"] = state_like(p, layout.rows_shape, torch.promote_types(p.dtype, torch.float32))

    def update(self, items, group, ctx):
        beta2 = group["beta2"]
        psum = ctx.split.psum
        scratch: dict[tuple, Tensor] = {}  # reused by same-shape matrices: no fresh temporaries
        for i, O in self.orthogonalized(items, group, ctx):
            it = items[i]
            dtype = torch.promote_types(O.dtype, torch.float32)
            if O.dtype != dtype:
                O = _buffer(scratch, "O", O.shape, dtype, O.device).copy_(O)
            work = _buffer(scratch, "work", O.shape, dtype, O.device)
            # Rows are whole on every shard, so the per-row second moment is local under FSDP2.
            state_v = local(it.state["second_moment"])
            v = state_v.to(O.dtype)
            v.lerp_(torch.mul(O, O, out=work).mean(dim=-1), 1.0 - beta2)
            scaled = torch.div(O, v.sqrt().unsqueeze(-1) + NORMUON_EPS, out=work)
            if psum is None:
                fro_o = torch.linalg.vector_norm(O)
                fro_s = torch.linalg.vector_norm(scaled)
            else:  # Frobenius norms of the whole matrix: sum the shards' sums of squares
                sq = psum(torch.stack([O.square().sum(), scaled.square().sum()]))
                fro_o, fro_s = sq[0].sqrt(), sq[1].sqrt()
            scaled.mul_(fro_o / (fro_s + NORMUON_EPS))
            state_v.copy_(v)
            apply_update([it], [scaled], [group["rho"] * _shape_scale(it.shape)], group)

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Per bucket: one batched NS, then the per-row second moments of all members as one
        ``(k, m)`` stack (rows are original rows: NorMuon buckets never transpose)."""
        beta2, psum = group["beta2"], ctx.split.psum
        out = []
        for b, (lo, hi), O in zip(buckets, ranges, self.orthogonalized_stacks(buckets, ranges, group, ctx),
                                  strict=True):
            O = O.to(torch.promote_types(O.dtype, torch.float32))
            v = torch.stack([local(it.state["second_moment"]) for it in b.items[lo:hi]]).to(O.dtype)
            v.lerp_(O.square().mean(dim=-1), 1.0 - beta2)
            scaled = O / (v.sqrt().unsqueeze(-1) + NORMUON_EPS)
            if psum is None:
                fro_o = torch.linalg.vector_norm(O, dim=(-2, -1))
                fro_s = torch.linalg.vector_norm(scaled, dim=(-2, -1))
            else:  # Frobenius norms of the whole matrices: sum the shards' sums of squares
                sq = psum(torch.stack([O.square().sum(dim=(-2, -1)), scaled.square().sum(dim=(-2, -1))]))
                fro_o, fro_s = sq[0].sqrt(), sq[1].sqrt()
            scaled.mul_((fro_o / (fro_s + NORMUON_EPS))[:, None, None])
            out.append((scaled, [v]))
        return out

    def scale_foreach(self, bucket, group):
        return group["rho"] * _shape_scale(bucket.global_shape)

    def owner_stacks(self, bucket):
        return [local(bucket.items[0].state["second_moment"])[None]]

    def store_foreach(self, buckets, extras):
        states = [local(it.state["second_moment"]) for b in buckets for it in b.items]
        torch._foreach_copy_(states, [row for (v,) in extras for row in v.unbind(0)])


class Equilibrate(_MomentumRule):
    """MeqMuon for embeddings and LM heads (paper eq. 9): ``N_c(N_r(B))``, scale ``rho``.

    Row-blocked (``blockwise.equilibrate_step_``), so the 32000 x d direction is never
    materialised. ``compile=True`` changes nothing here: the two blocked passes already run at
    memory bandwidth. The compiled whole-matrix kernel used before could not take FSDP2's
    cross-shard sums and gained the step nothing beyond noise (docs/benchmarks.md)."""

    name = "equilibrate"
    needs_matrix = True
    hyperparameters = ("momentum", "nesterov", "rho")

    def update(self, items, group, ctx):
        for it in items:
            blockwise.equilibrate_step_(
                it.param,
                lambda rows, it=it: _direction_input(it, group, rows),
                group["lr"],
                group["weight_decay"],
                group["rho"],
                psum=ctx.split.psum,
                rows=_matrix_shape(it.shape)[0],
            )

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Whole-matrix form (the row blocks are a CPU cache device): with ``Y = X / ||X_i,:||``,
        ``N_c(N_r(X)) = sqrt(m) Y / ||Y_:,j||``, so only norms and two scalings touch the stack;
        ``r_i <= delta`` is ``||X_i,:|| <= delta sqrt(n)``, ``c_j <= delta`` is
        ``||Y_:,j|| <= delta sqrt(m / n)``."""
        out = []
        for b, (lo, hi) in zip(buckets, ranges, strict=True):
            p = b.items[0].param
            X = _stack_inputs(ctx, self.name, b, lo, hi, group, F._stat_dtype(p))
            m, n = b.global_shape
            X.div_(_zero_below(torch.linalg.vector_norm(X, dim=-1), F.DELTA * math.sqrt(n)).unsqueeze(-1))
            if ctx.split.psum is None:
                col = torch.linalg.vector_norm(X, dim=-2)
            else:  # column sums of squares over all row shards
                col = ctx.split.psum(X.square().sum(dim=-2)).sqrt_()
            # The step scale rho * sqrt(m) rides on the column divisor, so every MeqMuon rule steps
            # with scale 1 and their updates share one add (step_foreach_calls).
            col = _zero_below(col, F.DELTA * math.sqrt(m / n)).div_(group["rho"] * math.sqrt(m))
            X.div_(col.unsqueeze(-2))
            out.append((X, []))
        return out

    def scale_foreach(self, bucket, group):
        return 1.0  # rho * sqrt(m) is folded into the column divisor


def _zero_below(norms: Tensor, threshold: float) -> Tensor:
    """``norms`` as divisors that zero what they divide where ``norms <= threshold`` (x / inf = 0)."""
    return norms.masked_fill(norms <= threshold, math.inf)


class RmsNormalize(_MomentumRule):
    """MeqMuon for 1-D parameters (paper eq. 10): ``B / (||B||_2 / sqrt(d))``, scale ``rho``.

    Not split over DDP ranks: 1-D parameters are small, so repeating the update on every rank is
    cheaper than one broadcast per tensor."""

    name = "rms_normalize"
    hyperparameters = ("momentum", "nesterov", "rho")
    split_work = False

    def update(self, items, group, ctx):
        psum = ctx.split.psum
        for it in items:
            direction = F.rms_normalize(_direction_input(it, group), psum=psum, numel=math.prod(it.shape))
            apply_update([it], [direction], [group["rho"]], group)

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Same-shape vectors as one ``(k, d)`` stack: ``B / ||B||_2 * sqrt(d)`` row by row."""
        out = []
        for b, (lo, hi) in zip(buckets, ranges, strict=True):
            X = _stack_inputs(ctx, self.name, b, lo, hi, group, F._stat_dtype(b.items[0].param))
            flat = X.view(hi - lo, -1)
            d = math.prod(b.global_shape)
            if ctx.split.psum is None:
                norm = torch.linalg.vector_norm(flat, dim=-1)
            else:
                norm = ctx.split.psum(flat.square().sum(dim=-1)).sqrt_()
            # The step scale rho * sqrt(d) rides on the divisor (scale 1, as the other MeqMuon rules).
            flat.div_(_zero_below(norm, F.DELTA * math.sqrt(d)).div_(group["rho"] * math.sqrt(d)).unsqueeze(-1))
            out.append((X, []))
        return out

    def scale_foreach(self, bucket, group):
        return 1.0  # rho * sqrt(d) is folded into the divisor


# --------------------------------------------------------------------------------------------
# Adam-type rules
# --------------------------------------------------------------------------------------------


class AdamW(Rule):
    """AdamW exactly as ``torch.optim.AdamW`` (paper eq. 1-2): eps added after bias correction.

    Used for embedding/head/vector kinds by Muon, NorMuon and MuonEq. Moonlight's toy_train.py and
    MaeChd/muon-eq add eps to the uncorrected ``sqrt(v)``: an effective eps ``1/sqrt(1 - beta2^t)``
    times ours (4.47x at step 1 with beta2 0.95, within 3 % from step 56; docs/algorithm.md,
    "Baselines"). Torch's form is what the paper states (eq. 1) and lets us test parity with
    ``torch.optim.AdamW`` exactly.
    """

    name = "adamw"
    hyperparameters = ("betas", "eps")
    #: Moonlight/SCALE form: eps added to the uncorrected sqrt(v).
    eps_before_correction: ClassVar[bool] = False

    def state_elements(self, layout):
        return 2 * math.prod(layout.batch) * layout.rows * layout.cols

    def init_state(self, p, state, group, layout):
        dtype = _state_dtype(p, group)
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def step(self, items, group, ctx):
        """In place, in ``torch.optim.AdamW``'s single-tensor order (its CPU default):
        ``W *= 1 - lr wd``; ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 v + (1 - beta2) g^2``;
        ``W -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` as one ``addcdiv_``. The denominator goes
        into one buffer per shape, reused across the group's parameters: the old form made four
        parameter-sized temporaries per tensor, which made our Muon slower than torch's
        (docs/benchmarks.md)."""
        ctx.emit(items, [it.grad for it in items], "gradient")
        beta1, beta2 = group["betas"]
        eps, lr, wd = group["eps"], group["lr"], group["weight_decay"]
        denominators: dict[tuple, Tensor] = {}
        for it in items:
            st = it.state
            t = st["step"]
            _decay_(it.param, lr, wd)
            m, v = local(st["exp_avg"]), local(st["exp_avg_sq"])
            g = it.grad.to(m.dtype)
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            bc1 = 1.0 - beta1**t
            bc2 = 1.0 - beta2**t
            denom = torch.sqrt(v, out=_buffer(denominators, "denominator", v.shape, v.dtype, v.device))
            if self.eps_before_correction:
                step_size = lr * math.sqrt(bc2) / bc1
            else:
                denom.div_(math.sqrt(bc2))
                step_size = lr / bc1
            it.param.addcdiv_(m, denom.add_(eps), value=-step_size)

    def step_foreach(self, items, group, ctx):
        """The same update as :meth:`step` in ``torch._foreach_*`` kernels, as ``torch.optim.AdamW``'s
        multi-tensor form: a fixed number of kernels per dtype and device, whatever the count."""
        ctx.emit(items, [it.grad for it in items], "gradient")
        beta1, beta2 = group["betas"]
        eps, lr = group["eps"], group["lr"]
        for b in make_buckets(items, matrix=False, transpose=False, by_shape=False):
            params = [it.param for it in b.items]
            ms = [local(it.state["exp_avg"]) for it in b.items]
            vs = [local(it.state["exp_avg_sq"]) for it in b.items]
            grads = _grads_like(b.items, ms)
            if group["weight_decay"] != 0:
                _foreach_decay_(params, 1.0 - lr * group["weight_decay"])
            torch._foreach_lerp_(ms, grads, 1.0 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
            steps = [it.state["step"] for it in b.items]
            bc1 = [1.0 - beta1**t for t in steps]
            bc2 = [1.0 - beta2**t for t in steps]
            denom = torch._foreach_sqrt(vs)
            if self.eps_before_correction:
                step_sizes = [-lr * math.sqrt(c2) / c1 for c1, c2 in zip(bc1, bc2, strict=True)]
            else:
                torch._foreach_div_(denom, [math.sqrt(c2) for c2 in bc2])
                step_sizes = [-lr / c1 for c1 in bc1]
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, ms, denom, step_sizes)


class AdamScale(AdamW):
    """SCALE's internal Adam for 1-D parameters (OptimAI-Lab/Minimalist_LLM_Pretraining f5bd4e7):
    bias-corrected Adam with eps added to the uncorrected ``sqrt(v)``, decoupled weight decay."""

    name = "adam_scale"
    eps_before_correction = True


# --------------------------------------------------------------------------------------------
# SCALE (Glentis et al.; official code OptimAI-Lab/Minimalist_LLM_Pretraining f5bd4e7)
# --------------------------------------------------------------------------------------------


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _row_rms_divisor(x: Tensor) -> Tensor:
    """SCALE's row divisor ``max(RMS of each row, 1e-8)`` of a matrix or a stack of matrices."""
    # Row statistics are local to a row shard: no sums over shards are needed.
    return x.square().mean(dim=-1, keepdim=True).sqrt_().clamp_(min=SCALE_EPS)


def _col_rms_divisor(x: Tensor, psum: F.PSum = None, rows: int | None = None) -> Tensor:
    """SCALE's column divisor ``max(RMS of each column, 1e-8)``; with ``psum`` over all row shards."""
    if psum is None:
        ms = x.square().mean(dim=-2, keepdim=True)
    else:  # column sums of squares over all row shards
        ms = psum(x.square().sum(dim=-2, keepdim=True)) / rows
    return ms.sqrt_().clamp_(min=SCALE_EPS)


def _scale_row(x: Tensor, psum: F.PSum = None, rows: int | None = None) -> Tensor:
    x = _at_least_fp32(F.as_matrix(x))
    return x / _row_rms_divisor(x)


def _scale_col(x: Tensor, psum: F.PSum = None, rows: int | None = None) -> Tensor:
    x = _at_least_fp32(F.as_matrix(x))
    return x / _col_rms_divisor(x, psum, rows)


class _ScaleRaw(Rule):
    """SCALE without momentum: normalise the raw gradient slice-wise; no state."""

    normalise: ClassVar[Callable[[Tensor], Tensor]]
    needs_matrix = True

    def state_elements(self, layout):
        return 0

    def init_state(self, p, state, group, layout):
        state["step"] = 0

    def step(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        psum = ctx.split.psum
        directions = [type(self).normalise(it.grad, psum, _matrix_shape(it.shape)[0]) for it in items]
        apply_update(items, directions, [1.0] * len(items), group)

    #: The batched form's divisor of a gradient stack ``(k, m, n)`` (psum, global rows).
    divisor: ClassVar[Callable[..., Tensor]]

    def step_foreach(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        params, directions = [], []
        for b in make_buckets(items, matrix=True, transpose=False):
            G = _stack_tensors(ctx, self.name, b, [it.grad for it in b.items])
            G.div_(type(self).divisor(G, ctx.split.psum, b.global_shape[0]))
            params += [it.param for it in b.items]
            directions += b.unstack(G)
        _foreach_update(params, directions, [1.0] * len(params), group)


class ScaleRow(_ScaleRaw):
    """SCALE for hidden matrices: raw gradient, each row (output neuron) to unit RMS over inputs."""

    name = "scale_row"
    normalise = staticmethod(_scale_row)
    divisor = staticmethod(lambda x, psum=None, rows=None: _row_rms_divisor(x))


class ScaleCol(_ScaleRaw):
    """SCALE for the input embedding ``(vocab, d)``: each column (hidden coordinate) to unit RMS over the vocabulary."""

    name = "scale_col"
    normalise = staticmethod(_scale_col)
    divisor = staticmethod(_col_rms_divisor)


class ScaleHead(Rule):
    """SCALE for the LM head: EMA momentum ``m <- lerp(m, g, 1 - beta)`` (no Nesterov, no bias
    correction), then each vocabulary row to unit RMS."""

    name = "scale_head"
    needs_matrix = True
    hyperparameters = ("momentum",)

    state_views = {"momentum_buffer": "param"}

    def state_elements(self, layout):
        return math.prod(layout.batch) * layout.rows * layout.cols

    def init_state(self, p, state, group, layout):
        state["step"] = 0
        state["momentum_buffer"] = torch.zeros_like(
            p, dtype=_state_dtype(p, group), memory_format=torch.preserve_format
        )

    def step(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        directions = []
        for it in items:
            m = local(it.state["momentum_buffer"])
            m.lerp_(it.grad.to(m.dtype), 1.0 - group["momentum"])
            directions.append(_scale_row(m))
        apply_update(items, directions, [1.0] * len(items), group)

    def step_foreach(self, items, group, ctx):
        ctx.emit(items, [it.grad for it in items], "gradient")
        ms = [local(it.state["momentum_buffer"]) for it in items]
        torch._foreach_lerp_(ms, _grads_like(items, ms), 1.0 - group["momentum"])
        params, directions = [], []
        for b in make_buckets(items, matrix=True, transpose=False):
            M = _stack_tensors(ctx, self.name, b, [local(it.state["momentum_buffer"]) for it in b.items])
            M.div_(_row_rms_divisor(M))
            params += [it.param for it in b.items]
            directions += b.unstack(M)
        _foreach_update(params, directions, [1.0] * len(params), group)


RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        MeqHidden(),
        MoonlightHidden(),
        MuonEqHidden(),
        NorMuonHidden(),
        Equilibrate(),
        RmsNormalize(),
        AdamW(),
        AdamScale(),
        ScaleRow(),
        ScaleCol(),
        ScaleHead(),
    )
}
