"""The one exchange (``placement.OWNERS``): direction inputs to owner ranks, whole matrices there, results back.

Every layout where a matrix's rule needs the whole matrix but this rank does not hold it alone, or holds it
as every other rank does and shares its Newton-Schulz with them, steps here, by one mechanism:

1. each *unit* -- a DTensor parameter, or under DDP one matrix of a plain parameter's view -- has one owner,
   planned once (longest first by predicted cost onto the least-loaded rank, :func:`.distributed.assign_owners`,
   identical on every rank, no collective);
2. every rank updates the momentum of its piece where it lies (the forms below, as one process's) and sends
   its piece of the direction input ``X`` to the owner, with the per-matrix state the rule reads where that is
   sharded: one ``all_to_all_single`` of bytes per shape bucket (:func:`.distributed.exchange_flat`, nothing
   padded); under DDP the owner holds ``X`` whole and nothing goes out;
3. the owner puts the pieces together and runs the one body of a hidden rule on whole matrices
   (:func:`.driver.bucket_directions`: ``pre``, Newton-Schulz, ``post``), so every statistic is the whole
   matrix's, one process's bits (an elementwise momentum rule's ``direction``, a stepping rule's own step on
   whole tensors, where their statistics need more than sums over rows);
4. a second exchange returns every rank its piece of the direction, in the fewest bytes that keep its bits
   (``transfer.py``: ``U`` in the Newton-Schulz dtype, or with eq. 8's factors, or ``D``), and the per-matrix
   state the rule changed; under DDP every other rank receives it whole;
5. each rank applies ``W <- (1 - lr wd) W - lr s D`` to its piece, as one process does.

Per rank that is the floor: each piece of ``X`` out once and its direction back once (DDP: each direction once
to every other rank), plus the per-matrix state. Only one shape bucket's whole matrices exist at a time. Where
pieces lie is a descriptor (``owners.py``); the same code serves DDP, FSDP2 and HSDP row shards, tensor
parallelism and FSDP2 over TP, per tensor, batched and compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from . import transfer
from .calls import Item, StepContext
from .distributed import LocalSplit, as_bytes, assign_owners, exchange_bytes, from_bytes, is_dtensor, local
from .driver import (
    Bucket,
    Call,
    HiddenRule,
    apply_pending,
    bucket_directions,
    cut_items,
    input_makers,
    make_buckets,
    matrix_shape,
    needs_matrix,
    resolve_dtype,
    step_weights,
)
from .owners import AXES, Replicas
from .rule import SteppingRule
from .views import Layout

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]

__all__ = ["Exchange", "Unit", "batched", "per_tensor", "whole_step"]


class Unit:
    """One tensor the exchange steps: its descriptor (``owners.py``), the descriptors of its sharded state by key,
    the layout its owner cuts it into matrices by (``None``: the unit is one matrix, or a tensor of an
    elementwise rule), and its owner (set by :class:`Exchange`)."""

    __slots__ = ("pieces", "state_pieces", "layout", "owner")

    def __init__(self, pieces: Any, state_pieces: dict[str, Any], layout: Layout | None) -> None:
        self.pieces, self.state_pieces, self.layout, self.owner = pieces, state_pieces, layout, 0


class Exchange(LocalSplit):
    """``placement.OWNERS``' splitter: the owner of every unit of one optimizer, and the two exchanges.

    Every rank plans the same units in the same order (every rank steps the same parameters, the DDP contract),
    over the default process group."""

    def __init__(self, units: Sequence[Unit], costs: Sequence[float], group: Any = None) -> None:
        super().__init__()
        #: The process group of the exchange: the optimizer's (the default one unless it was given another).
        self.pg = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        #: The predicted work each rank owns (``driver.cost``): the owners' balance.
        self.load = [0.0] * self.world
        for u, o in zip(units, assign_owners(list(costs), self.load), strict=True):
            u.owner = o
        self.units = list(units)
        self._groups: dict[tuple[int, int], list[int]] = {}

    def owner_of(self, i: int, r: int | None = None) -> int:
        """The rank that computes unit ``i`` for rank ``r`` (default: this one): its owner, or under replicated
        mesh dimensions the owner of ``r``'s replica group."""
        u = self.units[i]
        if isinstance(u.pieces, Replicas):
            return u.owner
        return u.pieces.owner_for(self.rank if r is None else r, u.owner)

    def mine(self, i: int) -> bool:
        return self.owner_of(i) == self.rank

    def _group(self, i: int) -> list[int]:
        """The ranks this rank, owning unit ``i``, exchanges with: its replica group (pieces out and back), or
        under DDP every other rank (results back only)."""
        u = self.units[i]
        key = (id(u.pieces), u.owner)
        if key not in self._groups:
            replicas = isinstance(u.pieces, Replicas)
            self._groups[key] = [r for r in range(self.world)
                                 if (r != self.rank if replicas else self.owner_of(i, r) == self.rank)]
        return self._groups[key]

    def _descriptor(self, i: int, key: str) -> Any:
        """Where the pieces of ``key`` lie: ``"param"``, a vector along one of its dimensions (:data:`AXES`), or
        a sharded state key."""
        u = self.units[i]
        if key in AXES:
            return u.pieces.along(AXES[key])
        return u.pieces if key == "param" else u.state_pieces[key]

    def to_owners(self, indices: Sequence[int], pieces: list[list[Tensor]],
                  keys: Sequence[Sequence[str]]) -> list[list[Tensor] | None]:
        """Every rank's ``pieces[j]`` of unit ``indices[j]`` (local pieces, in ``keys[j]``'s layouts: ``"param"`` or a
        sharded state key) to its owner: one ``all_to_all_single``, none where every unit is a DDP one (its owner
        holds it whole). Returns per unit, at its owner, the tensors put together in their global shapes (under
        DDP the pieces themselves), ``None`` elsewhere. ``pieces`` is handed over (emptied)."""
        replicas = [isinstance(self.units[i].pieces, Replicas) for i in indices]
        wholes: list[list[Tensor] | None] = []
        mine = []
        for j, (i, ps, ks) in enumerate(zip(indices, pieces, keys, strict=True)):
            if not self.mine(i):
                wholes.append(None)
            elif replicas[j]:
                wholes.append(list(ps))
            else:
                wholes.append([torch.empty(self._descriptor(i, k).shape, dtype=p.dtype, device=p.device)
                               for p, k in zip(ps, ks, strict=True)])
                mine.append(j)
        if all(replicas):
            pieces.clear()
            return wholes
        send: list[list[Tensor]] = [[] for _ in range(self.world)]
        device = next(p.device for ps in pieces for p in ps)
        for i, ps, rep in zip(indices, pieces, replicas, strict=True):
            if not rep:
                send[self.owner_of(i)] += [as_bytes(p) for p in ps]
        pieces.clear()
        sizes: list[list[int]] = [[] for _ in range(self.world)]
        for j in mine:
            i = indices[j]
            for r in self._group(i):
                sizes[r] += [self._descriptor(i, k).numel(r) * w.element_size()
                             for k, w in zip(keys[j], wholes[j], strict=True)]
        recv = exchange_bytes(send, sizes, self.pg, device)
        for r in range(self.world):
            got = iter(recv[r])
            for j in mine:
                i = indices[j]
                if r in self._group(i):
                    for k, w in zip(keys[j], wholes[j], strict=True):
                        self._descriptor(i, k).put(w, r, from_bytes(next(got), w.dtype))
        return wholes

    def from_owners(self, indices: Sequence[int], wholes: Sequence[list[Tensor] | None],
                    keys: Sequence[Sequence[str | None]],
                    into: Sequence[Callable[[], list[Tensor]]]) -> list[list[Tensor]]:
        """The way back, one ``all_to_all_single``: owners send every rank of their group its pieces of ``wholes[j]``
        (by ``keys[j]``: ``"param"``, a vector along one of its dimensions, :data:`AXES`, or a sharded state key;
        ``None``: the tensor whole). Returns per unit this rank's results: what it received, in the tensors
        ``into[j]()`` makes, or where it owns a DDP unit its own ``wholes[j]``."""
        send: list[list[Tensor]] = [[] for _ in range(self.world)]
        for i, ws, ks in zip(indices, wholes, keys, strict=True):
            if ws is not None:
                for r in self._group(i):
                    send[r] += [as_bytes(w if k is None else self._descriptor(i, k).take(w, r))
                                for k, w in zip(ks, ws, strict=True)]
        out, sizes = [], [[] for _ in range(self.world)]
        for i, ws, make in zip(indices, wholes, into, strict=True):
            if ws is not None and isinstance(self.units[i].pieces, Replicas):
                out.append(ws)  # a DDP owner's own results
                continue
            ts = make()
            sizes[self.owner_of(i)] += [t.numel() * t.element_size() for t in ts]
            out.append(ts)
        device = next((t.device for ts in out for t in ts), torch.device("cpu"))
        recv = exchange_bytes(send, sizes, self.pg, device)
        del send
        got = [iter(x) for x in recv]
        for i, ws, ts in zip(indices, wholes, out, strict=True):
            if ws is not None and isinstance(self.units[i].pieces, Replicas):
                continue
            src = got[self.owner_of(i)]
            for t in ts:
                t.copy_(from_bytes(next(src), t.dtype).view(t.shape))
        return out


