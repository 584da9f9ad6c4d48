"""What the distributed paths share, kept out of the maths: DTensor helpers, owners, the byte exchange, splitters.

A rule call's context carries a *work splitter* (``calls.StepContext.split``), which ``placement.EXECUTORS`` picks
by the call's path:

``LocalSplit``  ``placement.LOCAL``: the call's tensors are whole here, or its rule is elementwise: nothing to
                exchange (one process; under DDP every rule without Newton-Schulz, run in place on every rank's
                full copy with 0 bytes, as torch's AdamW runs under DDP).
``RowSums``     ``placement.ROWS``: whole-row pieces of a rule whose only sums over shards are statistics (eq. 9
                and 10, SCALE): ``psum`` is one all-reduce of partial sums per statistic; no piece travels.
``Exchange``    ``placement.OWNERS`` (``exchange.py``): direction inputs to owner ranks, whole matrices there,
                directions back, with owners by :func:`assign_owners`, in one collective of bytes each way
                (:func:`exchange_flat`).

All ranks must call ``step()`` with the same parameters having gradients (DDP guarantees this), otherwise the
collectives do not match.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]

from .. import functional as F

try:  # torch builds without distributed support have no DTensor
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - exercised only on such builds
    dist = None  # type: ignore[assignment]
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = None  # type: ignore[assignment,misc]
    Shard = None  # type: ignore[assignment,misc]

__all__ = ["SHARDED_LAYOUTS", "InFlight", "LocalSplit", "RowSums", "assign_owners", "exchange_flat", "is_dtensor",
           "local", "offsets", "received_as", "resolve_process_group", "state_like"]


def is_dtensor(t: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (sharing storage, so in-place updates reach the DTensor); else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def state_like(p: Tensor, shape: tuple[int, ...], dtype: torch.dtype, *, aligned: bool = True) -> Tensor:
    """Zeros of ``shape`` for per-row or per-matrix state of ``p``. Under FSDP2/HSDP, where ``aligned`` (dim 0
    of the state is dim 0 of ``p``: one entry per row, or per stacked matrix), sharded along dim 0 like
    ``p``; any other DTensor layout (tensor parallelism, FSDP2 over TP, a transposed or folded view) gets
    the state whole on every rank (``Replicate()``): it is small, and the owner path (``owners.py``) sends
    the owner's new value to every rank."""
    if not is_dtensor(p):
        return torch.zeros(shape, dtype=dtype, device=p.device)
    if not (aligned and shape[0] == p.shape[0] and tuple(p.placements) in SHARDED_LAYOUTS):
        whole = torch.zeros(shape, dtype=dtype, device=p.device)
        return DTensor.from_local(whole, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    loc = torch.zeros((p.to_local().shape[0], *shape[1:]), dtype=dtype, device=p.device)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(loc, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)


def resolve_process_group(process_group: Any) -> Any:
    """``process_group=None`` means the default group if ``torch.distributed`` is initialised, else none."""
    if process_group is not None:
        return process_group
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def assign_owners(costs: Sequence[float], load: list[float], groups: Sequence[Any] | None = None) -> list[int]:
    """Owner rank of each item: longest-first greedy onto the least-loaded rank (ties: lower rank; with
    ``groups``, among the least-loaded ranks one that owns no item of the item's group yet, where there is one).

    ``load`` (one entry per rank) is updated in place, so calling this for several param groups
    in turn balances the whole step. Depends only on the arguments, hence identical on every rank.
    Longest-first greedy (LPT) keeps the busiest rank within 4/3 of the optimum (Graham 1969); where items
    are fewer than ranks, as hidden matrices of 70B on 512 ranks, each rank gets at most one of the largest.
    ``groups`` (an exchange's shape buckets) changes no load, only which of equally loaded ranks: so that an
    owner holds as few whole matrices of one bucket at once as the balance allows (Llama-3 405B on 256 ranks:
    rank 0 held two of the 53,248 x 16,384 bucket's matrices, 6.5 GiB at once, where one rank each was free).
    A heap of ``(load, rank)``: ``O(items log ranks)``, the same choices as a scan for the minimum.
    """
    heap = [(x, r) for r, x in enumerate(load)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    held: dict[Any, set[int]] = {}
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        x, r = heapq.heappop(heap)
        if groups is not None and r in held.get(groups[i], ()):
            tied = [(x, r)]  # the equally loaded ranks, lowest first, until one without this group's items
            while heap and heap[0][0] == x and tied[-1][1] in held[groups[i]]:
                tied.append(heapq.heappop(heap))
            x, r = next((t for t in tied if t[1] not in held[groups[i]]), tied[0])
            for t in tied:
                if t[1] != r:
                    heapq.heappush(heap, t)
        owners[i] = r
        load[r] = x + costs[i]
        heapq.heappush(heap, (load[r], r))
        if groups is not None:
            held.setdefault(groups[i], set()).add(r)
    return owners


class LocalSplit:
    """``placement.LOCAL``: this rank holds what it steps (one process; DDP's rules without Newton-Schulz; whole
    local matrices): no statistic is summed over shards (``psum`` is ``None``) and nothing travels."""

    #: Sums over a tensor's shards for its statistics (``RowSums``); ``None``: the tensor is whole here.
    psum: F.PSum = None

    #: ``ns_for(group, ctx)``: the batched form's Newton-Schulz in the method's place (``driver.directions``' ``ns``,
    #: ``shared_ns.ReplicaShare``: a block's share), or ``None``: the group's method, whole here.
    ns_for: Callable[[dict, Any], Callable[..., Tensor]] | None = None

    def __init__(self) -> None:
        #: Newton-Schulz buffers reused by same-shape matrices within a step (``F.orthogonalize``).
        self.workspace: dict = {}


class RowSums(LocalSplit):
    """``placement.ROWS``: every rank updates its whole rows of a tensor, and :meth:`psum` sums the statistics'
    partial sums over its shards: for FSDP2's and HSDP's row shards (``Shard(0)``, ``(Replicate(), Shard(0))``) over
    the shard group (each HSDP replica group its own, the same work repeated); for any other whole-row pieces
    (FSDP2 over TP's vocabulary-parallel embedding and head, ``(_StridedShard(0), Shard(0))``; norms
    ``(Shard(0), Replicate())``) over the default group, the ranks of one replica (coordinate 0 on the mesh
    dimensions that replicate) contributing and the others adding zeros."""

    def __init__(self, p: Tensor) -> None:
        super().__init__()
        mesh = p.device_mesh
        if tuple(p.placements) in SHARDED_LAYOUTS:
            self.pg, self._contributes = mesh.get_group(mesh.ndim - 1), True
        else:
            coordinate = mesh.get_coordinate()
            self.pg = dist.group.WORLD
            self._contributes = all(coordinate[i] == 0 for i, q in enumerate(p.placements) if q.is_replicate())
        self.psum = self._psum

    def _psum(self, t: Tensor) -> Tensor:
        t = t.contiguous() if self._contributes else torch.zeros_like(t)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pg)
        return t

    @staticmethod
    def key(p: Tensor) -> tuple:
        """What makes two parameters' sums the same: their mesh and placements."""
        return id(p.device_mesh), tuple(p.placements)


#: DTensor placements of row-sharded parameters: FSDP2 (1-D mesh) and HSDP (replicate x shard).
SHARDED_LAYOUTS = frozenset({(Shard(0),), (Replicate(), Shard(0))}) if Shard is not None else frozenset()


# ---- the exchange's one collective ----------------------------------------------------------------------


class InFlight:
    """A result whose collective may still be in flight: :meth:`wait` completes it, once (the collective's ``wait``,
    then ``finish``, which reads what was received), and returns what ``finish`` made."""

    __slots__ = ("_work", "_finish", "_value")

    def __init__(self, work: Any, finish: Callable[[], Any]) -> None:
        self._work, self._finish, self._value = work, finish, None

    def wait(self) -> Any:
        if self._finish is not None:
            if self._work is not None:
                self._work.wait()
            self._value, self._work, self._finish = self._finish(), None, None
        return self._value


def offsets(lengths: Sequence[int]) -> list[int]:
    """Where each of ``lengths``' consecutive runs starts in the bytes :func:`exchange_flat` received (its senders'
    in rank order): the exclusive prefix sums."""
    return [0, *itertools.accumulate(lengths)][:-1] if lengths else []


def received_as(piece: Tensor, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
    """Received bytes (of :func:`exchange_flat`'s result) as ``dtype`` in ``shape`` (copied first where the bytes
    before them leave them unaligned)."""
    return (piece if piece.storage_offset() % dtype.itemsize == 0 else piece.clone()).view(dtype).view(shape)


def exchange_flat(send: list[list[Tensor]], out_splits: Sequence[int], group: Any, device: torch.device, *,
                  wait: bool = True) -> Tensor | InFlight:
    """One uneven ``all_to_all_single`` of bytes, the one collective of the exchange: the bytes of ``send[r]``
    (tensors of any dtype) to rank ``r`` of ``group``, nothing padded; ``out_splits[r]`` the bytes rank ``r`` sends
    here. ``send`` is emptied (its pieces, copies at owners, let go before the exchange). Returns the received
    bytes, rank ``0``'s first; ``wait=False``: posted asynchronously, an :class:`InFlight` of them (the send buffer
    kept alive by the collective until it completes)."""
    send_sizes = [sum(p.numel() * p.element_size() for p in s) for s in send]
    # rank-major, as bytes (a view where a piece is contiguous): one copy into the send buffer
    pieces = [p.contiguous().reshape(-1).view(torch.uint8) for s in send for p in s]
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
    del pieces
    for s in send:
        s.clear()
    out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    if not sum(send_sizes) and out.numel() and dist.get_backend(group) == "fake":
        # torch's FakeProcessGroup (the simulator's, benchmarks/scale_sim.py) fills what a rank receives from
        # what it sends and refuses an empty input (FakeProcessGroup.hpp, alltoall_base): there a rank that
        # sends nothing sends itself one byte, which it does not read. Real backends never take this branch.
        flat = torch.zeros(1, dtype=torch.uint8, device=device)
        send_sizes[dist.get_rank(group)] = 1
    work = dist.all_to_all_single(out, flat, list(out_splits), send_sizes, group=group, async_op=not wait)
    if wait:
        return out
    return InFlight(work, lambda: (flat, out)[1])  # ``flat`` referenced until the collective completes
