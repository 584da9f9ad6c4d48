"""Every DTensor layout: each rank's piece of a matrix, whole matrices at owner ranks, directions back.

FSDP2's and HSDP's row shards of whole matrices take the bucketed row exchange of ``sharded.py``. Every
other layout that torch's parallel APIs give a transformer -- tensor parallelism's ``Shard(0)`` (colwise)
and ``Shard(1)`` (rowwise) on a TP mesh, FSDP2 over TP on a 2-D mesh (``(_StridedShard(0, sf), Shard(0))``,
``(Shard(0), Shard(1))``, ``(Shard(0), Replicate())``), vocabulary-parallel embeddings and heads, and FSDP2
row shards of matrices whose view needs rows of several shards (a fused projection's split, ``Conv1D``'s
transpose, folded experts) -- goes here (``placement.PIECES``):

1. each parameter has one owner (longest-first by Newton-Schulz cost, fixed when the step is planned,
   identical on every rank: :func:`distributed.assign_owners`); where the placements repeat the tensor over
   some mesh dimensions (``Replicate()``), each replica group has its own owner and exchanges only inside
   itself (HSDP moves bytes only inside a shard group), as FSDP2's row path repeats the work per replica;
2. a momentum rule's momentum (and any elementwise state) stays sharded exactly as the parameter and is
   updated where it lies; each rank sends only its piece of the direction input ``X`` -- in the
   Newton-Schulz dtype for a hidden rule that keeps the default ``pre`` -- to the owner, by one
   ``all_to_all_single`` for all parameters;
3. the owner puts the pieces together as the whole matrix and runs the one-process body on it
   (:func:`driver.directions`: ``pre``, Newton-Schulz and ``post`` on whole matrices, so every statistic --
   eq. 8's CVs, NorMuon's row moments -- is the whole matrix's; an elementwise momentum rule's ``direction``),
   and a second ``all_to_all_single`` returns every rank its piece of the direction ``D`` with the small
   per-matrix state the rule changed (counters, per-row moments);
4. each rank applies ``W <- (1 - lr wd) W - lr s D`` to its own piece.

Per rank that is the floor: the pieces of ``X`` out once, the pieces of ``D`` back once, plus the per-matrix
state (``1 / cols`` of that). A :class:`~meqmuon.optim.rule.SteppingRule` that is not elementwise (SCALE's
column and row rules) computes from its whole state: it keeps the whole-tensor fallback, which sends the
parameter, gradient and state pieces out and the new parameter and state pieces back, into whole tensors
made for the step and freed after it.

Nothing is kept between steps but the state: where a piece lies is a :class:`Pieces` descriptor, runs of
global indices per dimension for every rank, computed on every rank from the placements by torch's own
splitting (``Shard._split_tensor``, ``_StridedShard._split_tensor``, uneven and empty shards included) with
no collective, so planning also runs on torch's fake process group. Megatron-LM's proposed
``layer_sharded`` mode (NVIDIA/Megatron-LM#6683) sends Newton-Schulz inputs to a home rank the same way;
microsoft/dion's ``megabatch_base.py`` does it for row shards; torchtitan's DistMuon rejects these layouts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .distributed import assign_owners, is_dtensor

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]
    DTensor = Replicate = Shard = _StridedShard = None  # type: ignore[assignment,misc]

__all__ = ["OwnerPlan", "Pieces", "is_replicated", "piece_runs"]

#: Per dimension, the runs ``(start, stop)`` of global indices a piece covers, in the local order.
Runs = tuple[tuple[tuple[int, int], ...], ...]


def is_replicated(t: Tensor) -> bool:
    """A DTensor that every rank holds whole (``Replicate()`` on every mesh dimension)."""
    return is_dtensor(t) and all(p.is_replicate() for p in t.placements)


def _world_of(t: Tensor, name: str) -> None:
    """The owner path exchanges over the default group, which ``t``'s mesh must span."""
    world = dist.get_world_size()
    if t.device_mesh.size() != world:
        raise NotImplementedError(
            f"{name}: placements {tuple(t.placements)} on a mesh of {t.device_mesh.size()} of the {world} ranks; "
            "the optimizer gathers whole matrices over the default process group, so the parameters' mesh must "
            "span every rank (build the optimizer inside the process group of that mesh, or use one mesh)")