# ---- a momentum rule's step through the exchange ----------------------------------------------------------


def _scales(rule: Any, unit: Unit, shape: Sequence[int], group: dict) -> list[float]:
    """A hidden rule's step multiplier of every matrix of a unit; the elementwise rules fold theirs in."""
    if not isinstance(rule, HiddenRule):
        return [1.0]
    shapes = unit.layout.shapes() if unit.layout is not None else [matrix_shape(shape)]
    return [rule.lr_scale(r, c, group) for r, c in shapes]


def _dtypes(rule: Any, group: dict, p: Tensor, ctx: StepContext, fold: bool) -> tuple[torch.dtype, torch.dtype]:
    """What travels: the direction input (the Newton-Schulz dtype where a hidden rule keeps the default ``pre``,
    else at least float32, as ``pre`` and the elementwise rules compute) and the direction: ``U``'s dtype where
    the rule's ``post`` is the identity and no step multipliers are folded in (``transfer.IDENTITY``), else at
    least the parameter's dtype, so that each rank adds what one process adds."""
    hidden = isinstance(rule, HiddenRule)
    x = resolve_dtype(group, p, ctx) if hidden and not rule._rewrites_input else F.stat_dtype(p)
    if hidden and rule.transfer_form == transfer.IDENTITY and not fold:
        return x, resolve_dtype(group, p, ctx)
    return x, torch.promote_types(x, p.dtype)


