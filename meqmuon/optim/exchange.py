"""The one exchange (``placement.OWNERS``): direction inputs to owner ranks, whole matrices there, results back.

Every layout where a matrix's rule needs the whole matrix but this rank does not hold it alone, or holds it
as every other rank does and shares its Newton-Schulz with them, steps here, by one mechanism:

1. each *unit* -- a DTensor parameter (with ``exchange_unit="matrix"`` one matrix of its stack,
   ``placement.by_matrix``), or under DDP one matrix of a plain parameter's view -- has one owner, planned once
   (longest first by predicted cost onto the least-loaded rank, :func:`.distributed.assign_owners`, identical on
   every rank, no collective);
2. every rank makes the direction input ``X`` of its piece where it lies, from the unchanged momentum (as one
   process's, ``forms.Inputs``; the momentum is written with the step's other writes, ``commit.py``), and sends
   it to the owner, with the per-matrix state the rule reads where that is sharded: one ``all_to_all_single`` of
   bytes per shape bucket (:func:`exchange_flat`, nothing padded); under DDP the owner holds ``X`` whole and
   nothing goes out;
3. the owner puts the pieces together and runs the one body of a hidden rule on whole matrices
   (:func:`.driver.bucket_directions`: ``pre``, Newton-Schulz, ``post``), so every statistic is the whole
   matrix's, one process's bits (an elementwise momentum rule's ``direction``, a stepping rule's own step on
   whole tensors, where their statistics need more than sums over rows); with ``ns_group`` a block of ranks may
   share a unit's Newton-Schulz there (``shared_ns.py``: the owner's parts out and back over the block, exact to
   rounding);
4. a second exchange returns every rank its piece of the direction, in the fewest bytes that keep its bits
   (``transfer.py``: ``U`` in the Newton-Schulz dtype, or with eq. 8's factors, or ``D``), and the per-matrix
   state the rule changed; under DDP every other rank receives it whole; an owner's alike units travel part by
   part, so that a rank receives each part of a stretch of them as one stack (``assembly.py``);
5. each rank applies ``W <- (1 - lr wd) W - lr s D`` to its piece, as one process does (a rule with a step of
   its own, MuonH's, gets its weights' pieces at the owner and sends them back stepped).

Per rank that is the floor: each piece of ``X`` out once and its direction back once (DDP: each direction once
to every other rank), plus the per-matrix state. Where pieces lie is a descriptor (``owners.py``), read when the
step is planned; the same code serves every layout, per tensor, batched and compiled.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import commit, transfer
from .assembly import cut_out, put_together, received_back, runs
from .calls import Item, StepContext
from .distributed import InFlight, LocalSplit, exchange_flat
from .driver import (
    Bucket,
    Call,
    HiddenRule,
    apply_pending,
    bucket_directions,
    cast,
    cost,
    make_buckets,
    needs_matrix,
    resolve_dtype,
)
from .forms import Inputs, naming, step_weights, write_inputs
from .newton_schulz import batched_ns
from .owners import AXES, Replicas
from .relay import relayed_flat
from .shared_ns import Blocks, SharedNS, Shares, assign_within, unit_shapes
from .views import Layout

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]

__all__ = ["DEPTHS", "Exchange", "Unit", "exchange_flat", "step"]

#: The optimizer's ``overlap`` as the number of a hidden rule's shape buckets in flight at once (:func:`_pipelined`):
#: one (blocking), two, or every bucket (its inputs all posted first, so that each owner starts as soon as its own
#: arrive: the time model's fastest schedule, benchmarks/time_model.py).
DEPTHS = {False: 1, True: 2, "all": sys.maxsize}


class Unit:
    """One tensor the exchange steps: its descriptor (``owners.py``), the descriptors of its sharded state by key,
    and the layout its owner cuts it into matrices by (``None``: the unit is one matrix, or a tensor of an
    elementwise rule). :class:`Exchange` plans the rest: the rank that computes it for this one (``owner``),
    whether that is this rank (``mine``), the ranks it exchanges with as its owner (``group``: its replica group
    for a DTensor, every other rank under DDP), and, read off the descriptors once, where each of their pieces
    lies (``where``)."""

    __slots__ = ("pieces", "state_pieces", "layout", "assigned", "owner", "mine", "group", "replicas", "where",
                 "items", "shared", "block", "numels")

    def __init__(self, pieces: Any, state_pieces: dict[str, Any], layout: Layout | None) -> None:
        self.pieces, self.state_pieces, self.layout = pieces, state_pieces, layout
        self.replicas = isinstance(pieces, Replicas)
        self.assigned, self.owner, self.mine, self.group = 0, 0, False, []
        #: How the owner's block shares its Newton-Schulz (``shared_ns``: ``"matrices"`` or ``"columns"``), or None;
        #: that block's size (0: not shared).
        self.shared: str | None = None
        self.block = 0
        #: key -> {rank of ``group``: (boxes, local shape)}: the pieces of ``"param"``, of a vector along one of its
        #: dimensions (:data:`AXES`) or of a sharded state tensor, read off the descriptor at first use.
        self.where: dict[str, dict[int, tuple[list, tuple[int, ...]]]] = {}
        #: The owner's items of the unit's whole matrices, made once and refilled every step.
        self.items: list[Item] = []
        #: (key, rank) -> the elements of that rank's piece, as a relay reads them (``relay.py``).
        self.numels: dict[tuple[str, int], int] = {}

    def descriptor(self, key: str) -> Any:
        return (self.pieces.along(AXES[key]) if key in AXES else self.pieces if key == "param" else
                self.state_pieces[key])


class Exchange(LocalSplit):
    """``placement.OWNERS``' splitter: the owner of every unit of one optimizer, and the two exchanges.

    Every rank plans the same units in the same order (every rank steps the same parameters, the DDP contract),
    over the optimizer's process group (the default one unless it was given another)."""

    def __init__(self, units: Sequence[Unit], costs: Sequence[float], group: Any = None, *, depth: int = 1,
                 shares: Sequence[Shares] | None = None, ns_group: int = 1, relay_group: int = 1) -> None:
        super().__init__()
        self.pg = group
        #: How many of a hidden rule's buckets are in flight at once (:func:`_pipelined`; :data:`DEPTHS` of the
        #: optimizer's ``overlap``): 1, one at a time, blocking.
        self.depth = depth
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        #: The predicted work each rank owns (``driver.cost``): the owners' balance.
        self.load = [0.0] * self.world
        # the shape bucket a unit travels in (``step``): an owner holds one bucket's whole matrices at a time
        buckets = [(u.replicas, tuple(u.pieces.shape)) for u in units]
        Blocks.check(ns_group, self.world)
        # a unit on a mesh with a dimension that replicates (HSDP; FSDP2 over TP's matrices outside the TP plan)
        # has an owner in each replica group (Pieces.owner_for): the ranks that repeat its owner's work elsewhere
        # (Pieces.mirrors). A block would have to be one per replica group too, which is not built, so such a unit
        # is planned whole, among the first group's ranks, each mirror charged alike (counted as ranks of their
        # own, HSDP's 8 replica groups of 128 put 1.16x the work of a plan by group on the busiest rank at Llama-3
        # 70B's shapes); a unit whose pieces only some ranks hold (Pieces.at: an expert on its TP group) is owned
        # among them
        mirrors = [u.pieces.mirrors if not u.replicas and u.pieces.replicated_dims else None for u in units]
        offered = [{} if ns_group == 1 or m else s for m, s in zip(mirrors, shares or [{}] * len(units), strict=True)]
        within = [u.pieces.first_group() if m else None if u.replicas else u.pieces.holders
                  for u, m in zip(units, mirrors, strict=True)]
        owners, shared = assign_within(within, costs, offered, self.load, buckets, share=ns_group > 1,
                                       in_flight=depth == DEPTHS["all"], mirrors=mirrors)
        #: By block size, the blocks the plan shares units' Newton-Schulz by (``shared_ns``; sizes dividing
        #: ``ns_group``): only the sizes it uses, made alike on every rank (the plan is every rank's).
        self.blocks: dict[int, Blocks] = {z: Blocks(group, z) for z in sorted(set(shared) - {0})}
        #: The nodes of ``relay_group`` ranks the exchange is relayed through (``relay.py``), or None: one node (or
        #: none) has nothing to relay.
        self.relay = (None if relay_group == 1 or relay_group == self.world else
                      self.blocks.get(relay_group) or Blocks(group, relay_group, "relay_group"))
        for u, o, z, how in zip(units, owners, shared, shares or [{}] * len(units), strict=True):
            u.assigned, u.shared, u.block = o, how[z][0] if z else None, z
            u.owner = self.owner_of(u)
            u.mine = u.owner == self.rank
            if u.mine:
                u.group = ([r for r in range(self.world) if r != self.rank] if u.replicas else
                           [r for r in range(self.world) if self.owner_of(u, r) == self.rank])
        self.units = list(units)
        #: Whether a unit's results travel as factors, by unit, form and dtypes (``transfer.pays``, decided once).
        self.factored: dict[tuple, bool] = {}
        #: By a call's units, way and what travels: per rank, its bytes with each of its owners (:meth:`_flat`); by a
        #: unit's boxes, how its pieces tile it (``assembly.put_together``).
        self.between: dict[tuple, dict[int, dict[int, int]]] = {}
        self.tiles: dict[tuple, tuple | None] = {}

    def owner_of(self, u: Unit, r: int | None = None) -> int:
        """The rank that computes unit ``u`` for rank ``r`` (default: this one): its owner, or under mesh dimensions
        that replicate it the owner of ``r``'s replica group (read when planning; a step reads ``u.owner``)."""
        return u.assigned if u.replicas else u.pieces.owner_for(self.rank if r is None else r, u.assigned)

    def _where(self, u: Unit, key: str) -> dict[int, tuple[list, tuple[int, ...]]]:
        if key not in u.where:
            d = u.descriptor(key)
            u.where[key] = {r: (d.boxes(r), d.local_shape(r)) for r in u.group}
        return u.where[key]

    def to_owners(self, indices: Sequence[int], pieces: list[list[Tensor]], keys: Sequence[Sequence[str]],
                  into: tuple[Tensor, list[int]] | None = None, *,
                  wait: bool = True) -> list[list[Tensor] | None] | InFlight:
        """Every rank's ``pieces[j]`` of unit ``indices[j]`` (local pieces, in ``keys[j]``'s layouts: ``"param"`` or a
        sharded state key) to its owner: one ``all_to_all_single``, none where every unit is a DDP one (its owner
        holds it whole). Returns per unit, at its owner, the tensors put together in their global shapes (under
        DDP the pieces themselves; ``into = (stack, js)``: unit ``js[k]``'s first in row ``k`` of ``stack``), ``None``
        elsewhere; alike units next to one another as rows of one tensor (``assembly.py``); ``wait=False``: an
        :class:`InFlight` of them, the exchange posted. ``pieces`` is handed over (emptied)."""
        units = [self.units[i] for i in indices]
        wholes: list[list[Tensor] | None] = [list(ps) if u.mine and u.replicas else None
                                             for u, ps in zip(units, pieces, strict=True)]
        if all(u.replicas for u in units):
            pieces.clear()
            return wholes if wait else InFlight(None, lambda: wholes)
        done = runs(units, pieces, keys, into, self._where)
        for run in done:
            for j, ws in zip(run.members, run.wholes, strict=True):
                wholes[j] = ws
        send: list[list[Tensor]] = [[] for _ in range(self.world)]
        device = next(p.device for ps in pieces for p in ps)
        dtypes = [[p.dtype for p in ps] for ps in pieces]
        for u, ps in zip(units, pieces, strict=True):
            send[u.owner] += ps
        pieces.clear()
        ps = None  # noqa: F841 - the loop's last pieces are not alive during the exchange
        sizes: list[list[int]] = [[] for _ in range(self.world)]
        for run in done:
            for r in units[run.members[0]].group:
                sizes[r] += [len(run.members) * math.prod(w[r][1]) * t.element_size()
                             for t, w in zip(run.wholes[0], run.where, strict=True)]
        got = self._flat(units, send, [sum(s) for s in sizes], device, wait, lambda: [
            [(k, None, dt) for k, dt in zip(ks, dts, strict=True)] for ks, dts in zip(keys, dtypes, strict=True)])
        if wait:
            put_together(done, got, self.world, self.tiles)  # type: ignore[arg-type]
            return wholes
        return InFlight(None, lambda: (put_together(done, got.wait(), self.world, self.tiles), wholes)[1])  # type: ignore

    def _flat(self, units: list[Unit], send: list[list[Tensor]], out_splits: list[int], device: torch.device,
              wait: bool, spec: Callable[[], list[list[tuple[str | None, Any, torch.dtype]]]],
              back: bool = False) -> Tensor | InFlight:
        """The one collective (:func:`.distributed.exchange_flat`), or with :attr:`relay` the same bytes through the
        receiving node (:func:`.relay.relayed_flat`; a DDP bucket's way back, the same whole to every rank, direct).
        ``spec()``: per unit of ``units``, ``(key, shape, dtype)`` of what travels between a rank and its owner
        (``shape`` ``None``: that rank's piece of ``key``; else the tensor whole), from which a relay knows, as every
        rank does, the bytes it forwards; ``back``: from the owners."""
        if self.relay is None or units[0].replicas:
            return exchange_flat(send, out_splits, self.pg, device, wait=wait)
        what = spec()  # from the plan alone: what a rank moves with its owners is worked out once, kept
        memo = self.between.setdefault((tuple(map(id, units)), back, *map(tuple, what)), {})

        def between(r: int) -> dict[int, int]:
            """The bytes between rank ``r`` and each of its owners, by owner."""
            if r not in memo:
                memo[r] = per = {}
                for u, travels in zip(units, what, strict=True):
                    o = self.owner_of(u, r)
                    per[o] = per.get(o, 0) + sum(dt.itemsize * (math.prod(shape) if shape is not None else
                                                                self._numel(u, k, r)) for k, shape, dt in travels)
            return memo[r]

        def sizes(s: int, d: int) -> int:
            return between(d).get(s, 0) if back else between(s).get(d, 0)

        return relayed_flat(send, out_splits, sizes, self.pg, self.relay.pg, self.relay.size, device,
                            via="sender" if back else "receiver", wait=wait)

    def _numel(self, u: Unit, key: str, r: int) -> int:
        """The elements of rank ``r``'s piece of unit ``u``'s ``key``."""
        if (key, r) not in u.numels:
            u.numels[key, r] = math.prod(u.descriptor(key).local_shape(r))
        return u.numels[key, r]

    def from_owners(self, indices: Sequence[int], wholes: Sequence[list[Tensor] | None],
                    keys: Sequence[Sequence[str | None]],
                    like: Sequence[Callable[[], list[tuple[Sequence[int], torch.dtype]]]],
                    device: torch.device, *, wait: bool = True) -> list[list[Tensor]] | InFlight:
        """The way back, one ``all_to_all_single``: owners send every rank of their group its pieces of ``wholes[j]``
        (by ``keys[j]``: ``"param"``, a vector along one of its dimensions, :data:`AXES`, or a sharded state key;
        ``None``: the tensor whole). Returns per unit this rank's results: what it received, as views of the one
        receive buffer (on ``device``) in the shapes and dtypes ``like[j]()`` says (no copy beside it), or where it
        owns a DDP unit its own ``wholes[j]``, with alike units' parts as stacks (``assembly.Received.runs``);
        ``wait=False``: an :class:`InFlight` of them, the exchange posted."""
        units = [self.units[i] for i in indices]
        send = cut_out(units, wholes, keys, self._where, self.world)  # alike units' pieces part by part
        specs, sizes = [], [0] * self.world
        for u, ws, make in zip(units, wholes, like, strict=True):
            spec = None if ws is not None and u.replicas else make()  # a DDP owner keeps its own results
            if spec is not None:
                sizes[u.owner] += sum(math.prod(shape) * dtype.itemsize for shape, dtype in spec)
            specs.append(spec)
        flat = self._flat(units, send, sizes, device, wait, lambda: [
            [(k, None if k is not None else shape, dtype) for k, (shape, dtype) in zip(ks, make(), strict=True)]
            for ks, make in zip(keys, like, strict=True)], back=True)
        del send
        kept = [ws if spec is None else None for ws, spec in zip(wholes, specs, strict=True)]  # a DDP owner's own
        owners = [u.owner for u in units]
        return (received_back(specs, owners, kept, flat, sizes) if wait else  # type: ignore[arg-type]
                InFlight(None, lambda: received_back(specs, owners, kept, flat.wait(), sizes)))  # type: ignore[union-attr]


