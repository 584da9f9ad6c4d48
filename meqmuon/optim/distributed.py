"""Distributed execution of the momentum rules, kept out of the maths: who updates what.

Rules ask a *work splitter* which parameters this rank updates (``owners``), under FSDP2 to run a
function on whole matrices at owner ranks (``at_owners``: the hidden rules' pre, Newton-Schulz and
post) and for a sum over shards (``psum``, the embedding and vector rules' statistics). After updating
they hand the results to ``publish``, and the engine calls ``finish`` once per
step. Three splitters, chosen by the engine (:func:`splitter_for`):

``LocalSplit``       one process: this rank owns everything; publishing is a no-op.
``ReplicatedSplit``  DDP (gradients already all-reduced, every rank holds every full tensor): every
                     rank updates the momentum of every parameter (one cheap in-place pass, so the
                     state is complete everywhere), then each parameter has one *owner* rank that
                     computes its whole update -- Newton-Schulz, normalisation, weight decay and
                     step -- and broadcasts the new parameter (plus any per-parameter state the
                     rule changed, e.g. MeqMuon's row-choice counter, NorMuon's second moment).
                     Owners are assigned by estimated cost (longest-first greedy, loads carried
                     across the param groups of one step), identically on every rank. A
                     ``state_dict()`` saved on rank 0 restores any rank (the failure of
                     KellerJordan/Muon issue 46 cannot happen).
``ShardedSplit``     FSDP2 (``fully_shard``; DTensor parameters ``Shard(0)`` on a 1-D mesh, or
                     HSDP's ``(Replicate(), Shard(0))`` on a 2-D mesh, over its shard dimension):
                     every rank updates its row shard of every matrix. For a hidden matrix's direction
                     each matrix has an owner rank (all shape buckets of a step planned at once, longest
                     first, the load carried: ``bucket_owners``); one uneven ``all_to_all_single`` per
                     shape bucket sends each row shard to its owner only (``exchange_flat``, the owner
                     path's exchange too), the owner computes the direction of whole matrices, and a
                     second one returns each rank its rows (microsoft/dion ``megabatch_base.py`` does the
                     same for Newton-Schulz). The elementwise rules' column and global statistics use
                     ``psum`` (an all-reduce of partial sums), so the result equals the unsharded
                     optimizer up to the rounding of the partial sums.

Why DDP broadcasts parameters (whole updates) rather than all-gathering Newton-Schulz outputs, as
Muon implementations usually do: the normalisations of MeqMuon (two-sided on the 32000 x d
embedding and head, one-sided with CV statistics on hidden matrices) are memory-bound passes that
a gather of NS outputs would leave repeated on every rank (the measurements, and those of sending
compact factors instead: docs/benchmarks.md, "Distributed scaling").

Bit-exactness with one process: an owner runs exactly the per-parameter code a single process
runs (``functional.orthogonalize`` iterates matrix by matrix, so a matrix's bits never depend on
its neighbours; checked by ``tests/test_distributed.py``), and a broadcast copies bits.

All ranks must call ``step()`` with the same parameters having gradients (DDP guarantees this),
otherwise the collectives do not match.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F

try:  # torch builds without distributed support have no DTensor
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - exercised only on such builds
    dist = None  # type: ignore[assignment]
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = None  # type: ignore[assignment,misc]
    Shard = None  # type: ignore[assignment,misc]

__all__ = [
    "LocalSplit",
    "OwnerLoad",
    "ReplicatedSplit",
    "RowPieceSplit",
    "SHARDED_LAYOUTS",
    "ShardedSplit",
    "assign_counts",
    "assign_owners",
    "bucket_owners",
    "as_bytes",
    "exchange_bytes",
    "exchange_flat",
    "from_bytes",
    "is_dtensor",
    "local",
    "resolve_process_group",
    "share_loads",
    "replicated_splitter",
    "splitter_for",
    "state_like",
]


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


def assign_counts(
    bucket_sizes: Sequence[int], bucket_costs: Sequence[float], world: int, load: list[float] | None = None
) -> list[list[int]]:
    """How many matrices of each bucket every rank orthogonalises: balanced, deterministic.

    Every rank gets ``K // world`` of a bucket of ``K`` matrices; the ``K % world`` left over go to
    the ranks with the least work so far (ties: lower rank), so that across buckets the FLOPs
    balance. Depends only on the arguments, hence identical on every rank.

    ``load`` (one entry per rank; updated in place) carries the balance across calls.

    Returns:
        ``counts[b][r]``: matrices of bucket ``b`` owned by rank ``r``; rank ``r`` owns the
        contiguous slice starting at ``sum(counts[b][:r])`` of the bucket.
    """
    load = [0.0] * world if load is None else load
    out = []
    for k, cost in zip(bucket_sizes, bucket_costs, strict=True):
        q, rem = divmod(k, world)
        counts = [q] * world
        for r in sorted(range(world), key=lambda r: (load[r], r))[:rem]:
            counts[r] += 1
        for r in range(world):
            load[r] += counts[r] * cost
        out.append(counts)
    return out


def assign_owners(costs: Sequence[float], load: list[float]) -> list[int]:
    """Owner rank of each item: longest-first greedy onto the least-loaded rank (ties: lower rank).

    ``load`` (one entry per rank) is updated in place, so calling this for several param groups
    in turn balances the whole step. Depends only on the arguments, hence identical on every rank.
    Longest-first greedy (LPT) keeps the busiest rank within 4/3 of the optimum (Graham 1969); where items
    are fewer than ranks, as hidden matrices of 70B on 512 ranks, each rank gets at most one of the largest.
    A heap of ``(load, rank)``: ``O(items log ranks)``, the same choices as a scan for the minimum.
    """
    heap = [(x, r) for r, x in enumerate(load)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        x, r = heapq.heappop(heap)
        owners[i] = r
        load[r] = x + costs[i]
        heapq.heappush(heap, (load[r], r))
    return owners


def bucket_owners(sizes: Sequence[int], costs: Sequence[float], load: list[float]) -> list[list[int]]:
    """The owner of every matrix of shape buckets (``sizes[b]`` matrices of cost ``costs[b]`` each), planned
    for all buckets at once by :func:`assign_owners` (longest first onto the least-loaded rank, ``load``
    carried and updated): no collective, identical on every rank. Planned bucket by bucket from no load
    instead (``assign_counts``), each bucket's remainder lands on the same first ranks: Llama-3 70B's
    hidden matrices on 512 ranks left the busiest at 2.4x its lower bound (``tests/test_row_exchange.py``)."""
    flat = [c for k, c in zip(sizes, costs, strict=True) for _ in range(k)]
    owners = assign_owners(flat, load)
    out, start = [], 0
    for k in sizes:
        out.append(owners[start : start + k])
        start += k
    return out


class OwnerLoad:
    """The Newton-Schulz work given to each rank of one process group in a step, shared by every planner of
    owners on that group, so that a step's owners balance across its shape buckets, its param groups, and the
    owner path's (``owners.OwnerPlan``) parameters: ``base`` is the work planned once (the owner path's,
    static), ``load`` the step's so far (reset to ``base`` by :meth:`reset` at the start of every step)."""

    def __init__(self, world: int, base: Sequence[float] | None = None) -> None:
        self.base = [0.0] * world if base is None else list(base)
        self.load = list(self.base)

    def reset(self) -> None:
        self.load[:] = self.base