def _owner_items(rule: Any, unit: Unit, X: Tensor, state: dict[str, Tensor], step: int, name: str) -> list[Item]:
    """A unit's whole matrices at its owner, as items of the one body (``driver.bucket_directions``): ``X``'s
    matrices by the unit's layout, each with its per-matrix state as views of the whole ``state`` (updated in
    place) and the step count."""
    layout = unit.layout
    xs = layout.matrices(X) if layout is not None else [X.reshape(matrix_shape(X.shape))]
    cut = {"rows": "row_pieces", "counter": "counters"}
    views = rule.state_views
    per_key = {k: (getattr(layout, cut[views[k]])(v) if layout is not None else [v])
               for k, v in state.items() if views.get(k) in cut}
    steps = {k: step for k, how in views.items() if how == "step"}
    return [Item(x, None, {**steps, **{k: v[j] for k, v in per_key.items()}}, name, x.shape)
            for j, x in enumerate(xs)]


def _hidden_bucket(rule: HiddenRule, bucket: Bucket, group: dict, ctx: StepContext, *, batched: bool,
                   x_of: Callable[[Item], Tensor], orth: Callable | None) -> list:
    """One shape bucket of a hidden rule's units: ``X`` out, directions of whole matrices at owners (the one body,
    ``driver.bucket_directions``), each rank's piece back. Returns ``(param, D, scale)`` of this rank's pieces."""
    ex: Exchange = ctx.split  # type: ignore[assignment]
    members = bucket.items
    indices = [it.index for it in members]
    units = [ex.units[i] for i in indices]
    p0 = members[0].param
    replicas = isinstance(units[0].pieces, Replicas)
    scales = [_scales(rule, u, it.shape, group) for u, it in zip(units, members, strict=True)]
    fold = any(len(set(s)) > 1 for s in scales)
    x_dtype, d_dtype = _dtypes(rule, group, p0, ctx, fold)
    ns = resolve_dtype(group, p0, ctx)
    # eq. 8's (or NorMuon's) factors where they are fewer bytes for every rank's piece of a plain matrix
    factored = all(u.layout is None and len(it.shape) == 2 for u, it in zip(units, members, strict=True)) and \
        not fold and all(transfer.pays(rule.transfer_form, m, n, ns, d_dtype)
                         for u in units for m, n in u.pieces.local_shapes() if m * n)
    own = rule._own_step  # the weights' pieces travel too, and come back stepped (MuonH's projection)
    keys_out = [["param", *(["param"] if own else []), *(k for k in rule._owner_state if k in u.state_pieces)]
                for u in units]
    # out: every rank's pieces of X (and of W), and of the sharded per-matrix state (under DDP nothing: the owner
    # holds them)
    if replicas:
        xs = [x_of(it) if ex.mine(i) or ctx.capture is not None else None for it, i in zip(members, indices,
                                                                                          strict=True)]
        if ctx.capture is not None:
            ctx.emit(members, xs, "momentum_input")
        pieces = [[x.to(x_dtype), *([it.param] if own else [])] if ex.mine(i) else []
                  for x, it, i in zip(xs, members, indices, strict=True)]
        del xs
    else:
        pieces = [[x_of(it).to(x_dtype), *([it.param] if own else []),
                   *(local(it.state[k]) for k in ks[1 + own :])] for it, ks in zip(members, keys_out, strict=True)]
    wholes = ex.to_owners(indices, pieces, keys_out)
    # at owners: every owned unit's whole matrices, one body for them all
    owned = [j for j, w in enumerate(wholes) if w is not None]
    results: dict[int, tuple[Any, dict[str, Tensor]]] = {}
    if owned:
        items, spans = [], []
        for j in owned:
            it, u, ws = members[j], units[j], wholes[j]
            if replicas:  # the item itself: its X and its own state
                its = [Item(ws[0].reshape(matrix_shape(it.shape)), None, it.state, it.name, matrix_shape(it.shape))]
                state = it.state
            else:
                state = {k: ws[keys_out[j].index(k)] if k in keys_out[j] else _whole(it.state[k])
                         for k in rule._owner_state}
                if ctx.capture is not None:
                    ctx.capture(it.name, it.kind or ctx.kind, "momentum_input", ws[0])
                its = _owner_items(rule, u, ws[0], state, it.state["step"], it.name)
            spans.append((j, len(items), len(its), state))
            items += its
        # batched: one stack per shape, all in one body, under DDP in the orientations one process stacks them;
        # per tensor: each matrix alone, as one process's per-tensor form
        if not batched:
            groups = [[Bucket([it], 1, it.shape, it.shape, ())] for it in items]
        elif replicas and orth is None:
            flipped = [j >= bucket.plain for j in owned]
            order = sorted(range(len(items)), key=lambda n: flipped[n])
            groups = [[Bucket([items[n] for n in order], flipped.count(False), bucket.shape, bucket.global_shape,
                              bucket.key)]]
        else:
            groups = [make_buckets(items, matrix=True, transpose=False)]
        by_item = {}
        for buckets in groups:
            found = bucket_directions(rule, buckets, group, ctx, batched=batched, x_of=lambda it: it.param, orth=orth,
                                      factored=factored)
            by_item.update((id(it), d) for b, ds in zip(buckets, found, strict=True)
                           for it, d in zip(b.items, ds, strict=True))
        for j, start, n, state in spans:
            ds = [by_item[id(it)] for it in items[start : start + n]]
            if own:  # the rule's own step of each whole matrix, in the whole weight: it goes back stepped
                W, layout = wholes[j][1], units[j].layout
                for w, d, s in zip(layout.matrices(W) if layout is not None else [W], ds, scales[j], strict=True):
                    step_weights(rule, [w], d.reshape(1, *matrix_shape(w.shape)), s, group)
                results[j] = (W, state)
                continue
            d = ds[0] if factored else _assemble(units[j], wholes[j][0], ds, scales[j], fold, d_dtype)
            results[j] = (d, state)
    del wholes
    # back: D (or U with its factors) and the per-matrix state the rule changed
    back_keys, out_wholes, into = [], [], []
    for j, (it, u) in enumerate(zip(members, units, strict=True)):
        back_keys.append([*(["param", *AXES] if factored else ["param"]),
                          *(k if k in u.state_pieces else None for k in rule._owner_state)])
        if j in results:
            d, state = results[j]
            out_wholes.append([*(d if factored else [d]), *(_whole(state[k]) for k in rule._owner_state)])
        else:
            out_wholes.append(None)
        into.append(lambda it=it: _receive(rule, it, it.param.dtype if own else d_dtype, ns, factored))
    got = ex.from_owners(indices, out_wholes, back_keys, into)
    del out_wholes
    out = []
    for it, s, parts in zip(members, scales, got, strict=True):
        n = 3 if factored else 1
        if own and parts[0] is not it.param:  # the stepped weight (a DDP owner's is its own, stepped in place)
            it.param.copy_(parts[0])
        D = (transfer.apply(parts[0], parts[1][:, None], parts[2][None, :], rule.factors_divide) if factored
             else parts[0])
        for k, t in zip(rule._owner_state, parts[n:], strict=True):
            mine = _whole(it.state[k])
            if t is not mine:
                local(it.state[k]).copy_(t)
        if not own:
            out.append((it.param, D, 1.0 if fold else s[0]))
    return out


