"""Every DTensor layout: whole parameters at owner ranks, the single-process step there.

Row shards of whole matrices take the fast path of ``sharded.py`` (only the Newton-Schulz inputs travel):
FSDP2's ``(Shard(0),)``, HSDP's ``(Replicate(), Shard(0))``, and so also tensor parallelism's colwise
``Shard(0)`` and vocabulary-parallel embeddings and heads on a 1-D TP mesh, whose placements are the same
(``distributed.SHARDED_LAYOUTS``; rows are rows, whatever mesh made them). Every other layout that torch's
parallel APIs give a transformer -- tensor parallelism's rowwise ``Shard(1)``, FSDP2 over TP on a 2-D mesh
(``(_StridedShard(0, sf), Shard(0))``, ``(Shard(0), Shard(1))``, ``(Shard(0), Replicate())``), and row
shards of matrices whose view needs rows of several shards (a fused projection's split, ``Conv1D``'s
transpose, folded experts) -- goes here:

1. each parameter has one owner rank (longest-first by Newton-Schulz cost, fixed when the step is
   planned, identical on every rank: :func:`distributed.assign_owners`);
2. one ``all_to_all_single`` per step sends every rank's local pieces of the parameter, its gradient and
   its state to the owner, which puts them together as whole tensors;
3. the owner runs the optimizer's ordinary single-process step on the whole tensors (per-tensor, batched
   or compiled, any rule and any user variant);
4. a second ``all_to_all_single`` returns every rank's piece of the new parameter and state.

So the update is the one-process update whatever the layout -- bit for bit, since the owner runs the
one-process code on the same whole tensors -- and statistics are always taken over whole matrices.
Megatron-LM's proposed ``layer_sharded`` mode (NVIDIA/Megatron-LM#6683) sends Newton-Schulz inputs to a
home rank the same way; torchtitan's DistMuon rejects these layouts and DeepSpeed's AutoTP
orthogonalises each shard (deepspeedai/DeepSpeed#8437).

Where a piece lies in the whole tensor is read off DTensor itself, once, when the step is planned
(:func:`piece_maps`): every rank wraps the codes ``rank * numel + i`` of its local elements in a DTensor
of the parameter's placements and takes ``full_tensor()``, so the maps follow torch's own semantics of
every placement (``_StridedShard`` included), uneven shards and empty shards. Elements that several
ranks hold (``Replicate()`` mesh dimensions) arrive several times with equal values. The pieces travel as
bytes, so parameters, gradients, float32 state and int64 counters share the one collective.

Cost, against the minimum of sending the Newton-Schulz input and returning the direction: the
parameter, gradient and state go out and the parameter and state come back (about 2.5x the bytes of
the minimum for a momentum rule); the collectives are two per step whatever the depth or the number of
experts (``benchmarks/collectives.py`` counts them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .distributed import assign_owners, is_dtensor

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["OwnerPlan", "is_replicated", "piece_maps"]


def is_replicated(t: Tensor) -> bool:
    """A DTensor that every rank holds whole (``Replicate()`` on every mesh dimension)."""
    return is_dtensor(t) and all(p.is_replicate() for p in t.placements)


def _world_of(t: Tensor, name: str) -> Any:
    """The process group of the owner path: the default group, which ``t``'s mesh must span."""
    world = dist.get_world_size()
    if t.device_mesh.size() != world:
        raise NotImplementedError(
            f"{name}: placements {tuple(t.placements)} on a mesh of {t.device_mesh.size()} of the {world} ranks; "
            "the optimizer gathers whole matrices over the default process group, so the parameters' mesh must "
            "span every rank (build the optimizer inside the process group of that mesh, or use one mesh)")
    return dist.group.WORLD