def exchange_flat(send: list[list[Tensor]], out_splits: Sequence[int], group: Any, device: torch.device) -> Tensor:
    """One uneven ``all_to_all_single`` of bytes, the one exchange of every sharded layout (the row path,
    :meth:`ShardedSplit.at_owners`, and the owner path, ``owners.OwnerPlan``): ``send[r]`` (uint8 tensors)
    to rank ``r`` of ``group``, nothing padded; ``out_splits[r]`` the bytes rank ``r`` sends here. ``send``
    is emptied (its pieces, copies at owners, let go before the exchange). Returns the received bytes, rank
    ``0``'s first."""
    send_sizes = [sum(p.numel() for p in s) for s in send]
    pieces = [p for s in send for p in s]  # rank-major: one copy into the send buffer
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
    dist.all_to_all_single(out, flat, list(out_splits), send_sizes, group=group)
    return out


def exchange_bytes(send: list[list[Tensor]], sizes: list[list[int]], group: Any,
                   device: torch.device) -> list[list[Tensor]]:
    """:func:`exchange_flat` with ``sizes[r]`` the byte sizes of the pieces rank ``r`` sends here. Returns the
    received pieces per source rank (views of one buffer)."""
    out = exchange_flat(send, [sum(s) for s in sizes], group, device)
    recv, start = [], 0
    for s in sizes:
        got = []
        for n in s:
            got.append(out[start : start + n])
            start += n
        recv.append(got)
    return recv