# ---- a momentum rule's step through the exchange ----------------------------------------------------------


def _owner_items(rule: HiddenRule, u: Unit, X: Tensor, state: dict[str, Tensor], step: int, name: str) -> list[Item]:
    """A unit's whole matrices at its owner, as items of the one body (``driver.bucket_directions``): ``X``'s
    matrices by the unit's layout, each with its per-matrix state as views of the whole ``state`` (updated in
    place) and the step count; the unit's items, made once, refilled."""
    layout = u.layout
    xs = layout.matrices(X) if layout is not None else [X.reshape(X.shape[0], -1)]
    cut = {"rows": "row_pieces", "counter": "counters"}
    views = rule.state_views
    per_key = {k: (getattr(layout, cut[views[k]])(v) if layout is not None else [v])
               for k, v in state.items() if views.get(k) in cut}
    steps = {k: step for k, how in views.items() if how == "step"}
    if len(u.items) != len(xs):
        u.items = [Item(x, None, {}, name, x.shape) for x in xs]
    for j, (it, x) in enumerate(zip(u.items, xs, strict=True)):
        it.param, it.state = x, {**steps, **{k: v[j] for k, v in per_key.items()}}
    return u.items


def _inputs(x_of: Inputs, items: Sequence[Item], batched: bool) -> list[Tensor]:
    """The direction inputs of ``items``: batched in ``_foreach`` kernels, else one by one."""
    return x_of(items) if batched else [x_of.one(it) for it in items]


