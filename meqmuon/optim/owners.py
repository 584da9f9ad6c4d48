"""Where each rank's piece of a tensor lies: the descriptors of the exchange (``exchange.py``).

The exchange sends each rank's piece of a matrix to the matrix's owner and each rank's piece of the result
back. Where a piece lies is a descriptor, read off the layout on every rank with no collective (planning also
runs on torch's fake process group) and kept for the optimizer's life; nothing else is kept between steps:

- :class:`Pieces`: a DTensor under any placements torch's parallel APIs give a transformer -- FSDP2's and
  HSDP's row shards, tensor parallelism's ``Shard(0)`` (colwise) and ``Shard(1)`` (rowwise), FSDP2 over TP on a
  2-D mesh (``(_StridedShard(0, sf), Shard(0))``, ``(Shard(0), Shard(1))``, ``(Shard(0), Replicate())``),
  vocabulary-parallel embeddings and heads, uneven and empty shards: runs of global indices per dimension for
  every rank, by torch's own splitting (``Shard._split_tensor``, ``_StridedShard._split_tensor``). Where the
  placements repeat the tensor over some mesh dimensions (``Replicate()``), each replica group has its own
  owner and exchanges only inside itself (HSDP moves bytes only inside a shard group).
- :class:`Replicas`: a plain tensor under DDP, whole on every rank: the owner computes from its own copy and
  every other rank receives the result whole.

Megatron-LM's proposed ``layer_sharded`` mode (NVIDIA/Megatron-LM#6683) sends Newton-Schulz inputs to a home rank
the same way; microsoft/dion's ``megabatch_base.py`` does it for row shards; torchtitan's DistMuon rejects the
layouts that are not row shards.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .distributed import is_dtensor

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]
    DTensor = Replicate = Shard = _StridedShard = None  # type: ignore[assignment,misc]

__all__ = ["AXES", "Pieces", "Replicas", "check_mesh", "descriptor", "is_replicated", "piece_runs"]

#: Keys of vectors along one dimension of the parameter (:meth:`Pieces.along`): each rank's piece of one is the
#: entries of the rows (columns) its piece of the parameter covers; eq. 8's row and column factors travel so.
AXES = {"param:rows": 0, "param:cols": 1}

#: Per dimension, the runs ``(start, stop)`` of global indices a piece covers, in the local order.
Runs = tuple[tuple[tuple[int, int], ...], ...]


def is_replicated(t: Tensor) -> bool:
    """A DTensor that every rank holds whole (``Replicate()`` on every mesh dimension)."""
    return is_dtensor(t) and all(p.is_replicate() for p in t.placements)


def spanning(t: Tensor) -> tuple[Any, tuple[Any, ...]]:
    """``t``'s mesh and placements, or where its mesh is a sub-mesh of named dimensions of a larger one (FSDP2 on
    ``mesh["dp"]`` of a module tensor parallelism left alone), that larger mesh with ``Replicate()`` on the
    dimensions ``t`` is not on: every rank of the larger mesh holds the piece of its coordinates on the others."""
    mesh = t.device_mesh
    root = mesh._get_root_mesh()  # torch has no public name for it yet (torchtitan reads it so too)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if root is mesh or not names or not root_names or not set(names) <= set(root_names):
        return mesh, tuple(t.placements)
    by_name = dict(zip(names, t.placements, strict=True))
    return root, tuple(by_name.get(n, Replicate()) for n in root_names)


def check_mesh(t: Tensor, name: str) -> None:
    """The exchange runs over the default group, which ``t``'s mesh (or the mesh it is a sub-mesh of,
    :func:`spanning`) must span."""
    world = dist.get_world_size()
    if spanning(t)[0].size() != world:
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
    mesh order (what ``distribute_tensor`` and FSDP2 do), applied to the indices of that dimension. No collective.
    While only ``Shard`` (``torch.chunk``'s contiguous chunks: ``ceil(n / k)`` each, the last ones shorter or empty)
    has split a dimension its indices are one run, computed from the sizes; a ``_StridedShard`` takes the indices
    themselves through torch's own split, ``O(size)`` (planning 405B on 1,024 ranks took 28 s with every dimension
    through it, 9.6 s with the runs)."""
    out = []
    for d, size in enumerate(shape):
        lo, hi, idx = 0, size, None  # the indices: range(lo, hi) until a _StridedShard splits them
        for i, p in enumerate(placements):
            if _StridedShard is not None and isinstance(p, _StridedShard):
                if p.dim != d:
                    continue
                one = _StridedShard(0, split_factor=p.split_factor)
            elif isinstance(p, Shard):
                if p.dim != d:
                    continue
                if idx is None:
                    step = -(-(hi - lo) // mesh_sizes[i]) if hi > lo else 0
                    lo = min(lo + coordinate[i] * step, hi)
                    hi = min(lo + step, hi)
                    continue
                one = Shard(0)
            elif p.is_replicate():
                continue
            else:
                raise NotImplementedError(f"placement {p} of a parameter: the optimizer knows Shard, _StridedShard "
                                          "and Replicate")
            idx = torch.arange(lo, hi) if idx is None else idx
            chunks = one._split_tensor(idx, mesh_sizes[i], with_padding=False)[0]
            idx = chunks[coordinate[i]] if coordinate[i] < len(chunks) else idx[:0]
        out.append(_runs(idx.tolist()) if idx is not None else ((lo, hi),) if hi > lo else ())
    return tuple(out)


class Pieces:
    """Where every rank's piece of a DTensor layout lies (:func:`piece_runs`), and who exchanges with whom.

    ``owner_for(r, o)``: the rank that computes for rank ``r`` a tensor whose owner is ``o``: ``o``'s
    coordinates on the mesh dimensions that shard, ``r``'s on those that replicate (each replica group has its
    own owner). Plain Python numbers: a few runs per rank.
    """

    __slots__ = ("shape", "runs", "coords", "ranks", "replicated_dims", "_along", "_shapes", "_one", "_spans",
                 "holders", "_first", "_mirrors")

    def __init__(self, t: Tensor) -> None:
        mesh, placements = spanning(t)
        ranks = mesh.mesh.reshape(-1).tolist()
        sizes = tuple(mesh.mesh.shape)
        world = dist.get_world_size()
        self.coords: list[tuple[int, ...]] = [()] * world
        self.ranks: dict[tuple[int, ...], int] = {}
        for flat, r in enumerate(ranks):
            c = tuple(int(x) for x in torch.unravel_index(torch.tensor(flat), sizes))
            self.coords[r] = c
            self.ranks[c] = r
        self.replicated_dims = tuple(i for i, p in enumerate(placements) if p.is_replicate())
        self._fill(tuple(t.shape), [piece_runs(t.shape, placements, sizes, self.coords[r]) for r in range(world)])

    def _fill(self, shape: tuple[int, ...], runs: list[Runs], holders: tuple[int, ...] | None = None) -> None:
        """The fields a descriptor has of its own (its mesh's, ``coords``, ``ranks``, ``replicated_dims``, its
        sources share), and empty caches."""
        self.shape, self.runs = shape, runs
        #: The ranks that hold a piece, where :meth:`at` made these pieces of a chunk of dimension 0, else None: the
        #: ranks its owner is one of (``shared_ns.assign_within``).
        self.holders = holders
        self._along: dict[int, Pieces] = {}
        self._shapes: frozenset[tuple[int, ...]] | None = None
        self._one: dict | None = None
        self._spans: list[tuple[int, int]] = []
        self._first: tuple[int, ...] | None = None
        self._mirrors: dict[int, list[int]] = {}

    def _derived(self, shape: tuple[int, ...], runs: list[Runs], holders: tuple[int, ...] | None = None) -> Pieces:
        """Pieces of another tensor on the same ranks, with the same owners (:meth:`along`, :meth:`at`)."""
        v = object.__new__(Pieces)
        v.coords, v.ranks, v.replicated_dims = self.coords, self.ranks, self.replicated_dims
        v._fill(shape, runs, holders)
        return v

    def along(self, d: int) -> Pieces:
        """The pieces of a vector of ``shape[d]`` entries, one per index of dimension ``d``: rank ``r``'s is
        the entries of the indices its piece of the tensor covers (``runs[r][d]``, in its local order), with the
        same owners. Made once per descriptor (``O(world)``)."""
        if d not in self._along:
            self._along[d] = self._derived((self.shape[d],), [(runs[d],) for runs in self.runs])
        return self._along[d]

    def whole_along_0(self) -> bool:
        """Every rank's piece holds every index of dimension 0 (a stack of experts sharded on its dimension 1 or 2)."""
        return all(runs[0] == ((0, self.shape[0]),) for runs in self.runs)

    def at(self, e: int) -> Pieces:
        """The pieces of ``t[e]``: rank ``r``'s is its local ``[e - a]`` where its piece of ``t`` holds index ``e`` of
        dimension 0 in one run ``[a, b)`` (its runs ``runs[r][1:]``), else empty (no box), with the same owners. Where
        every rank holds all of dimension 0 (:meth:`whole_along_0`) one descriptor serves every ``e``; else one per
        distinct run of dimension 0 (a ``Shard(0)`` chunk: a stack of experts FSDP2 shards on dimension 0 over ``dp``
        and tensor parallelism on 1 or 2 over ``tp``, torchtitan's experts under TP). Made once each."""
        if self._one is None:
            self._one = {}
            self._spans = [] if self.whole_along_0() else sorted({runs[0][0] for runs in self.runs if runs[0]})
            ends = [i for a, b in self._spans for i in (a, b)]
            if any(len(runs[0]) > 1 for runs in self.runs) or ends != sorted(ends):
                raise NotImplementedError("a stack whose ranks' pieces along dimension 0 are not disjoint contiguous "
                                          "chunks (a _StridedShard on dimension 0) has no unit per matrix: build the "
                                          "optimizer with exchange_unit=\"tensor\" (the whole stack one unit)")
        key = self._spans[bisect.bisect_right(self._spans, (e, math.inf)) - 1] if self._spans else None
        if key not in self._one:
            empty = ((),) * (len(self.shape) - 1)
            self._one[key] = self._derived(
                self.shape[1:], [runs[1:] if key is None or runs[0] == (key,) else empty for runs in self.runs],
                None if key is None else tuple(r for r, runs in enumerate(self.runs) if runs[0] == (key,)))
        return self._one[key]

    def held_along_0(self, r: int) -> tuple[int, int]:
        """The indices ``[a, b)`` of dimension 0 rank ``r``'s piece holds, one run (``(0, 0)``: none)."""
        runs = self.runs[r][0]
        return runs[0] if runs else (0, 0)

    def owner_for(self, r: int, owner: int) -> int:
        c = list(self.coords[owner])
        for i in self.replicated_dims:
            c[i] = self.coords[r][i]
        return self.ranks[tuple(c)]

    def first_group(self) -> tuple[int, ...]:
        """The ranks of the first replica group (coordinate 0 on every mesh dimension that replicates) that hold a
        piece (all of them, where :attr:`holders` is not set): an owner planned among them stands for one in every
        group (:meth:`owner_for`, :meth:`mirrors`). Made once per descriptor (``O(world)``)."""
        if self._first is None:
            held = set(self.holders) if self.holders is not None else None
            self._first = tuple(r for r, c in enumerate(self.coords) if c and (held is None or r in held)
                                and all(c[i] == 0 for i in self.replicated_dims))
        return self._first

    def mirrors(self, owner: int) -> list[int]:
        """The ranks that compute, each in its own replica group, what ``owner`` computes in its group. Made once
        per descriptor and owner."""
        if owner not in self._mirrors:
            kept = [i for i in range(len(self.coords[owner])) if i not in self.replicated_dims]
            self._mirrors[owner] = [r for r, c in enumerate(self.coords) if c and r != owner
                                    and all(c[i] == self.coords[owner][i] for i in kept)]
        return self._mirrors[owner]

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


class Replicas:
    """Where a plain tensor lies under DDP: whole on every rank (each all-reduced its gradient), its Newton-Schulz
    shared among them. The owner computes from its own copy (no piece goes out) and every other rank receives
    the result whole: each direction once to every other rank, the floor of a shared computation."""

    __slots__ = ("shape",)

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)

    def along(self, d: int) -> Replicas:
        return Replicas((self.shape[d],))

    def local_shape(self, r: int) -> tuple[int, ...]:
        return self.shape

    def local_shapes(self) -> frozenset[tuple[int, ...]]:
        return frozenset({self.shape})

    def take(self, whole: Tensor, r: int) -> Tensor:
        return whole


def descriptor(t: Tensor, cache: dict) -> Pieces | Replicas:
    """Where ``t``'s pieces lie: :class:`Pieces` of a DTensor (one per shape, placements and mesh, kept in
    ``cache``), :class:`Replicas` of a plain tensor."""
    if not is_dtensor(t):
        return Replicas(t.shape)
    key = (tuple(t.shape), tuple(t.placements), id(t.device_mesh))
    if key not in cache:
        cache[key] = Pieces(t)
    return cache[key]