def _runs(idx: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


def piece_runs(shape: Sequence[int], placements: Sequence[Any], mesh_sizes: Sequence[int],
               coordinate: Sequence[int]) -> Runs:
    """Where the piece of the rank at mesh ``coordinate`` lies in a tensor of global ``shape`` under
    ``placements``: per dimension, runs of global indices, read off torch's own split of each mesh dimension in
    mesh order (what ``distribute_tensor`` and FSDP2 do), applied to the indices of that dimension. ``O(sum of
    shape)`` work, no collective."""
    out = []
    for d, size in enumerate(shape):
        idx = torch.arange(size)
        for i, p in enumerate(placements):
            if _StridedShard is not None and isinstance(p, _StridedShard):
                if p.dim != d:
                    continue
                one = _StridedShard(0, split_factor=p.split_factor)
            elif isinstance(p, Shard):
                if p.dim != d:
                    continue
                one = Shard(0)
            elif p.is_replicate():
                continue
            else:
                raise NotImplementedError(f"placement {p} of a parameter: the optimizer knows Shard, _StridedShard "
                                          "and Replicate")
            chunks = one._split_tensor(idx, mesh_sizes[i], with_padding=False)[0]
            idx = chunks[coordinate[i]] if coordinate[i] < len(chunks) else idx[:0]
        out.append(_runs(idx.tolist()))
    return tuple(out)


class Pieces:
    """Where every rank's piece of a DTensor layout lies (:func:`piece_runs`), and who exchanges with whom.

    ``owner_for(r, o)``: the rank that computes for rank ``r`` a tensor whose owner is ``o``: ``o``'s
    coordinates on the mesh dimensions that shard, ``r``'s on those that replicate (each replica group has its
    own owner). Plain Python numbers: a few runs per rank.
    """

    __slots__ = ("shape", "runs", "coords", "ranks", "replicated_dims")

    def __init__(self, t: Tensor) -> None:
        mesh = t.device_mesh
        ranks = mesh.mesh.reshape(-1).tolist()
        sizes = tuple(mesh.mesh.shape)
        world = dist.get_world_size()
        self.shape = tuple(t.shape)
        self.coords: list[tuple[int, ...]] = [()] * world
        self.ranks: dict[tuple[int, ...], int] = {}
        for flat, r in enumerate(ranks):
            c = tuple(int(x) for x in torch.unravel_index(torch.tensor(flat), sizes))
            self.coords[r] = c
            self.ranks[c] = r
        self.replicated_dims = tuple(i for i, p in enumerate(t.placements) if p.is_replicate())
        self.runs: list[Runs] = [piece_runs(t.shape, t.placements, sizes, self.coords[r]) for r in range(world)]

    def owner_for(self, r: int, owner: int) -> int:
        c = list(self.coords[owner])
        for i in self.replicated_dims:
            c[i] = self.coords[r][i]
        return self.ranks[tuple(c)]

    def numel(self, r: int) -> int:
        return math.prod(sum(b - a for a, b in runs) for runs in self.runs[r])

    def boxes(self, r: int) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """Rank ``r``'s piece as boxes: ``(global slices, local slices)``, one per combination of runs."""
        per_dim = []
        for runs in self.runs[r]:
            start, dim = 0, []
            for a, b in runs:
                dim.append((slice(a, b), slice(start, start + b - a)))
                start += b - a
            per_dim.append(dim)
        return [(tuple(g for g, _ in combo), tuple(loc for _, loc in combo)) for combo in itertools.product(*per_dim)]

    def local_shape(self, r: int) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in runs) for runs in self.runs[r])

    def take(self, whole: Tensor, r: int) -> Tensor:
        """Rank ``r``'s piece of ``whole`` (a tensor of the global shape), contiguous."""
        boxes = self.boxes(r)
        if len(boxes) == 1:
            return whole[boxes[0][0]].contiguous()
        out = torch.empty(self.local_shape(r), dtype=whole.dtype, device=whole.device)
        for g, loc in boxes:
            out[loc].copy_(whole[g])
        return out

    def put(self, whole: Tensor, r: int, piece: Tensor) -> None:
        """Write rank ``r``'s ``piece`` into ``whole``."""
        piece = piece.view(self.local_shape(r))
        for g, loc in self.boxes(r):
            whole[g].copy_(piece[loc])


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _as(piece: Tensor, dtype: torch.dtype) -> Tensor:
    """Received bytes as ``dtype`` (copied first where the bytes before them leave them unaligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    return (piece if piece.storage_offset() % size == 0 else piece.clone()).view(dtype)


class Owned:
    """One parameter on the owner path: its tensors, its owner, the descriptors of its layouts."""

    __slots__ = ("param", "state", "owner", "pieces", "state_pieces")

    def __init__(self, param: Tensor, state: dict[str, Any], owner: int, cache: dict) -> None:
        self.param, self.state, self.owner = param, state, owner
        self.pieces = _pieces(param, cache)
        #: Sharded state tensors (not held whole by every rank): their descriptors, by key.
        self.state_pieces = {k: _pieces(v, cache) for k, v in sorted(state.items())
                             if is_dtensor(v) and not is_replicated(v)}


def _pieces(t: Tensor, cache: dict) -> Pieces:
    key = (tuple(t.shape), tuple(t.placements), id(t.device_mesh))
    if key not in cache:
        cache[key] = Pieces(t)
    return cache[key]


class OwnerPlan:
    """The owner path of one optimizer's plan: the owner of each parameter and the exchanges, no collective.

    ``params`` (DTensors) with their ``states`` and ``costs`` (for balancing owners). Every rank builds the
    plan for the same parameters in the same order, as every rank steps the same parameters (the DDP contract).
    """

    def __init__(self, params: Sequence[Tensor], states: Sequence[dict[str, Any]], costs: Sequence[float],
                 names: Sequence[str]) -> None:
        for p, name in zip(params, names, strict=True):
            _world_of(p, name)
        self.rank = dist.get_rank() if params else 0
        self.world = dist.get_world_size() if params else 1
        owners = assign_owners(list(costs), [0.0] * self.world)
        cache: dict = {}
        self.owned = [Owned(p, st, o, cache) for p, st, o in zip(params, states, owners, strict=True)]

    def owner_of(self, index: int, r: int | None = None) -> int:
        """The rank that computes parameter ``index`` for rank ``r`` (default: this one)."""
        o = self.owned[index]
        return o.pieces.owner_for(self.rank if r is None else r, o.owner)

    def mine(self, index: int) -> bool:
        return self.owner_of(index) == self.rank

    def senders(self, index: int) -> list[int]:
        """The ranks whose pieces this rank, an owner of ``index``, puts together (its replica group)."""
        return [r for r in range(self.world) if self.owner_of(index, r) == self.rank]

    # ---- the two exchanges ------------------------------------------------------------------------

    def to_owners(self, indices: Sequence[int], pieces: Sequence[Sequence[Tensor]],
                  wholes: Sequence[Sequence[Tensor | None]], keys: Sequence[Sequence[str]]) -> None:
        """One ``all_to_all_single``: every rank's ``pieces[j]`` (local pieces, in ``keys[j]``'s layouts:
        ``"param"`` or a state key) of parameter ``indices[j]`` go to its owner, which writes them into
        ``wholes[j]`` (tensors of the global shapes, ``None`` on the other ranks)."""
        send: list[list[Tensor]] = [[] for _ in range(self.world)]
        for i, ps in zip(indices, pieces, strict=True):
            send[self.owner_of(i)] += [_bytes(p) for p in ps]
        sizes: list[list[int]] = [[] for _ in range(self.world)]
        mine = [(i, ws, ks) for i, ws, ks in zip(indices, wholes, keys, strict=True) if self.mine(i)]
        for i, ws, ks in mine:
            for r in self.senders(i):
                sizes[r] += [self._descriptor(i, k).numel(r) * w.element_size() for k, w in zip(ks, ws, strict=True)]
        recv = self._exchange(send, sizes)
        for r in range(self.world):
            got = iter(recv[r])
            for i, ws, ks in mine:
                if r in self.senders(i):
                    for k, w in zip(ks, ws, strict=True):
                        self._descriptor(i, k).put(w, r, _as(next(got), w.dtype))

    def from_owners(self, indices: Sequence[int], wholes: Sequence[Sequence[Tensor | None]],
                    keys: Sequence[Sequence[str | None]], into: Sequence[Sequence[Tensor]]) -> None:
        """The way back, one ``all_to_all_single``: owners send every rank of their replica group its pieces
        of ``wholes[j]`` (key ``None``: the tensor whole), which it copies into ``into[j]`` (its local tensors,
        in the same order)."""
        send: list[list[Tensor]] = [[] for _ in range(self.world)]
        for i, ws, ks in zip(indices, wholes, keys, strict=True):
            if self.mine(i):
                for r in self.senders(i):
                    send[r] += [_bytes(w if k is None else self._descriptor(i, k).take(w, r))
                                for k, w in zip(ks, ws, strict=True)]
        sizes: list[list[int]] = [[] for _ in range(self.world)]
        for i, ts in zip(indices, into, strict=True):
            sizes[self.owner_of(i)] += [t.numel() * t.element_size() for t in ts]
        recv = self._exchange(send, sizes)
        got = [iter(x) for x in recv]
        for i, ts in zip(indices, into, strict=True):
            src = got[self.owner_of(i)]
            for t in ts:
                t.copy_(_as(next(src), t.dtype).view(t.shape))

    def _descriptor(self, index: int, key: str) -> Pieces:
        o = self.owned[index]
        return o.pieces if key == "param" else o.state_pieces[key]

    def _exchange(self, send: list[list[Tensor]], sizes: list[list[int]]) -> list[list[Tensor]]:
        """One ``all_to_all_single`` of bytes: ``send[r]`` to rank ``r``; ``sizes[r]`` the byte sizes of the
        pieces rank ``r`` sends here. Returns the received pieces per source rank (views of one buffer)."""
        device = self.owned[0].param.device if self.owned else torch.device("cpu")
        flat = [torch.cat(s) if s else torch.empty(0, dtype=torch.uint8, device=device) for s in send]
        out_splits = [sum(s) for s in sizes]
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        dist.all_to_all_single(out, torch.cat(flat), out_splits, [f.numel() for f in flat])
        recv, start = [], 0
        for r in range(self.world):
            pieces = []
            for n in sizes[r]:
                pieces.append(out[start : start + n])
                start += n
            recv.append(pieces)
        return recv


# ---- the step of the owner path -------------------------------------------------------------------------


class Job:
    """One parameter with a gradient on the owner path in this step: its plan index, tensors, rule, layout,
    its param group (with the step's float hyperparameters), whether the rule sees each matrix of its view
    (``cut``), whether its group takes the per-tensor form (``fused`` momentum), its call's context."""

    __slots__ = ("index", "param", "grad", "state", "rule", "layout", "group", "cut", "fused", "ctx", "name")

    def __init__(self, index, param, grad, state, rule, layout, group, cut, fused, ctx, name) -> None:
        self.index, self.param, self.grad, self.state, self.rule, self.layout = index, param, grad, state, rule, layout
        self.group, self.cut, self.fused, self.ctx, self.name = group, cut, fused, ctx, name


def _local_grad(job: Job) -> Tensor:
    g = job.grad
    if is_dtensor(g) and tuple(g.placements) != tuple(job.param.placements):  # Partial() under TP
        g = g.redistribute(g.device_mesh, job.param.placements)
    return g.to_local() if is_dtensor(g) else g


def _scales(job: Job) -> list[float]:
    """A hidden rule's step multiplier of every matrix of the view; the elementwise rules fold theirs in."""
    from .driver import HiddenRule

    if not isinstance(job.rule, HiddenRule):
        return [1.0]
    return [job.rule.lr_scale(r, c, job.group) for r, c in job.layout.shapes()]


def _dtypes(job: Job) -> tuple[torch.dtype, torch.dtype]:
    """What travels: the direction input (the Newton-Schulz dtype where the rule keeps the default ``pre``,
    else at least float32, as ``pre`` and the elementwise rules compute) and the direction (at least the
    parameter's dtype, so that the update adds what one process adds)."""
    from .. import functional as F
    from .driver import HiddenRule, resolve_dtype

    p = job.param.to_local()
    hidden = isinstance(job.rule, HiddenRule)
    out = resolve_dtype(job.group, p, job.ctx) if hidden and not job.rule._rewrites_input else F._stat_dtype(p)
    return out, torch.promote_types(out, p.dtype)


def directions_at_owners(plan: OwnerPlan, jobs: Sequence[Job]) -> None:
    """The momentum rules' step on the owner path: momentum where it lies, ``X`` out, whole-matrix
    directions at owners (:func:`_whole_direction`), ``D`` and the per-matrix state back, each rank's update."""
    from .. import functional as F

    if not jobs:
        return
    keys, pieces, wholes, backs = [], [], [], []
    for job in jobs:
        b = job.state["momentum_buffer"].to_local()
        g = _local_grad(job)
        g = g if g.dtype == b.dtype else g.to(b.dtype)
        F.momentum_([b], [g], job.group["momentum"], fused=job.fused)
        x_dtype, d_dtype = _dtypes(job)
        X = F.direction_input([g], [b], job.group["momentum"], job.group["nesterov"])[0].to(x_dtype)
        o = plan.owned[job.index]
        sharded = [k for k in job.rule._owner_state if k in o.state_pieces]
        keys.append(["param", *sharded])
        pieces.append([X, *(job.state[k].to_local() for k in sharded)])
        mine = plan.mine(job.index)
        wholes.append([torch.empty(job.param.shape, dtype=x_dtype, device=X.device),
                       *(torch.empty(job.state[k].shape, dtype=job.state[k].dtype, device=X.device) for k in sharded)]
                      if mine else [None] * len(keys[-1]))
        backs.append(d_dtype)
    plan.to_owners([j.index for j in jobs], pieces, wholes, keys)
    out_wholes, out_keys, into = [], [], []
    for job, ws, ks, d_dtype in zip(jobs, wholes, keys, backs, strict=True):
        owner_keys = job.rule._owner_state
        state = {k: (ws[ks.index(k)] if k in ks else _whole_state(job.state[k])) for k in owner_keys}
        D = _whole_direction(job, ws[0], state, d_dtype) if ws[0] is not None else None
        ws[0] = None  # X is let go as soon as its direction exists
        out_wholes.append([D, *(state[k] for k in owner_keys)])
        out_keys.append(["param", *(k if k in ks else None for k in owner_keys)])
        local = job.param.to_local()
        into.append([torch.empty(local.shape, dtype=d_dtype, device=local.device),
                     *(job.state[k].to_local() if is_dtensor(job.state[k]) else job.state[k] for k in owner_keys)])
    plan.from_owners([j.index for j in jobs], out_wholes, out_keys, into)
    del out_wholes
    for job, (D, *_) in zip(jobs, into, strict=True):
        scales = _scales(job)
        s = scales[0] if len(set(scales)) == 1 else 1.0
        F.decay_and_update_([job.param.to_local()], [D], job.group["lr"], job.group["weight_decay"], [s])


def _whole_state(t: Any) -> Any:
    return t.to_local() if is_dtensor(t) else t


def _whole_direction(job: Job, X: Tensor, state: dict[str, Tensor], dtype: torch.dtype) -> Tensor:
    """At the owner: the direction of the whole ``X`` (the parameter's global shape) by the one-process body,
    matrix by matrix of the view as the per-tensor form (``driver._hidden_eager``); ``state`` (whole per-matrix
    state) updated in place. A view whose matrices have different step multipliers gets them folded in."""
    from .. import functional as F
    from .driver import HiddenRule, directions, matrix_shape, needs_matrix

    rule, layout, group = job.rule, job.layout, job.group
    if job.ctx.capture is not None:
        job.ctx.capture(job.name, job.ctx.kind, "momentum_input", X)
    D = torch.empty(X.shape, dtype=dtype, device=X.device)
    if not isinstance(rule, HiddenRule):
        xs, ds = (layout.matrices(X), layout.matrices(D)) if job.cut else ([X], [D])
        for x, d in zip(xs, ds, strict=True):
            x = x.reshape(matrix_shape(x.shape)) if needs_matrix(rule) else x
            y = rule.direction(x.contiguous().to(F._stat_dtype(x))[None], group, None, tuple(x.shape))
            d.copy_(y[0].reshape(d.shape))
        return D
    scales = _scales(job)
    fold = len(set(scales)) > 1
    cut = {"rows": layout.row_pieces, "counter": layout.counters}
    per_key = {k: cut[how](state[k]) for k, how in rule.state_views.items() if how in cut}
    steps = [k for k, how in rule.state_views.items() if how == "step"]
    scratch: dict = {}
    for j, (x, d) in enumerate(zip(layout.matrices(X), layout.matrices(D), strict=True)):
        st = {k: v[j][None] for k, v in per_key.items()}
        st.update({k: F.on_device([job.state["step"]], X.device) for k in steps})
        ((u,),) = directions(rule, [(x.contiguous()[None], 1, st)], group, job.ctx, batched=False, scratch=scratch)
        d.copy_(u[0] * scales[j] if fold else u[0])
    return D


def gather_whole(plan: OwnerPlan, jobs: Sequence[Job]) -> list[tuple[Tensor, Tensor, dict[str, Any]] | None]:
    """The whole-tensor fallback (a stepping rule that is not elementwise: SCALE's column and row rules): the
    parameter, gradient and sharded state pieces to the owner, into whole tensors made for this step. Returns
    per job, at its owner, ``(param, grad, state)`` whole (the state's other tensors are whole already)."""
    keys, pieces, wholes = [], [], []
    for job in jobs:
        o = plan.owned[job.index]
        g = _local_grad(job)
        sharded = list(o.state_pieces)
        keys.append(["param", "param", *sharded])
        pieces.append([job.param.to_local(), g, *(job.state[k].to_local() for k in sharded)])
        like = [job.param.to_local(), g, *(job.state[k].to_local() for k in sharded)]
        shapes = [job.param.shape, job.param.shape, *(job.state[k].shape for k in sharded)]
        wholes.append([torch.empty(s, dtype=t.dtype, device=t.device) for s, t in zip(shapes, like, strict=True)]
                      if plan.mine(job.index) else [None] * len(keys[-1]))
    plan.to_owners([j.index for j in jobs], pieces, wholes, keys)
    out = []
    for job, ws, ks in zip(jobs, wholes, keys, strict=True):
        if ws[0] is None:
            out.append(None)
            continue
        state = {k: (ws[ks.index(k)] if k in ks[2:] else _whole_state(v)) for k, v in job.state.items()}
        out.append((ws[0], ws[1], state))
    return out


def scatter_whole(plan: OwnerPlan, jobs: Sequence[Job], wholes: Sequence[tuple | None]) -> None:
    """The fallback's way back: every rank's piece of the new parameter and of the state tensors."""
    out_wholes, out_keys, into = [], [], []
    for job, w in zip(jobs, wholes, strict=True):
        o = plan.owned[job.index]
        names = [k for k in sorted(job.state) if isinstance(job.state[k], Tensor)]
        out_keys.append(["param", *(k if k in o.state_pieces else None for k in names)])
        out_wholes.append([w[0], *(w[2][k] for k in names)] if w is not None else [None] * (1 + len(names)))
        into.append([job.param.to_local(), *(_whole_state(job.state[k]) for k in names)])
    plan.from_owners([j.index for j in jobs], out_wholes, out_keys, into)