class _Call:
    """One shape bucket of a hidden rule's units on its way out. First what every rank knows of it (the same on
    every rank: shapes, dtypes and the plan): the members, their units and step multipliers, the dtypes of what
    travels, whether the directions travel as factors, and the keys of the pieces that go out. Then its pieces
    posted: every rank's pieces of ``X`` (and of ``W`` where the rule steps its weights, and of the sharded
    per-matrix state) to their owners, ``wholes`` the whole matrices at this rank's owned units (``wait=False``:
    an :class:`InFlight` of them), ``stack`` the owner's stack they are received into."""

    __slots__ = ("rule", "bucket", "group", "ctx", "batched", "orth", "members", "indices", "units", "replicas",
                 "scales", "fold", "ns", "x_dtype", "d_dtype", "factored", "own", "keys_out", "device", "wholes",
                 "stack", "stacked_ns")

    def __init__(self, rule: HiddenRule, bucket: Bucket, group: dict, ctx: StepContext, batched: bool,
                 orth: Callable | None, x_of: Inputs, wait: bool = True) -> None:
        ex: Exchange = ctx.split  # type: ignore[assignment]
        self.rule, self.bucket, self.group, self.ctx, self.batched, self.orth = rule, bucket, group, ctx, batched, orth
        self.members = members = bucket.items
        self.indices = [it.index for it in members]
        self.units = units = [ex.units[i] for i in self.indices]
        p0 = members[0].param
        self.device, self.replicas = p0.device, units[0].replicas
        self.scales = [[rule.lr_scale(r, c, group) for r, c in u.layout.shapes()] if u.layout is not None else
                       [rule.lr_scale(it.shape[0], math.prod(it.shape[1:]), group)]
                       for u, it in zip(units, members, strict=True)]
        self.fold = any(len(set(s)) > 1 for s in self.scales)
        # Newton-Schulz of an owner's stack as one batched call: under DDP as one process's batched form runs it (its
        # bits); a DTensor's owner where the device runs one (newton_schulz.batched_ns: on CPU matrix by matrix,
        # faster there and iterated in the received buffer, the owner's transient peak one matrix's Newton-Schulz)
        self.stacked_ns = batched and (self.replicas or batched_ns(self.device))
        # What travels: the direction input in the Newton-Schulz dtype where the rule keeps the default ``pre``, else
        # at least float32, as ``pre`` computes; the direction in U's dtype where ``post`` is the identity and no
        # step multipliers are folded in (transfer.IDENTITY), else at least the parameter's dtype, so that each
        # rank adds what one process adds
        self.ns = ns = resolve_dtype(group, p0, ctx)
        self.x_dtype = x = torch.promote_types(p0.dtype, torch.float32) if rule._rewrites_input else ns
        self.d_dtype = (ns if rule.transfer_form == transfer.IDENTITY and not self.fold else
                        torch.promote_types(x, p0.dtype))
        # eq. 8's (or NorMuon's) factors where they are fewer bytes for every rank's piece of a plain matrix,
        # decided once per unit and dtypes (transfer.pays), from shapes alone: every rank alike, no collective
        self.factored = not self.fold
        for u, it, i in zip(units, members, self.indices, strict=True):
            key = (i, rule.transfer_form, ns, self.d_dtype)
            if key not in ex.factored:
                ex.factored[key] = u.layout is None and len(it.shape) == 2 and all(
                    transfer.pays(rule.transfer_form, m, n, ns, self.d_dtype)
                    for m, n in u.pieces.local_shapes() if m * n)
            self.factored = self.factored and ex.factored[key]
        self.own = rule._own_step  # the weights' pieces travel too, and come back stepped (MuonH's projection)
        self.keys_out = [["param", *(["param"] if self.own else []),
                          *(k for k in rule._owner_state if k in u.state_pieces)] for u in units]
        # out: under DDP nothing goes out (the owner holds every piece, and makes X for its own matrices only, or
        # for every matrix where a capture hook reads them)
        # the inputs from the unchanged momentum (forms.Inputs): nothing is written here; under torch.distributed
        # an error is kept (StepContext.keep) and zeros go out, so that the owners still receive what they wait for
        need = [j for j, u in enumerate(units) if u.mine or not self.replicas or ctx.capture is not None]
        try:
            with naming(rule, [members[j] for j in need]):
                made = _inputs(x_of, [members[j] for j in need], batched)
        except Exception as e:
            ctx.keep(e)
            made = [torch.zeros(members[j].param.shape, dtype=self.x_dtype, device=self.device) for j in need]
        xs: list[Tensor | None] = [None] * len(members)
        for j, x in zip(need, made, strict=True):
            xs[j] = x
        del made
        if self.replicas and ctx.capture is not None:
            ctx.emit(members, xs, "momentum_input")
        # the inputs in the dtype they travel in, by one foreach copy (driver.cast)
        narrow = [j for j, (u, x) in enumerate(zip(units, xs, strict=True))
                  if x is not None and x.dtype != self.x_dtype and (u.mine or not self.replicas)]
        for j, o in zip(narrow, cast([xs[j] for j in narrow], self.x_dtype) if narrow else [], strict=True):
            xs[j] = o
        # a DDP owner's W piece is its own parameter: it steps a copy (the commit writes it)
        pieces = [[] if self.replicas and not u.mine else
                  [x, *([it.param.clone() if self.replicas else it.param] if self.own else []),
                   *(it.state[k] for k in ks[1 + self.own :])]
                  for it, u, x, ks in zip(members, units, xs, self.keys_out, strict=True)]
        del xs
        # a DTensor's plain matrices are received straight into their owner's stack, which Newton-Schulz then
        # iterates in and lets go (the one body's handed stacks): an owner holds each whole matrix once
        mine = [j for j, u in enumerate(units) if u.mine and u.shared is None]
        plain = bool(mine) and not self.replicas and not self.own and all(units[j].layout is None for j in mine)
        self.stack = ([torch.empty((len(mine), *bucket.global_shape), dtype=self.x_dtype, device=self.device)]
                      if plain else [])
        self.wholes = ex.to_owners(self.indices, pieces, self.keys_out, (self.stack[0], mine) if plain else None,
                                   wait=wait)