def _receive(rule: Any, it: Item, d_dtype: torch.dtype, ns: torch.dtype, factored: bool) -> list[Tensor]:
    """Where a rank receives its piece of a unit's results: ``D`` in ``d_dtype``, or ``U`` in the Newton-Schulz
    dtype with the factors of its rows and columns (in ``d_dtype``), then the per-matrix state the rule changed."""
    p = it.param
    parts = ([torch.empty(p.shape, dtype=ns, device=p.device),
              *(torch.empty(p.shape[d], dtype=d_dtype, device=p.device) for d in AXES.values())]
             if factored else [torch.empty(p.shape, dtype=d_dtype, device=p.device)])
    return parts + [torch.empty_like(local(it.state[k])) for k in rule._owner_state]


def _whole(t: Any) -> Any:
    return local(t) if is_dtensor(t) else t


def _assemble(unit: Unit, X: Tensor, ds: list[Tensor], scales: list[float], fold: bool, dtype: torch.dtype) -> Tensor:
    """A unit's whole direction from its matrices' (the view's, in :meth:`Layout.matrices` order), in ``dtype``,
    the step multipliers folded in where they differ; a plain matrix's direction is its own."""
    if unit.layout is None and ds[0].dtype == dtype:
        return ds[0].reshape(X.shape)
    D = torch.empty(X.shape, dtype=dtype, device=X.device)
    views = unit.layout.matrices(D) if unit.layout is not None else [D.view(matrix_shape(D.shape))]
    for v, d, s in zip(views, ds, scales, strict=True):
        v.copy_(d * s if fold else d)
    return D