def as_bytes(t: Tensor) -> Tensor:
    """``t``'s elements as a flat uint8 tensor (a view where ``t`` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(piece: Tensor, dtype: torch.dtype) -> Tensor:
    """Received bytes as ``dtype`` (copied first where the bytes before them leave them unaligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    return (piece if piece.storage_offset() % size == 0 else piece.clone()).view(dtype)


class LocalSplit:
    """Single process: this rank owns every matrix (and orthogonalises it locally, ``driver.directions``)."""

    world_size = 1
    rank = 0
    #: Sums over a tensor's shards for its statistics (FSDP2's rows); ``None``: the tensor is whole here.
    psum: F.PSum = None

    def __init__(self) -> None:
        #: Newton-Schulz buffers reused by same-shape matrices within a step (``F.orthogonalize``).
        self.workspace: dict = {}

    def owners(self, costs: Sequence[float]) -> list[int]:
        """The rank that updates each of a rule's parameters (here: this one, for all)."""
        return [self.rank] * len(costs)

    def publish(self, tensors: Sequence[Sequence[Tensor]], owners: Sequence[int]) -> None:
        """Send ``tensors[i]`` (a parameter and the state its owner changed) from ``owners[i]`` to all ranks."""

    def finish(self) -> None:
        """Wait for everything ``publish`` started (called by the engine at the end of ``step()``)."""

    # ---- the batched (foreach) path: one slice of each shape bucket per rank -------------------

    def bucket_plan(self, size: int, cost: float) -> list[int]:
        """How many members of a bucket of ``size`` each rank computes (a contiguous slice each)."""
        return [size]

    def gather(self, stacks: Sequence[Tensor], counts: Sequence[int]) -> list[Tensor]:
        """Every rank's slice of each stack (``counts`` from :meth:`bucket_plan`), concatenated in
        rank order on every rank; one collective for all of ``stacks``. Here: ``stacks`` itself."""
        return list(stacks)


class _CollectiveSplit(LocalSplit):
    """Shared set-up of the multi-rank splitters."""

    def __init__(self, process_group: Any) -> None:
        super().__init__()
        self.pg = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)