def _pipelined(rule: HiddenRule, buckets: Sequence[Bucket], group: dict, ctx: StepContext, *, batched: bool,
               x_of: Inputs, orth: Callable | None) -> list:
    """A hidden rule's shape buckets, longest first, ``d`` of them in flight (``Exchange.depth``, :data:`DEPTHS` of
    the optimizer's ``overlap``: 2, or every bucket): buckets ``k + 1 .. k + d - 1``'s inputs are posted before bucket
    ``k``'s Newton-Schulz at the owners and bucket ``k - d + 1``'s directions awaited only after it, so that the
    exchange runs while owners compute: a bucket costs about the larger of its exchange and its compute, not their
    sum. Every rank posts the collectives in the same order (the first ``d`` buckets out, then back ``k`` and out
    ``k + d``), so they pair up as the blocking ones do; the transient memory is ``d`` buckets' whole matrices (the
    way back of ``d - 1`` more in flight) instead of one. Returns ``(param, D, scale)`` of this rank's pieces."""
    # the longest first, by the Newton-Schulz of a bucket's busiest owner: the longest computes while the others'
    # exchanges travel (the time model's --longest-first; every rank sorts alike, ties in the plan's order)
    world, depth = ctx.split.world, ctx.split.depth
    buckets = sorted(buckets, key=lambda b: -math.ceil(len(b.items) / world) * cost(rule, b.global_shape, group))
    pending: list = []
    ahead: deque[_Call] = deque()
    backs: deque[tuple[_Call, InFlight]] = deque()
    for k in range(len(buckets)):
        while len(ahead) < depth and k + len(ahead) < len(buckets):  # buckets k .. k + d - 1 out
            ahead.append(_Call(rule, buckets[k + len(ahead)], group, ctx, batched, orth, x_of, wait=False))
        c = ahead.popleft()
        results = _at_owners(c, c.wholes.wait(), c.stack)
        c.wholes = None
        if len(backs) == depth - 1:
            b, got = backs.popleft()
            pending += _received(b, got.wait())
        backs.append((c, _back(c, results, wait=False)))
    while backs:
        b, got = backs.popleft()
        pending += _received(b, got.wait())
    return pending