def _elementwise_bucket(rule: Any, members: list[Item], group: dict, ctx: StepContext,
                        x_of: Callable[[Item], Tensor]) -> list:
    """An elementwise momentum rule's pieces whose statistics need more than sums over rows (eq. 9 on a
    tensor-parallel ``Shard(1)`` embedding): ``X`` out, :meth:`MomentumRule.direction` of each whole matrix at
    its owner, ``D`` back."""
    ex: Exchange = ctx.split  # type: ignore[assignment]
    indices = [it.index for it in members]
    x_dtype, d_dtype = _dtypes(rule, group, members[0].param, ctx, False)
    wholes = ex.to_owners(indices, [[x_of(it).to(x_dtype)] for it in members], [["param"]] * len(members))
    out_wholes = []
    for i, ws in zip(indices, wholes, strict=True):
        if ws is None:
            out_wholes.append(None)
            continue
        X = ws[0]
        layout = ex.units[i].layout
        D = torch.empty(X.shape, dtype=d_dtype, device=X.device)
        for x, d in zip(*((layout.matrices(X), layout.matrices(D)) if layout is not None else ([X], [D])),
                        strict=True):
            x = x.reshape(matrix_shape(x.shape)) if needs_matrix(rule) else x
            d.copy_(rule.direction(x.contiguous().to(F.stat_dtype(x))[None], group, None, tuple(x.shape))[0]
                    .reshape(d.shape))
        out_wholes.append([D])
    got = ex.from_owners(indices, out_wholes, [["param"]] * len(members),
                         [lambda it=it: [torch.empty(it.param.shape, dtype=d_dtype, device=it.param.device)]
                          for it in members])
    return [(it.param, parts[0], 1.0) for it, parts in zip(members, got, strict=True)]