class ReplicatedSplit(_CollectiveSplit):
    """DDP: each parameter's update is computed by one owner rank and broadcast to the others.

    One instance serves all param groups of a step, so that owner loads balance across groups.
    """

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        self._load = [0.0] * self.world_size
        self._pending: list[tuple[Tensor, Tensor, Any]] = []

    def owners(self, costs):
        return assign_owners(costs, self._load)

    def publish(self, tensors, owners):
        for ts, owner in zip(tensors, owners, strict=True):
            src = dist.get_global_rank(self.pg, owner)
            for t in ts:
                # Collectives need dense contiguous buffers: stage anything else (copied back in finish()).
                buf = t if t.is_contiguous() else t.contiguous()
                work = dist.broadcast(buf, src, group=self.pg, async_op=True)
                # Keep buf referenced until wait() (karpathy/nanochat#843: freed buffers tear).
                self._pending.append((t, buf, work))

    def bucket_plan(self, size, cost):
        """Balanced contiguous slices (``assign_counts``), the load carried across the step's buckets."""
        return assign_counts([size], [cost], self.world_size, self._load)[0]

    def gather(self, stacks, counts):
        """One ``all_gather_into_tensor`` per bucket: the stacks are flattened side by side into one
        ``(slots, width)`` buffer per rank (``slots = max(counts)``, padded), gathered, and cut apart."""
        if not stacks:
            return []
        k_mine, slots = counts[self.rank], max(counts)
        dtype = stacks[0].dtype
        for t in stacks[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        flat = [t.reshape(t.shape[0], math.prod(t.shape[1:])).to(dtype) for t in stacks]
        widths = [f.shape[1] for f in flat]
        send = torch.zeros((slots, sum(widths)), dtype=dtype, device=stacks[0].device)
        if k_mine:
            torch.cat(flat, dim=1, out=send[:k_mine])
        recv = torch.empty((self.world_size * slots, send.shape[1]), dtype=dtype, device=send.device)
        dist.all_gather_into_tensor(recv, send, group=self.pg)
        rows = recv.view(self.world_size, slots, -1)
        full = rows.reshape(-1, send.shape[1]) if min(counts) == slots else torch.cat(
            [rows[r, : counts[r]] for r in range(self.world_size)])
        out, start = [], 0
        for t, w in zip(stacks, widths, strict=True):
            out.append(full[:, start : start + w].reshape(-1, *t.shape[1:]).to(t.dtype))
            start += w
        return out

    def finish(self):
        for t, buf, work in self._pending:
            work.wait()
            if buf is not t:
                t.copy_(buf)
        self._pending.clear()


class ShardedSplit(_CollectiveSplit):
    """FSDP2: every rank updates its row shards; NS moves whole matrices to owner ranks and back."""

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        self.psum = self._psum
        #: The step's owner load on this group; the engine shares one among the splitters of a group and the
        #: owner path (:class:`OwnerLoad`) and resets it every step.
        self.load = OwnerLoad(self.world_size)

    def _psum(self, t: Tensor) -> Tensor:
        t = t.contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pg)
        return t

    def _shard_rows(self, m: int) -> list[int]:
        """Each rank's rows under FSDP2's ``torch.chunk`` row split (only the last ranks may hold fewer)."""
        s = math.ceil(m / self.world_size)
        return [max(0, min(s, m - r * s)) for r in range(self.world_size)]

    def bucket_owners(self, sizes: Sequence[int], costs: Sequence[float]) -> list[list[int]]:
        """:func:`bucket_owners` of a call's shape buckets, the step's load on this group carried."""
        return bucket_owners(sizes, costs, self.load.load)

    def at_owners(self, stack: list[Tensor], fn: Callable[[list[Tensor]], list[Tensor]], m: int,
                  back: Sequence[tuple[torch.dtype, int, bool]], owners: Sequence[int]) -> list[Tensor]:
        """Row shards of ``k`` matrices of ``m`` rows -> whole matrices at their ``owners`` (ranks of the group,
        :meth:`bucket_owners`) -> ``fn`` there -> each rank's rows of ``fn``'s results back: one
        :func:`exchange_flat` of bytes each way, each rank sending an owner only its rows of that owner's
        matrices, and the owner each rank only its rows of the results, nothing padded.

        ``stack == [X, C]``, handed over (the list emptied; both let go once sent, before ``fn``, an owner's
        Newton-Schulz): ``X`` ``(k, rows, n)`` this rank's rows of the matrices, in the Newton-Schulz dtype, and
        ``C`` ``(k, rows, c)`` extra columns (per-row and per-matrix state) in a dtype of their own, ``c`` may be
        0. At an owner ``fn([M, C])``, ``M`` ``(j, m, n)`` its whole matrices, contiguous (fit for Newton-Schulz
        to iterate in place), and ``C`` ``(j, m, c)``, handed over, returns a tensor per entry ``(dtype, width,
        per_row)`` of ``back``: ``(j, m, width)`` per row or ``(j, width)`` per matrix. Returns this rank's part
        of each: ``(k, max(rows, 1), width)`` (a rank that holds no rows gets each matrix's first row, so that
        per-matrix values reach every rank) or ``(k, width)``."""
        W, rank = self.world_size, self.rank
        X, C = stack
        stack.clear()
        k, mine, n = X.shape
        rows = self._shard_rows(m)
        if mine != rows[rank] or len(owners) != k:
            raise NotImplementedError(
                f"ShardedSplit expects FSDP2's torch.chunk row sharding ({rows[rank]} of {m} rows on rank {rank}) "
                f"and an owner per matrix ({len(owners)} for {k}), got local shapes {tuple(X.shape)}")
        out_parts = [(X.dtype, n), (C.dtype, C.shape[-1])]
        device, ours = X.device, owners.count(rank)
        per_row = sum(w * dt.itemsize for dt, w in out_parts)  # bytes of one row of X and C
        send: list[list[Tensor]] = [[] for _ in range(W)]
        for j in range(k if mine else 0):
            send[owners[j]] += [as_bytes(t[j]) for t in (X, C) if t.shape[-1]]
        del X, C
        # from each rank that holds rows, one block: per matrix of ours, its rows of X, then of C
        got = exchange_flat(send, [ours * q * per_row for q in rows], self.pg, device)
        parts = _whole(got, ours, rows, out_parts) if ours else None
        del got  # the received bytes, copied into parts: not alive during fn (the step's transient peak)
        out = fn(parts) if ours else None  # fn let parts go
        del parts
        starts = [sum(rows[:q]) for q in range(W)]
        send = [[] for _ in range(W)]
        for q in range(W):
            lo, r = (starts[q], rows[q]) if rows[q] else (0, 1)
            for t in range(ours):
                send[q] += [as_bytes(o[t, lo : lo + r] if by_row else o[t])
                            for o, (_, w, by_row) in zip(out, back, strict=True) if w]
        del out
        mine = max(mine, 1)
        sizes = [(mine if by_row else 1) * w * dt.itemsize for dt, w, by_row in back]
        counts = [owners.count(r) for r in range(W)]
        got = exchange_flat(send, [q * sum(sizes) for q in counts], self.pg, device)
        # owner-major blocks of sum(sizes) bytes per matrix, in each owner's bucket order -> bucket order
        by_owner = [iter(b.unbind(0)) for b in got.view(k, sum(sizes)).split(counts)]
        ordered = torch.stack([next(by_owner[owners[j]]) for j in range(k)])
        del got, by_owner
        results, o = [], 0
        for (dt, w, by_row), size in zip(back, sizes, strict=True):
            res = torch.empty((k, mine, w) if by_row else (k, w), dtype=dt, device=device)
            if size:
                res.view(torch.uint8).view(k, size).copy_(ordered[:, o : o + size])
            results.append(res)
            o += size
        return results