def _at_owners(c: _Call, wholes: list[list[Tensor] | None], stack: list[Tensor]) -> dict[int, tuple[Any, dict]]:
    """At an owner, every owned unit's whole matrices through one body (``driver.bucket_directions``): per owned
    member, its whole direction (or ``U`` with its factors, or the stepped weight) and the per-matrix state the rule
    changed, computed on copies (nothing real is written here). ``stack``: the owned plain matrices received in one
    stack, handed over (emptied). First the units a block of ranks shares (``shared_ns``), in the bucket's order on
    every member of the block, each member taking part in its block's (:meth:`.SharedNS.help`); then the rest."""
    ex: Exchange = c.ctx.split  # type: ignore[assignment]
    results: dict[int, tuple[Any, dict]] = {}
    for j, u in enumerate(c.units):
        if u.shared is None or ex.rank not in ex.blocks[u.block].members(u.owner):
            continue
        shapes = unit_shapes(u)
        ns = SharedNS(ex.blocks[u.block], u.owner, u.shared, (len(shapes), *shapes[0]), c.group, c.ns, c.stacked_ns,
                      c.device, c.ctx)
        if u.mine:
            results.update(_owned(c, wholes, [], [j], ns))
            ns.finish()  # where the owner's computation raised before its collectives
        else:
            ns.help()
    owned = [j for j, w in enumerate(wholes) if w is not None and c.units[j].shared is None]
    return {**results, **_owned(c, wholes, stack, owned)}