def piece_maps(t: Tensor) -> list[Tensor]:
    """For every rank ``r`` of the default group: the flat index in the whole tensor of each element of
    ``r``'s local piece of the DTensor ``t``, in the local piece's (row-major) order. A collective.

    Read off DTensor: the codes ``rank * numel + i`` of this rank's elements, put together by
    ``full_tensor()``, say which rank holds each element of the whole (for ``Replicate()`` dimensions:
    a rank of this rank's replica group, this rank among them), so each rank finds where its own elements
    lie; one padded all-gather then gives every rank everyone's map.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    local = t.to_local()
    n = max(math.prod(t.shape), 1)
    code = (rank * n + torch.arange(local.numel(), dtype=torch.int64, device=local.device)).view(local.shape)
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a multi-step all-gather's advice, once per layout while planning
    try:
        whole = DTensor.from_local(code, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                   stride=t.stride()).full_tensor().reshape(-1)
    finally:
        logger.setLevel(level)
    held = torch.nonzero(whole // n == rank).reshape(-1)
    mine = torch.empty(local.numel(), dtype=torch.int64, device=local.device)
    mine[whole[held] % n] = held
    sizes = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor(local.numel(), dtype=torch.int64))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.int64, device=local.device)
    padded[: local.numel()] = mine
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded)
    return [m[: int(s)] for m, s in zip(every, sizes, strict=True)]


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class _Owned:
    """One parameter on the owner path: its owner, its tensors (parameter, then state tensors by key)
    and, at the owner, their whole copies and every rank's maps."""

    __slots__ = ("param", "state", "keys", "owner", "maps", "whole", "whole_state", "whole_grad")

    def __init__(self, param: Tensor, state: dict[str, Any], owner: int) -> None:
        self.param, self.state, self.owner = param, state, owner
        #: State tensors that travel: DTensors as pieces, plain tensors (equal on every rank) whole.
        self.keys = [k for k in sorted(state) if isinstance(state[k], Tensor)]
        self.maps: dict[str, list[Tensor]] = {}
        self.whole: Tensor | None = None
        self.whole_grad: Tensor | None = None
        self.whole_state: dict[str, Any] = {}

    def tensors(self) -> list[tuple[str, Tensor]]:
        return [("param", self.param), *((k, self.state[k]) for k in self.keys)]