def _whole(got: Tensor, ours: int, rows: list[int], parts: list[tuple[torch.dtype, int]]) -> list[Tensor]:
    """An owner's whole matrices ``(ours, m, width)``, one contiguous tensor per ``(dtype, width)`` of ``parts``,
    from the received bytes: rank-major (FSDP2 pads only at the end, so rank ``q``'s rows follow rank ``q - 1``'s:
    their concatenation is the matrix), from each rank per matrix its rows of each part in turn. Copied as bytes
    (tensors of their own, never views of the received bytes, which a compiled owner graph would see as aliasing
    a uint8 base of another dtype)."""
    W, m = len(rows), sum(rows)
    out = [torch.empty((ours, m, w), dtype=dt, device=got.device) for dt, w in parts]
    widths = [w * dt.itemsize for dt, w in parts]  # bytes per row of each part
    per_row = sum(widths)
    cols = [(t.view(torch.uint8), sum(widths[:i]), b) for i, (t, b) in enumerate(zip(out, widths, strict=True)) if b]
    if len(set(rows)) == 1:  # even shards: one copy each
        r = rows[0]
        blocks = got.view(W, ours, r * per_row)
        for t, o, b in cols:
            t.view(ours, W, r, b).copy_(blocks[..., r * o : r * (o + b)].view(W, ours, r, b).permute(1, 0, 2, 3))
        return out
    start, row = 0, 0
    for r in rows:
        if r:
            block = got[start : start + ours * r * per_row].view(ours, r * per_row)
            for t, o, b in cols:
                t[:, row : row + r].copy_(block[:, r * o : r * (o + b)].view(ours, r, b))
        start, row = start + ours * r * per_row, row + r
    return out