def _owned(c: _Call, wholes: list[list[Tensor] | None], stack: list[Tensor], owned: list[int],
           ns: SharedNS | None = None) -> dict[int, tuple[Any, dict]]:
    """:func:`_at_owners` of the ``owned`` members (``ns``: one shared unit's). Under ``torch.distributed`` an error
    here is kept (``StepContext.keep``) and placeholders go back, so that the owner's ranks still receive what they
    wait for and the step is skipped on every rank."""
    rule, members, replicas = c.rule, c.members, c.replicas
    if not owned:
        return {}
    items: list[Item] = []
    try:
        with naming(rule, [members[j] for j in owned]):
            return _owner_results(c, wholes, stack, owned, items, ns)
    except Exception as e:
        c.ctx.keep(e)
        return {j: _placeholder(c, j, wholes[j]) for j in owned}
    finally:
        stack.clear()
        if not replicas:  # the owner's items keep no whole matrix past the step
            for it in items:
                it.param, it.state = None, {}


def _owner_results(c: _Call, wholes: list[list[Tensor] | None], stack: list[Tensor], owned: list[int],
                   items: list[Item], ns: SharedNS | None = None) -> dict[int, tuple[Any, dict]]:
    """:func:`_at_owners`' body: the one body on the owned units' whole matrices, with copies of the per-matrix state
    the owner holds (the real state is written in the step's commit, from what comes back); ``items`` receives the
    owner's items (the caller lets go of their whole matrices)."""
    rule, members, units, replicas, batched = c.rule, c.members, c.units, c.replicas, c.batched
    plain = bool(stack)
    spans = []
    xs: dict[int, Tensor] = {}
    # copies of the per-matrix state the owner holds, by one foreach copy per key and dtype (driver.cast), not one
    # kernel per unit (a stack's experts as units are thousands)
    copies: dict[tuple[int, str], Tensor] = {}
    for k in rule._owner_state:
        js = [j for j in owned if replicas or k not in c.keys_out[j]]
        for dt in {members[j].state[k].dtype for j in js}:
            same = [j for j in js if members[j].state[k].dtype == dt]
            copies.update(zip(((j, k) for j in same), cast([members[j].state[k] for j in same], dt), strict=True))
    for j in owned:
        it, u, ws = members[j], units[j], wholes[j]
        if replicas:  # the item with copies of its per-matrix state; its X is the received (its own) whole
            state = {k: copies[j, k] for k in rule._owner_state}
            its = [Item(it.param, it.grad, {**it.state, **state}, it.name, it.shape, it.kind, it.index)]
            xs[id(its[0])] = ws[0]
        else:
            state = {k: ws[c.keys_out[j].index(k)] if k in c.keys_out[j] else copies[j, k] for k in rule._owner_state}
            if c.ctx.capture is not None:
                c.ctx.capture(it.name, it.kind or c.ctx.kind, "momentum_input", ws[0])
            its = _owner_items(rule, u, ws[0].new_empty(()).expand(c.bucket.global_shape) if plain else ws[0],
                               state, it.state["step"], it.name)
            if plain:
                ws[0] = None  # the stack's row: only the stack keeps it
        spans.append((j, len(items), len(its), state))
        items += its
    # batched: one stack per shape, all in one body; per tensor: each matrix alone, as one process's form
    b = c.bucket
    handed = ([[stack[0][n : n + 1]] for n in range(len(items))] if plain and not batched else
              [[stack[0]]] if plain else None)
    stack.clear()
    if ns is not None:  # a shared unit: its matrices in one stack, which its block shares
        groups = [make_buckets(items, matrix=True, transpose=False)]
    elif not batched:
        groups = [[Bucket([it], 1, *[(it.shape[0], math.prod(it.shape[1:]))] * 2, ())] for it in items]
    elif replicas and c.orth is None:  # DDP: in the orientations one process's batched form stacks them
        flipped = [j >= b.plain for j in owned]
        order = sorted(range(len(items)), key=lambda n: flipped[n])
        groups = [[Bucket([items[n] for n in order], flipped.count(False), b.shape, b.global_shape, b.key)]]
    else:
        groups = ([[Bucket(items, len(items), b.global_shape, b.global_shape, b.key)]] if plain
                  else [make_buckets(items, matrix=True, transpose=False)])
    by_item = {}
    for buckets in groups:
        found = bucket_directions(rule, buckets, c.group, c.ctx, batched=c.stacked_ns,
                                  inputs=(lambda its: [xs[id(i)] for i in its]) if replicas else
                                  (lambda its: [i.param for i in its]), orth=c.orth, factored=c.factored,
                                  handed=handed.pop(0) if plain else None, workspace={}, ns=ns)
        for targets, news in found.writes:  # the owner's copies: what goes back
            torch._foreach_copy_(targets, news)
        by_item.update((id(it), d) for bk, ds in zip(buckets, found.directions, strict=True)
                       for it, d in zip(bk.items, ds, strict=True))
    results = {}
    for j, start, n, state in spans:
        ds = [by_item[id(it)] for it in items[start : start + n]]
        if c.own:  # the rule's own step of each whole matrix, in the whole weight (a copy): it goes back stepped
            W, layout = wholes[j][1], units[j].layout
            for w, d, s in zip(layout.matrices(W) if layout is not None else [W], ds, c.scales[j], strict=True):
                step_weights(rule, [w], d.reshape(1, w.shape[0], -1), s, c.group)
            results[j] = (W, state)
        elif c.factored or (units[j].layout is None and ds[0].dtype == c.d_dtype):
            results[j] = (ds[0] if c.factored else ds[0].reshape(members[j].shape), state)
        else:  # a view's matrices into the whole direction, the step multipliers folded in where they differ
            D = torch.empty(members[j].shape, dtype=c.d_dtype, device=c.device)
            views = units[j].layout.matrices(D) if units[j].layout is not None else [D.view(ds[0].shape)]
            for v, d, s in zip(views, ds, c.scales[j], strict=True):
                v.copy_(d * s if c.fold else d)
            results[j] = (D, state)
    return _written_out(results) if c.factored else results