def _buckets(ex: Exchange, rule: Any, items: list[Item], batched: bool) -> list[Bucket]:
    """The exchange's shape buckets of a call: one exchange out and one back each, so a step holds one bucket's
    whole matrices at a time. DDP's matrices as one process's batched form buckets them (an ``(n, m)`` matrix in
    the ``(m, n)`` bucket, which saves an exchange; the owners stack each orientation apart); a DTensor's units by
    their global shape."""
    transpose = batched and isinstance(rule, HiddenRule) and rule.transposes and all(
        isinstance(ex.units[it.index].pieces, Replicas) for it in items)
    return make_buckets(items, matrix=True, transpose=transpose)


def _step(calls: Sequence[Call], batched: bool, orth: Callable | None) -> None:
    """The calls' directions through the exchange, bucket by bucket, each rank's pieces applied as one process's:
    momentum and direction inputs where the pieces lie (``driver.input_makers``, the forms' first phase)."""
    for (rule, items, group, ctx), x_of in zip(calls, input_makers(calls, batched=batched), strict=True):
        pending = []
        for b in _buckets(ctx.split, rule, list(items), batched):
            if isinstance(rule, HiddenRule):
                pending += _hidden_bucket(rule, b, group, ctx, batched=batched, x_of=x_of, orth=orth)
            else:
                pending += _elementwise_bucket(rule, b.items, group, ctx, x_of)
        apply_pending(pending, group)


def per_tensor(calls: Sequence[Call], orth: Callable | None = None) -> None:
    """``foreach=False`` through the exchange: momentum one fused pass per tensor and each direction input made
    as its bucket goes out, as one process's per-tensor form; at the owners each matrix alone."""
    _step(calls, False, orth)


def batched(calls: Sequence[Call], orth: Callable | None = None) -> None:
    """``foreach=True`` through the exchange: momentum and direction inputs in ``torch._foreach_*`` kernels, as
    the one-process batched form; at the owners one stack per shape, all in one body."""
    _step(calls, True, orth)


def whole_step(rule: SteppingRule, items: Sequence[Item], group: dict, ctx: StepContext, foreach: bool) -> None:
    """A stepping rule whose statistics need whole tensors (SCALE's column and row rules on pieces that are not
    whole rows): parameter, gradient and sharded state to the owner, the rule's own step there on whole tensors
    made for this step, the new parameter and state pieces back."""
    ex: Exchange = ctx.split  # type: ignore[assignment]
    indices = [it.index for it in items]
    keys, pieces = [], []
    for it, i in zip(items, indices, strict=True):
        sharded = list(ex.units[i].state_pieces)
        keys.append(["param", "param", *sharded])
        pieces.append([it.param, it.grad, *(local(it.state[k]) for k in sharded)])
    wholes = ex.to_owners(indices, pieces, keys)
    at_owner, states = [], []
    for it, ws, ks in zip(items, wholes, keys, strict=True):
        if ws is None:
            states.append(None)
            continue
        state = {k: (ws[ks.index(k)] if k in ks[2:] else _whole(v)) for k, v in it.state.items()}
        layout = ex.units[it.index].layout
        at_owner += ([Item(ws[0], ws[1], state, it.name, it.shape, it.kind)] if layout is None else
                     cut_items(rule, layout, ws[0], ws[1], state, it.name, it.kind, layout.labels()))
        states.append(state)
    if at_owner:
        (rule.step_foreach if foreach else rule.step)(at_owner, group, ctx)
    names = [[k for k in sorted(it.state) if isinstance(it.state[k], Tensor)] for it in items]
    out_wholes = [None if st is None else [ws[0], *(st[k] for k in ns)]
                  for ws, st, ns in zip(wholes, states, names, strict=True)]
    back_keys = [["param", *(k if k in ex.units[i].state_pieces else None for k in ns)]
                 for i, ns in zip(indices, names, strict=True)]
    got = ex.from_owners(indices, out_wholes, back_keys,
                         [lambda it=it, ns=ns: [torch.empty_like(it.param), *(torch.empty_like(_whole(it.state[k]))
                                                                               for k in ns)]
                          for it, ns in zip(items, names, strict=True)])
    for it, ns, parts in zip(items, names, got, strict=True):
        it.param.copy_(parts[0])
        for k, t in zip(ns, parts[1:], strict=True):
            _whole(it.state[k]).copy_(t)