class RowPieceSplit(ShardedSplit):
    """Whole-row pieces of any other placements (FSDP2 over TP's vocabulary-parallel embedding and head,
    ``(_StridedShard(0), Shard(0))``; norms ``(Shard(0), Replicate())``) for the rules whose only sums over
    shards are column statistics (eq. 9 and 10, SCALE): every rank updates its rows, and :meth:`psum` is one
    all-reduce over the default group in which the ranks of one replica (coordinate 0 on the mesh dimensions
    ``replicated``) contribute and the others add zeros. No Newton-Schulz goes this way (``placement.py``)."""

    def __init__(self, mesh: Any, replicated: tuple[int, ...]) -> None:
        super().__init__(dist.group.WORLD)
        coordinate = mesh.get_coordinate()
        self._contributes = all(coordinate[i] == 0 for i in replicated)

    def _psum(self, t: Tensor) -> Tensor:
        t = t.contiguous() if self._contributes else torch.zeros_like(t)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pg)
        return t

    def at_owners(self, *args: Any, **kwargs: Any) -> Tensor:
        raise NotImplementedError("RowPieceSplit carries no Newton-Schulz inputs (placement.py routes hidden "
                                  "rules' pieces to owners.py); this call is a bug")


def share_loads(splits: Sequence[Any], base: Sequence[float] | None) -> list[OwnerLoad]:
    """One :class:`OwnerLoad` per process group among the row path's ``splits`` (a step's param groups), shared
    by the splitters on it, so that a step's owners balance across its param groups; on the group of every
    rank in order, starting from ``base``, the owner path's planned work (``owners.OwnerPlan.load``), so that
    the two paths share one load. Returns the loads, which the engine resets at the start of every step."""
    loads: dict[tuple[int, ...], OwnerLoad] = {}
    for split in splits:
        if isinstance(split, ShardedSplit) and not isinstance(split, RowPieceSplit):
            ranks = tuple(dist.get_process_group_ranks(split.pg))
            if ranks not in loads:
                start = base if base is not None and ranks == tuple(range(len(base))) else None
                loads[ranks] = OwnerLoad(split.world_size, start)
            split.load = loads[ranks]
    return list(loads.values())


#: DTensor placements of row-sharded parameters: FSDP2 (1-D mesh) and HSDP (replicate x shard).
SHARDED_LAYOUTS = frozenset({(Shard(0),), (Replicate(), Shard(0))}) if Shard is not None else frozenset()


def splitter_for(params: Sequence[Tensor]) -> LocalSplit:
    """The splitter of a param group's row-sharded DTensors: FSDP2's ``Shard(0)`` on a 1-D mesh, or HSDP's
    ``(Replicate(), Shard(0))`` on a 2-D mesh, which shards over the mesh's last dimension and repeats the
    (identical) work in every replica group. The engine hands every other layout to the owner path
    (``owners.py``) and plain tensors to the step's DDP splitter (:func:`replicated_splitter`).

    Raises:
        NotImplementedError: for row shards on several meshes in one param group.
    """
    if len({id(p.device_mesh) for p in params}) != 1:
        raise NotImplementedError("all DTensor parameters of a param group must live on one device mesh")
    # The last mesh dimension is the one that shards rows. Under HSDP every replica group holds the
    # same (all-reduced) gradients, so each computes the same update over its own shard group.
    mesh = params[0].device_mesh
    pg = mesh.get_group(mesh.ndim - 1)
    return ShardedSplit(pg) if dist.get_world_size(pg) > 1 else LocalSplit()


def replicated_splitter(process_group: Any) -> LocalSplit:
    """The splitter for plain-tensor parameters for one step: DDP's ``ReplicatedSplit`` over
    ``process_group`` (already resolved), or ``LocalSplit`` for ``None`` / a group of size 1."""
    if process_group is None or dist.get_world_size(process_group) == 1:
        return LocalSplit()
    return ReplicatedSplit(process_group)