def _written_out(results: dict[int, tuple[Any, dict]]) -> dict[int, tuple[Any, dict]]:
    """Broadcast factors (NorMuon's column scale) written out by one foreach copy, not copied unit by unit."""
    loose = [(j, n) for j, (d, _) in results.items() for n, t in enumerate(d) if not t.is_contiguous()]
    ts = [results[j][0][n] for j, n in loose]
    for (j, n), t in zip(loose, cast(ts, ts[0].dtype) if len({t.dtype for t in ts}) == 1 else ts, strict=True):
        results[j] = ((*results[j][0][:n], t, *results[j][0][n + 1 :]), results[j][1])
    return results


def _placeholder(c: _Call, j: int, ws: list[Tensor | None]) -> tuple[Any, dict]:
    """What an owner whose computation raised sends back for member ``j`` (the step is skipped on every rank): zeros
    of the shapes and dtypes its ranks wait for, the weights and the per-matrix state as received."""
    it, keys, shape = c.members[j], c.keys_out[j], c.members[j].shape
    state = {k: ws[keys.index(k)] if k in keys else it.state[k] for k in c.rule._owner_state}
    if c.own:
        return ws[1], state
    if c.factored:
        return (torch.zeros(shape, dtype=c.ns, device=c.device),
                *(torch.zeros(shape[d], dtype=c.d_dtype, device=c.device) for d in AXES.values())), state
    return torch.zeros(shape, dtype=c.d_dtype, device=c.device), state


def _back(c: _Call, results: dict[int, tuple[Any, dict]], wait: bool = True) -> list[list[Tensor]] | InFlight:
    """The way back: D (or U with its factors, or the stepped W) and the per-matrix state the rule changed, each
    rank's piece, as :meth:`Exchange.from_owners` returns them (``wait=False``: posted, an :class:`InFlight`), for
    :func:`_received`."""
    rule, factored, own, d_dtype = c.rule, c.factored, c.own, c.d_dtype
    back_keys, out_wholes, like = [], [], []
    for j, (it, u) in enumerate(zip(c.members, c.units, strict=True)):
        back_keys.append([*(["param", *AXES] if factored else ["param"]),
                          *(k if k in u.state_pieces else None for k in rule._owner_state)])
        if j in results:
            d, state = results[j]
            out_wholes.append([*(d if factored else [d]), *(state[k] for k in rule._owner_state)])
        else:
            out_wholes.append(None)
        p = it.param
        like.append(lambda p=p, it=it, dtype=p.dtype if own else d_dtype: [
            *([(p.shape, c.ns), *(((p.shape[d],), d_dtype) for d in AXES.values())] if factored else
              [(p.shape, dtype)]),
            *((it.state[k].shape, it.state[k].dtype) for k in rule._owner_state)])
    results.clear()
    return c.ctx.split.from_owners(c.indices, out_wholes, back_keys, like, c.device, wait=wait)


