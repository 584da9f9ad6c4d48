"""Every DTensor layout: each rank's piece of a matrix, whole matrices at owner ranks, directions back.

FSDP2's and HSDP's row shards of whole matrices take the row path of ``sharded.py``: this path's exchange
(:func:`distributed.exchange_flat`) and owner assignment (:func:`distributed.assign_owners`, one load per
step shared with this path's, :attr:`OwnerPlan.load`), cut by whole rows per shape bucket. Every other
layout that torch's parallel APIs give a transformer -- tensor parallelism's ``Shard(0)`` (colwise) and
``Shard(1)`` (rowwise) on a TP mesh, FSDP2 over TP on a 2-D mesh (``(_StridedShard(0, sf), Shard(0))``,
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

from .distributed import as_bytes, assign_owners, exchange_bytes, from_bytes, is_dtensor

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]
    DTensor = Replicate = Shard = _StridedShard = None  # type: ignore[assignment,misc]

__all__ = ["AXES", "OwnerPlan", "Pieces", "is_replicated", "piece_runs"]

#: Keys of vectors along one dimension of the parameter (:meth:`Pieces.along`): each rank's piece of one is the
#: entries of the rows (columns) its piece of the parameter covers; eq. 8's row and column factors travel so.
AXES = {"param:rows": 0, "param:cols": 1}

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

    __slots__ = ("shape", "runs", "coords", "ranks", "replicated_dims", "_along", "_shapes")

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
        self._along: dict[int, Pieces] = {}
        self._shapes: frozenset[tuple[int, ...]] | None = None

    def along(self, d: int) -> Pieces:
        """The pieces of a vector of ``shape[d]`` entries, one per index of dimension ``d``: rank ``r``'s is
        the entries of the indices its piece of the tensor covers (``runs[r][d]``, in its local order), with the
        same owners. Made once per descriptor (``O(world)``)."""
        if d not in self._along:
            v = object.__new__(Pieces)
            v.shape, v.coords, v.ranks = (self.shape[d],), self.coords, self.ranks
            v.replicated_dims = self.replicated_dims
            v.runs, v._along, v._shapes = [(runs[d],) for runs in self.runs], {}, None
            self._along[d] = v
        return self._along[d]

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

    def local_shapes(self) -> frozenset[tuple[int, ...]]:
        """The shapes of the ranks' pieces, each once (made once per descriptor)."""
        if self._shapes is None:
            self._shapes = frozenset(self.local_shape(r) for r in range(len(self.runs)))
        return self._shapes

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
        #: Each rank's work planned here: the start of every step's load where the row path (``ShardedSplit``)
        #: runs on the same ranks (the engine shares it), so that one step's owners balance across both paths.
        self.load = [0.0] * self.world
        owners = assign_owners(list(costs), self.load)
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
            send[self.owner_of(i)] += [as_bytes(p) for p in ps]
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
                        self._descriptor(i, k).put(w, r, from_bytes(next(got), w.dtype))

    def from_owners(self, indices: Sequence[int], wholes: Sequence[Sequence[Tensor | None]],
                    keys: Sequence[Sequence[str | None]], into: Sequence[Sequence[Tensor]]) -> None:
        """The way back, one ``all_to_all_single``: owners send every rank of their replica group its pieces
        of ``wholes[j]`` (by ``keys[j]``: ``"param"``, a vector along one of its dimensions, :data:`AXES`, or a
        state key; ``None``: the tensor whole), which it copies into ``into[j]`` (its local tensors, in the
        same order)."""
        send: list[list[Tensor]] = [[] for _ in range(self.world)]
        for i, ws, ks in zip(indices, wholes, keys, strict=True):
            if self.mine(i):
                for r in self.senders(i):
                    send[r] += [as_bytes(w if k is None else self._descriptor(i, k).take(w, r))
                                for k, w in zip(ks, ws, strict=True)]
        sizes: list[list[int]] = [[] for _ in range(self.world)]
        for i, ts in zip(indices, into, strict=True):
            sizes[self.owner_of(i)] += [t.numel() * t.element_size() for t in ts]
        recv = self._exchange(send, sizes)
        got = [iter(x) for x in recv]
        for i, ts in zip(indices, into, strict=True):
            src = got[self.owner_of(i)]
            for t in ts:
                t.copy_(from_bytes(next(src), t.dtype).view(t.shape))

    def _descriptor(self, index: int, key: str) -> Pieces:
        """Where the pieces of ``key`` lie: ``"param"``, a vector along one of its dimensions (:data:`AXES`) or
        a sharded state tensor."""
        o = self.owned[index]
        if key in AXES:
            return o.pieces.along(AXES[key])
        return o.pieces if key == "param" else o.state_pieces[key]

    def _exchange(self, send: list[list[Tensor]], sizes: list[list[int]]) -> list[list[Tensor]]:
        """The row path's exchange (:func:`distributed.exchange_bytes`) over the default group."""
        device = self.owned[0].param.device if self.owned else torch.device("cpu")
        return exchange_bytes(send, sizes, None, device)