class OwnerPlan:
    """The owner path of one optimizer's plan: which rank owns which parameter, and the two exchanges.

    ``params`` (DTensors) with their ``states`` and ``costs`` (for balancing owners). Planning is a
    collective: every rank must build the plan for the same parameters in the same order, as every rank
    steps the same parameters (the DDP contract).
    """

    def __init__(self, params: Sequence[Tensor], states: Sequence[dict[str, Any]], costs: Sequence[float],
                 names: Sequence[str]) -> None:
        self.pg = _world_of(params[0], names[0]) if params else None
        for p, name in zip(params, names, strict=True):
            _world_of(p, name)
        self.rank = dist.get_rank() if params else 0
        self.world = dist.get_world_size() if params else 1
        owners = assign_owners(list(costs), [0.0] * self.world)
        self.owned = [_Owned(p, st, o) for p, st, o in zip(params, states, owners, strict=True)]
        cache: dict[tuple, list[Tensor]] = {}
        for o in self.owned:
            for key, t in o.tensors():
                if not is_dtensor(t):
                    continue
                layout = (tuple(t.shape), tuple(t.placements), id(t.device_mesh), t.device)
                if layout not in cache:
                    cache[layout] = piece_maps(t)
                if o.owner == self.rank:
                    o.maps[key] = cache[layout]
        for o in self.owned:
            if o.owner == self.rank:
                o.whole = torch.empty(o.param.shape, dtype=o.param.dtype, device=o.param.device)
                o.whole_state = {k: (torch.empty(v.shape, dtype=v.dtype, device=v.device) if is_dtensor(v) else v)
                                 for k, v in ((k, o.state[k]) for k in o.keys)}

    def mine(self, index: int) -> bool:
        return self.owned[index].owner == self.rank

    def gather(self, indices: Sequence[int], grads: Sequence[Tensor]) -> None:
        """Whole parameters, gradients and state of ``indices`` (this step's parameters with gradients,
        the same on every rank) at their owners: one ``all_to_all_single``."""
        grads = [g if not is_dtensor(g) or tuple(g.placements) == tuple(self.owned[i].param.placements)
                 else g.redistribute(g.device_mesh, self.owned[i].param.placements)  # e.g. Partial() under TP
                 for i, g in zip(indices, grads, strict=True)]
        send: list[list[Tensor]] = [[] for _ in range(self.world)]
        for i, g in zip(indices, grads, strict=True):
            o = self.owned[i]
            send[o.owner] += [_bytes(o.param.to_local()), _bytes(g.to_local())]
            send[o.owner] += [_bytes(o.state[k].to_local()) for k in o.keys if is_dtensor(o.state[k])]
        mine = [(i, g) for i, g in zip(indices, grads, strict=True) if self.mine(i)]
        # What each rank sends me, in the order it sends it: per owned parameter its pieces' byte sizes.
        sizes = [[] for _ in range(self.world)]
        for i, g in mine:
            o = self.owned[i]
            for r in range(self.world):
                n = len(o.maps["param"][r])
                sizes[r] += [n * o.param.element_size(), n * g.element_size()]
                sizes[r] += [len(o.maps[k][r]) * o.state[k].element_size() for k in o.keys if is_dtensor(o.state[k])]
        recv = self._exchange(send, sizes)
        for r in range(self.world):
            pieces = iter(recv[r])
            for i, g in mine:
                o = self.owned[i]
                if o.whole_grad is None or o.whole_grad.dtype != g.dtype:
                    o.whole_grad = torch.empty(o.param.shape, dtype=g.dtype, device=o.param.device)
                targets = [("param", o.whole), ("param", o.whole_grad)] + [
                    (k, o.whole_state[k]) for k in o.keys if is_dtensor(o.state[k])]
                for key, whole in targets:
                    whole.view(-1).index_copy_(0, o.maps[key][r], _as(next(pieces), whole.dtype))

    def scatter(self, indices: Sequence[int]) -> None:
        """Every rank's pieces of the owners' new parameters and state: the second ``all_to_all_single``."""
        send: list[list[Tensor]] = [[] for _ in range(self.world)]
        for i in indices:
            o = self.owned[i]
            if o.owner != self.rank:
                continue
            for r in range(self.world):
                send[r].append(_bytes(o.whole.view(-1)[o.maps["param"][r]]))
                for k in o.keys:
                    w = o.whole_state[k]
                    send[r].append(_bytes(w.view(-1)[o.maps[k][r]] if k in o.maps else w))
        sizes = [[] for _ in range(self.world)]
        for i in indices:
            o = self.owned[i]
            sizes[o.owner] += [_nbytes(t) for _, t in o.tensors()]
        recv = self._exchange(send, sizes)
        for r in range(self.world):
            pieces = iter(recv[r])
            for i in indices:
                o = self.owned[i]
                if o.owner != r:
                    continue
                for _, t in o.tensors():
                    piece = next(pieces)
                    if o.owner != self.rank or is_dtensor(t):  # the owner's plain state is already the whole
                        loc = t.to_local() if is_dtensor(t) else t
                        loc.copy_(_as(piece, loc.dtype).view(loc.shape))

    def _exchange(self, send: list[list[Tensor]], sizes: list[list[int]]) -> list[list[Tensor]]:
        """One ``all_to_all_single`` of bytes: ``send[r]`` to rank ``r``; ``sizes[r]`` the byte sizes of the
        pieces rank ``r`` sends here. Returns the received pieces per source rank."""
        device = self.owned[0].param.device if self.owned else torch.device("cpu")
        flat = [torch.cat(s) if s else torch.empty(0, dtype=torch.uint8, device=device) for s in send]
        out_splits = [sum(s) for s in sizes]
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        dist.all_to_all_single(out, torch.cat(flat), out_splits, [f.numel() for f in flat], group=self.pg)
        recv, start = [], 0
        for r in range(self.world):
            pieces = []
            for n in sizes[r]:
                pieces.append(out[start : start + n])
                start += n
            recv.append(pieces)
        return recv


def _as(piece: Tensor, dtype: torch.dtype) -> Tensor:
    """Received bytes as ``dtype`` (copied first where the bytes before them leave them unaligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    return (piece if piece.storage_offset() % size == 0 else piece.clone()).view(dtype)


def _nbytes(t: Tensor) -> int:
    loc = t.to_local() if is_dtensor(t) else t
    return loc.numel() * loc.element_size()