def _received(c: _Call, got: list[list[Tensor]]) -> list:
    """This rank's pieces back from the owners (``got``, :func:`_back`'s): the per-matrix state and a stepped weight
    queued on the step's commit, ``(param, D, scale)`` of the rest returned for the one update."""
    rule, factored, own = c.rule, c.factored, c.own
    n = 3 if factored else 1
    state_targets, state_news, weights, stepped = [], [], [], []
    directions = (transfer.apply_received(got, rule.factors_divide, c.d_dtype, c.device) if factored and not own else
                  [parts[0] for parts in got])
    out = []
    for it, s, parts, d in zip(c.members, c.scales, got, directions, strict=True):
        for k, t in zip(rule._owner_state, parts[n:], strict=True):
            state_targets.append(it.state[k])
            state_news.append(t)
        if own:  # the stepped weight (a DDP owner's, its own copy)
            weights.append(it.param)
            stepped.append(parts[0])
        else:
            out.append((it.param, d, 1.0 if c.fold else s[0]))
    c.ctx.commit.later(commit.copy_, state_targets, state_news, parts=1)
    c.ctx.commit.later(commit.copy_, weights, stepped)
    return out


def _elementwise_bucket(rule: Any, members: list[Item], group: dict, ctx: StepContext, x_of: Inputs,
                        batched: bool) -> list:
    """An elementwise momentum rule's pieces whose statistics need more than sums over rows (eq. 9 on a
    tensor-parallel ``Shard(1)`` embedding): ``X`` out, :meth:`MomentumRule.direction` of each whole matrix at
    its owner, ``D`` back."""
    ex: Exchange = ctx.split  # type: ignore[assignment]
    indices = [it.index for it in members]
    p0 = members[0].param
    x_dtype = d_dtype = torch.promote_types(p0.dtype, torch.float32)  # its statistics' dtype, as one process's
    try:
        with naming(rule, members):
            xs = [x.to(x_dtype) for x in _inputs(x_of, members, batched)]
    except Exception as e:
        ctx.keep(e)
        xs = [torch.zeros(it.param.shape, dtype=x_dtype, device=p0.device) for it in members]
    wholes = ex.to_owners(indices, [[x] for x in xs], [["param"]] * len(members))
    del xs
    out_wholes = []
    for it, i, ws in zip(members, indices, wholes, strict=True):
        if ws is None:
            out_wholes.append(None)
            continue
        X = ws[0]
        layout = ex.units[i].layout
        D = torch.empty(X.shape, dtype=d_dtype, device=X.device)
        try:
            with naming(rule, [it]):
                for x, d in zip(*((layout.matrices(X), layout.matrices(D)) if layout is not None else ([X], [D])),
                                strict=True):
                    x = x.reshape(x.shape[0], -1) if needs_matrix(rule) else x
                    d.copy_(rule.direction(x.contiguous().to(x_dtype)[None], group, None,
                                           tuple(x.shape))[0].reshape(d.shape))
        except Exception as e:
            ctx.keep(e)
        out_wholes.append([D])
    got = ex.from_owners(indices, out_wholes, [["param"]] * len(members),
                         [lambda it=it: [(it.param.shape, d_dtype)] for it in members], p0.device)
    return [(it.param, parts[0], 1.0) for it, parts in zip(members, got, strict=True)]


def step(calls: Sequence[Call], *, batched: bool, orth: Callable | None = None) -> None:
    """The exchange's form of a step's calls (``foreach=False``: ``batched`` False, as one process's per-tensor form,
    each matrix alone at the owners; ``foreach=True``: one stack per shape at the owners): direction inputs from the
    unchanged momentum where the pieces lie (``forms.Inputs``), then per shape bucket the exchange; the step's writes
    queued on its commit: each call's updates of this rank's pieces as one process's, then the momentum of every
    call where it lies (``forms.write_inputs``). A bucket is DDP's matrices as one process's batched form buckets
    them (an ``(n, m)`` matrix in the ``(m, n)`` bucket, which saves an exchange) or a DTensor's units by their global
    shape; one bucket's exchange out and back at a time, so that a step holds one bucket's whole matrices, or with
    ``overlap`` two buckets or all of them in flight (:func:`_pipelined`)."""
    for rule, items, group, ctx in calls:
        x_of = Inputs(rule, group, ctx)
        pending = []
        for replicas in (True, False):  # DDP's matrices and DTensors' pieces (one call may merge groups of both)
            its = [it for it in items if ctx.split.units[it.index].replicas is replicas]
            transpose = replicas and batched and isinstance(rule, HiddenRule) and rule.transposes
            buckets = make_buckets(its, matrix=True, transpose=transpose) if its else []
            if not isinstance(rule, HiddenRule):
                for b in buckets:
                    pending += _elementwise_bucket(rule, b.items, group, ctx, x_of, batched)
            elif ctx.split.depth > 1:
                pending += _pipelined(rule, buckets, group, ctx, batched=batched, x_of=x_of, orth=orth)
            else:  # one bucket at a time: out, whole matrices at owners, back
                for b in buckets:
                    c = _Call(rule, b, group, ctx, batched, orth, x_of)
                    pending += _received(c, _back(c, _at_owners(c, c.wholes, c.stack)))
        ctx.commit.later(apply_pending, pending, group)
    if calls:
        calls[0][3].commit.later(write_inputs, list(calls), batched=batched)
