"""One unit's Newton-Schulz shared by a block of ranks: the optimizer's ``ns_group`` (issue 59 item 2).

With whole matrices at owners (``exchange.py``) the step's critical path is its busiest owner, and no owner can
be faster than its largest matrix: at Llama-3 405B one 16,384 x 53,248 MLP matrix is about 0.7 s of bf16
Newton-Schulz on an H100, whatever the number of ranks (docs/benchmarks.md, the time model). ``ns_group=g`` lets
the ``g`` consecutive ranks of a *block* (a node's GPUs, ``g = 8``), or of a smaller block whose size divides ``g``
(:func:`block_sizes`), share one unit's Newton-Schulz, so that the bound becomes ``max(total work / ranks, largest
matrix / g)``:

* **by matrices** (``"matrices"``), where the unit is a stack of at least ``g`` same-shape matrices (a MoE layer's
  experts): each member orthogonalises a contiguous range of them with the group's own method, matrix by matrix as
  an owner does; one process's bits, no collective but the two below;
* **by columns** (``"columns"``), where it is fewer matrices (one large matrix): each member iterates a block of the
  long side of the wide orientation ``Z`` (``s x L``, ``s <= L``; a tall matrix's rows); the quintic's Gram matrix
  is the sum of the members' (one ``all_reduce`` per iteration) and ``B = b A + c A^2`` is made by rows, each
  member its own ``s / g`` rows, gathered by all (one ``all_to_all_single``)::

      Z_0 = Z / max(||Z||_F, eps)   (at the owner, whole),      A_k = sum_j Z_k,j Z_k,j^T   (all_reduce),
      B_k[i] = b A_k[i] + c A_k[i] A_k                           (member i its rows, gathered by all),
      Z_k+1,j = a Z_k,j + B_k Z_k,j                              (member j its columns)

  which is the quintic (paper eq. 3; :func:`meqmuon.functional.orthogonalize`) block by block: the same iteration,
  only ``A_k`` summed in another order (exact to rounding; the sum travels in float32 where the iteration's dtype
  is narrower, so that it is rounded once as one process's product is). The Gram matrix is made and summed in
  :data:`GRAM_CHUNKS` blocks of rows (:func:`gram_blocks`), each posted as soon as it is made, so that the link
  carries one while the member makes the next (:func:`exposed_bytes`: what is left on the member's path); and as
  ``A`` is symmetric, each block only from its first row's column on, the rest its mirror: 0.625 of the square's
  FLOPs and bytes at four blocks. Each member's FLOPs per iteration: ``(2 s^2 + 2 e) L / g + 2 s^3 / g``
  (``e = gram_entries(s)``), below the whole matrix's ``(4 s^2 L + 2 s^3) / g`` (:func:`column_flops`).

The owner receives the unit whole (the exchange is unchanged), ``pre`` runs there, the members' parts go out and
come back in one ``all_to_all_single`` each way over the block, and ``post`` (eq. 8, whose statistics are whole
rows and columns) runs at the owner on the whole ``U``: the sharing is the owner's Newton-Schulz, nothing else.
The plan (:func:`assign`) decides per unit whether it is shared and by which block, for the step's schedule.
Every rank of a block takes part in its shared units in the plan's order (the bucket's, then the units'), so that
the collectives pair up (blocks of several sizes overlap; every rank walks the units in the same order, so no two
groups' collectives cross); an error on a member is kept on the step's commit (``StepContext.keep``) and zeros
go on, so that the others still receive what they wait for.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from ..orthogonalization import frobenius_normalize_
from .calls import StepContext
from .distributed import LocalSplit, assign_owners, exchange_flat, received_as
from .driver import HiddenRule, cost, matrix_shape
from .newton_schulz import NS_METHODS, method_flops

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]

#: One all-gather into one tensor: torch 2.13 names it ``all_gather_single`` (``all_gather_into_tensor`` deprecated).
_all_gather = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)

__all__ = ["FLOPS_PER_BLOCK_BYTE", "GRAM_CHUNKS", "TIE", "Blocks", "ReplicaShare", "SharedNS", "Shares", "assign",
           "assign_within",
           "block_bytes", "block_of", "block_sizes", "column_flops", "exposed_bytes", "gram_blocks", "gram_entries",
           "round_sum", "share", "share_flops", "shares_by_size", "split_of"]


def _quintic(group: dict) -> dict[str, Any] | None:
    """The keywords of ``group``'s method where it is the quintic (:func:`meqmuon.functional.orthogonalize`, plain or
    with its ``eps`` keywords), which the column split reproduces; ``None`` for another method."""
    fn = NS_METHODS[group["ns_method"]].function
    if fn is F.orthogonalize:
        return {}
    if isinstance(fn, functools.partial) and fn.func is F.orthogonalize and not fn.args:
        return dict(fn.keywords)
    return None


def column_flops(m: int, n: int, steps: int, g: int) -> int:
    """The busiest member's matmul FLOPs of ``steps`` column-split quintic iterations of an ``m x n`` matrix over
    ``g`` members: ``A_j = Z_j Z_j^T`` on ``ceil(L / g)`` columns, its upper trapezoids only (:func:`gram_entries`),
    ``B Z_j`` on as many, ``A^2`` on ``ceil(s / g)`` rows (``s = min(m, n)``, ``L = max(m, n)``)."""
    s, L = min(m, n), max(m, n)
    return steps * (2 * (s * s + gram_entries(s)) * -(-L // g) + 2 * s * s * -(-s // g))


def gram_blocks(s: int) -> list[tuple[int, int]]:
    """The row blocks ``[lo, hi)`` a column split's ``s x s`` Gram matrix is made and summed in, :data:`GRAM_CHUNKS`
    of them (:meth:`SharedNS._columns`). Block ``[lo, hi)`` is made on columns ``lo ..`` only: ``A`` is symmetric,
    so the columns before ``lo`` are the mirror of the blocks made before it."""
    chunks = min(GRAM_CHUNKS, s)
    bounds = [s * i // chunks for i in range(chunks + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _block_entries(s: int) -> list[int]:
    """The entries each of :func:`gram_blocks` makes and sums: ``(hi - lo) (s - lo)``, its upper trapezoid."""
    return [(hi - lo) * (s - lo) for lo, hi in gram_blocks(s)]


def gram_entries(s: int) -> int:
    """The entries of an ``s x s`` Gram matrix its :func:`gram_blocks` make and sum: ``sum (hi - lo) (s - lo)``,
    0.625 ``s^2`` for four blocks (the whole square's ``s^2`` before the mirror; ``s (s + 1) / 2`` at most blocks)."""
    return sum(_block_entries(s))


def unit_shapes(unit: Any) -> list[tuple[int, int]]:
    """The ``(rows, cols)`` of the matrices an owner makes of exchange unit ``unit`` (``exchange.Unit``)."""
    return unit.layout.shapes() if unit.layout is not None else [matrix_shape(unit.pieces.shape)]


#: What one byte a block member moves costs in the plan's balance, in FLOPs: an H100's calibrated bf16
#: Newton-Schulz rate over NVLink's achieved bandwidth, 464e12 / 370e9 (docs/benchmarks.md, the time model's
#: inputs), so that a unit is not shared where its block's collectives cost more than the FLOPs it saves.
FLOPS_PER_BLOCK_BYTE = 464e12 / 370e9


#: The row blocks a column split's Gram matrix is made and all-reduced in (:meth:`SharedNS._columns`): block ``i``'s
#: sum travels while block ``i + 1`` is made, so that all but one block's collective hide behind the Gram's matmul
#: where the link is the faster (:func:`exposed_bytes`). Four: at a 70B MLP matrix (``s = 8,192``) a block is a
#: 2,048-row product, still a large matmul, and three quarters of the all-reduce can hide.
GRAM_CHUNKS = 4


def _gram_itemsize(itemsize: int) -> int:
    """The bytes of one Gram entry on the block's link: float32 where the iteration's dtype is narrower."""
    return max(itemsize, 4)


def block_bytes(how: str, k: int, m: int, n: int, itemsize: int, g: int, steps: int) -> float:
    """The bytes the busiest member of a block of ``g`` (the owner) moves each way for a shared stack of ``k``
    ``m x n`` matrices: ``(g - 1) / g`` of the stack out and back in the Newton-Schulz dtype (``itemsize``), and
    for a column split per iteration the Gram matrices' ring all-reduce in float32 (``2 (g - 1) / g`` of their
    :func:`gram_entries`) and ``B``'s rows gathered (``(g - 1) / g`` of ``B``)."""
    nbytes = 2 * k * m * n * itemsize * (g - 1) / g
    if how == "columns":
        s = min(m, n)
        nbytes += steps * k * (g - 1) / g * (2 * gram_entries(s) * _gram_itemsize(itemsize) + s * s * itemsize)
    return nbytes


def exposed_bytes(how: str, k: int, m: int, n: int, itemsize: int, g: int, steps: int, flops_per_byte: float) -> float:
    """Of :func:`block_bytes`, those the busiest member waits for, where its matmuls do ``flops_per_byte`` FLOPs in
    the time the link moves a byte: the parts out and back and ``B``'s rows, whole; of each iteration's Gram
    all-reduce, made in :func:`gram_blocks` (block ``i``: ``R_i`` bytes, ``F_i = 2 k e_i ceil(L / g)`` FLOPs for its
    ``e_i`` entries), the last block's, and of each other what the next block's making does not cover::

        exposed Gram = R_last + sum_i<last max(0, R_i - F_i+1 / flops_per_byte)
    """
    nbytes = block_bytes(how, k, m, n, itemsize, g, steps)
    if how != "columns":
        return nbytes
    s, L = min(m, n), max(m, n)
    entries = _block_entries(s)
    sums = [2 * (g - 1) / g * k * e * _gram_itemsize(itemsize) for e in entries]
    made = [2 * k * e * -(-L // g) / flops_per_byte if flops_per_byte else math.inf for e in entries]  # 0: links free
    hidden = sum(min(r, f) for r, f in zip(sums[:-1], made[1:], strict=True))
    return nbytes - steps * hidden


def split_of(k: int, g: int) -> str:
    """How a block of ``g`` splits a unit of ``k`` same-shape matrices: ``"matrices"`` where every member gets one at
    least, else ``"columns"`` (each matrix by its columns, the quintic only)."""
    return "matrices" if k >= g else "columns"


def share(rule: Any, shapes: Sequence[tuple[int, int]], group: dict, g: int) -> tuple[str, float] | None:
    """How a unit of matrices ``shapes`` would be shared by ``g`` ranks and one member's predicted cost in
    ``driver.cost``'s unit: the busiest member's FLOPs plus the block bytes it waits for (:func:`exposed_bytes`) at
    :data:`FLOPS_PER_BLOCK_BYTE` (in the
    group's ``ns_dtype``; ``None``: bf16, a GPU's); or ``None`` where it is not shared: a rule without
    Newton-Schulz, matrices of several shapes, or fewer than ``g`` matrices and a method other than the quintic."""
    if g < 2 or not isinstance(rule, HiddenRule) or len(set(shapes)) != 1:
        return None
    (m, n), k = shapes[0], len(shapes)
    how = split_of(k, g)
    if how == "columns" and _quintic(group) is None:
        return None
    itemsize = (group["ns_dtype"] or torch.bfloat16).itemsize
    return how, (share_flops(how, shapes, group, g)
                 + FLOPS_PER_BLOCK_BYTE * exposed_bytes(how, k, m, n, itemsize, g, group["ns_steps"],
                                                        FLOPS_PER_BLOCK_BYTE))


def share_flops(how: str, shapes: Sequence[tuple[int, int]], group: dict, g: int) -> int:
    """The busiest member's Newton-Schulz FLOPs of a unit of same-shape matrices ``shapes`` shared ``how`` by ``g``
    ranks: ``ceil(K / g)`` matrices by the group's method, or each matrix's :func:`column_flops`."""
    (m, n), k = shapes[0], len(shapes)
    return (-(-k // g) * method_flops(group, m, n) if how == "matrices" else
            k * column_flops(m, n, group["ns_steps"], g))


#: A unit's shares by block size: ``{size: (how, one member's predicted cost)}`` (:func:`share` at each of
#: :func:`block_sizes`), empty where it is not shared.
Shares = dict[int, tuple[str, float]]


def block_sizes(g: int) -> list[int]:
    """The block sizes ``ns_group=g`` lets a unit be shared by, smallest first: every divisor of ``g`` above 1, each
    block ``size`` consecutive ranks within one of ``g``. A smaller block moves fewer bytes per FLOP shared (its
    ring all-reduce's ``2 (size - 1) / size`` of the Gram matrix against ``1 / size`` of the work): at Llama-3 405B
    an MLP matrix shared by 2 costs its pair 0.86x one owner's whole quintic, by 4 0.92x, by 8 1.03x (the plan's
    prices; below 1 where the mirrored Gram entries, :func:`gram_entries`, save more than the block's bytes cost)."""
    return [s for s in range(2, g + 1) if g % s == 0]


def shares_by_size(rule: Any, shapes: Sequence[tuple[int, int]], group: dict, g: int) -> Shares:
    """A unit's :func:`share` at each of :func:`block_sizes` of ``g`` where it is shared at all."""
    return {z: x for z in block_sizes(g) if (x := share(rule, shapes, group, z)) is not None}


def unit_prices(rule: Any, shapes: Sequence[tuple[int, int]], group: dict, g: int,
                memo: dict) -> tuple[Shares, float]:
    """A unit's :func:`shares_by_size` and its whole cost (``driver.cost`` of its matrices), made once per rule,
    shapes and param group in ``memo`` (one plan's; the group alive while it is made): the experts of a stack are
    alike, and DeepSeek-V3's stacks on their dimension 1 are 30,242 units."""
    key = (rule, tuple(shapes), id(group))
    if key not in memo:
        memo[key] = (shares_by_size(rule, shapes, group, g), sum(cost(rule, s, group) for s in shapes))
    return memo[key]


def block_of(rank: int, size: int) -> range:
    """The ranks of ``rank``'s block of ``size`` consecutive ranks (0: the rank alone, a whole unit's owner)."""
    return range(rank // size * size, rank // size * size + size) if size else range(rank, rank + 1)


def _ways(cost: float, shares: Shares, thrifty: bool) -> list[int]:
    """A unit's ways in the order :func:`_fill` tries them, as block sizes (0: whole): whole, then each block size
    smallest first (the fewest bytes a FLOP); or, ``thrifty``, the fewest rank-seconds first (``cost`` whole, ``z``
    times a member's cost in a block of ``z``), whole first among equals. A block of 2 can cost the pair less than
    one owner's whole quintic (the mirrored Gram entries save more than its bytes cost; 0.86x at a 405B MLP matrix,
    :func:`block_sizes`), so where whole units alone would fill the ranks the thrifty order packs more."""
    if not thrifty:
        return [0, *sorted(shares)]
    return [z for _, z in sorted([(cost, 0), *((z * x, z) for z, (_, x) in shares.items())])]


def _fill(costs: Sequence[float], shares: Sequence[Shares], load: list[float], limit: float, groups: Sequence[Any],
          tight: bool = False, thrifty: bool = False) -> tuple[list[int], list[int], list[float]] | None:
    """Longest first, each unit whole onto the least-loaded rank where that stays within ``limit``, else shared by
    the smallest block size (:func:`block_sizes`: the fewest bytes a FLOP) that has a block where that does (or,
    ``thrifty``, by the first of :func:`_ways` that fits); ``None`` where none does (``limit`` infinite: whole units
    alone, ``distributed.assign_owners``' greedy). Of that size, the block that holds the fewest shares of the
    unit's shape bucket (``groups[i]``), its busiest member least loaded among those (*spread*: each round's shares
    one per block before any block takes two, what a pipeline waiting on each round's busiest block wants); or,
    ``tight``, the one it fits tightest (best fit: blocks fill one after another and free ones are left for the
    whole units that follow, what every bucket in flight wants). Among equally loaded ranks, and among a block's
    members for a shared unit's owner (who receives it whole), one that holds the fewest units of the unit's
    bucket, so that no rank receives two of one round where another is free. Returns owners, the block size
    sharing each unit (0: whole), loads."""
    load, world = list(load), len(load)
    held: dict[tuple[Any, int], int] = {}
    per_block: dict[tuple[Any, int, int], int] = {}  # (bucket, size, block) -> its shares of that bucket
    # per bucket, every rank once by (load, units of the bucket it holds, rank): the least-loaded rank, ties to the
    # one with the fewest of the bucket, then the lowest. Both counts only grow, so an entry behind them is put back
    # with them when it comes to the top (one heap of loads had to pop every tied rank: 12M pops for DeepSeek-V3's
    # 30,242 experts on 1,024 ranks)
    heaps = {k: [(x, 0, r) for r, x in enumerate(load)] for k in dict.fromkeys(groups)}
    for h in heaps.values():
        heapq.heapify(h)
    # per block size, each block's busiest member's load (loads only grow: kept by max)
    busiest = {z: [max(load[b * z : (b + 1) * z]) for b in range(world // z)] for z in {z for s in shares for z in s}}
    ways: dict[tuple[float, int], list[int]] = {}  # by cost and shares (alike units share theirs: unit_prices)

    def add(r: int, x: float) -> None:
        load[r] += x
        for z, top in busiest.items():
            top[r // z] = max(top[r // z], load[r])

    owners, shared = [0] * len(costs), [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        h, k = heaps[groups[i]], groups[i]
        while (now := (load[h[0][2]], held.get((k, h[0][2]), 0), h[0][2])) != h[0]:
            heapq.heapreplace(h, now)
        x, _, r = h[0]
        if (costs[i], id(shares[i])) not in ways:
            ways[costs[i], id(shares[i])] = _ways(costs[i], shares[i], thrifty)
        z = next((z for z in ways[costs[i], id(shares[i])]
                  if (x + costs[i] if not z else min(busiest[z]) + shares[i][z][1]) <= limit), None)
        if z is None:
            return None
        if not z:
            owners[i] = r
            held[k, r] = held.get((k, r), 0) + 1
            add(r, costs[i])
            continue
        top, cost = busiest[z], shares[i][z][1]
        fits = [b for b in range(len(top)) if top[b] + cost <= limit]
        b = (max(fits, key=lambda b: (top[b], -b)) if tight else
             min(fits, key=lambda b: (per_block.get((groups[i], z, b), 0), top[b], b)))
        per_block[groups[i], z, b] = per_block.get((groups[i], z, b), 0) + 1
        members = block_of(b * z, z)
        owners[i], shared[i] = min(members, key=lambda q: (held.get((groups[i], q), 0), load[q], q)), z
        held[groups[i], owners[i]] = held.get((groups[i], owners[i]), 0) + 1
        for q in members:
            add(q, cost)
    return owners, shared, load


def _whole(costs: Sequence[float], load: list[float],
           groups: Sequence[Any]) -> tuple[list[int], list[int], list[float]]:
    """Every unit whole, :func:`_fill` without a limit (``distributed.assign_owners``' greedy)."""
    return _fill(costs, [{}] * len(costs), load, math.inf, groups)  # type: ignore[return-value]


def _bisect(costs: Sequence[float], shares: Sequence[Shares], load: list[float], groups: Sequence[Any], rounds: int,
            tight: bool, thrifty: bool = False,
            whole: tuple[list[int], list[int], list[float]] | None = None) -> tuple[list[int], list[int], list[float]]:
    """The plan of :func:`_fill` (``tight`` its block choice, ``thrifty`` its order of ways) at the smallest limit it
    places every unit within: ``rounds`` halvings between 0 and the busiest rank of whole units alone (``whole``,
    :func:`_whole` of the same arguments, where the caller made it already)."""
    owners, shared, best = whole or _whole(costs, load, groups)
    lo, hi = 0.0, max(best)
    for _ in range(rounds if any(shares) else 0):
        mid = (lo + hi) / 2
        plan = _fill(costs, shares, load, mid, groups, tight, thrifty)
        if plan is None:
            lo = mid
        else:
            (owners, shared, best), hi = plan, max(plan[2])
    return owners, shared, best


def round_sum(costs: Sequence[float], shares: Sequence[Shares], owners: Sequence[int], shared: Sequence[int],
              groups: Sequence[Any]) -> float:
    """The sum over shape buckets of the busiest rank's predicted load in that bucket: a pipeline's Newton-Schulz
    time where each bucket's way back waits on its busiest owner (``overlap=False`` or ``True``); a plan's busiest
    rank over all buckets (``max`` of its loads) is that of every bucket in flight (``overlap="all"``). ``shared``:
    the block size sharing each unit, 0 whole."""
    per: dict[tuple[Any, int], float] = {}
    for c, s, o, z, k in zip(costs, shares, owners, shared, groups, strict=True):
        for r in block_of(o, z):
            per[k, r] = per.get((k, r), 0.0) + (s[z][1] if z else c)
    busiest: dict[Any, float] = {}
    for (k, _), x in per.items():
        busiest[k] = max(busiest.get(k, 0.0), x)
    return sum(busiest.values())


#: How much of the earlier buckets' loads a bucket planned on its own starts from (:func:`_by_bucket`): enough to
#: break its ties toward the ranks with the least so far, too little to move its limit.
TIE = 1e-9


def _by_bucket(costs: Sequence[float], shares: Sequence[Shares], load: list[float], groups: Sequence[Any],
               rounds: int) -> tuple[list[int], list[int], list[float]]:
    """Each shape bucket planned on its own (:func:`_bisect`, spread), in the plan's order, as if the ranks were free
    (but for :data:`TIE` of what they hold so far): what a pipeline wants, whose buckets follow one another. Returns
    owners, block sizes and the total loads."""
    owners, shared, total = [0] * len(costs), [0] * len(costs), list(load)
    for k in dict.fromkeys(groups):
        units = [i for i, x in enumerate(groups) if x == k]
        start = [TIE * x for x in total]
        o, z, end = _bisect([costs[i] for i in units], [shares[i] for i in units], start, [k] * len(units), rounds,
                            False)
        for i, a, b in zip(units, o, z, strict=True):
            owners[i], shared[i] = a, b
        total = [x + e - s0 for x, e, s0 in zip(total, end, start, strict=True)]
    return owners, shared, total


def assign(costs: Sequence[float], shares: Sequence[Shares], load: list[float], groups: Sequence[Any] | None = None,
           rounds: int = 20, in_flight: bool = False) -> tuple[list[int], list[int]]:
    """The owner of each unit and the size of the block that shares it (0: none), so that the step's predicted
    Newton-Schulz time is least. Five plans: every unit at once with :func:`_fill`'s two block choices (each at
    the smallest limit it places every unit within, :func:`_bisect`), each bucket on its own (:func:`_by_bucket`),
    and every unit at once with the two block choices and each unit's ways fewest rank-seconds first
    (:func:`_ways`); kept, the one whose busiest bucket after bucket (:func:`round_sum`) is least, the busiest
    rank overall breaking ties, or with ``in_flight`` (every bucket in flight, ``overlap="all"``) the one whose
    busiest rank is least, the other breaking ties (docs/algorithm.md has the examples). In the first three, whole
    where a unit fits, so that a unit is shared only where whole units cannot reach the limit (its block's
    collectives and the members' extra work are paid only there), by the smallest block that reaches it; in the
    last two, the way of fewest rank-seconds that reaches it (a pair can cost less than one owner whole, the
    mirrored Gram matrix saving more than the pair's bytes cost). A shared unit's owner is its
    block's least-loaded member, and every member carries its share. ``shares``: each unit's by block size;
    ``load`` is updated in place (as ``distributed.assign_owners``'; ``groups``: each unit's shape bucket). Depends
    only on the arguments: identical on every rank, no collective."""
    groups = groups if groups is not None else [None] * len(costs)
    whole = _whole(costs, load, groups)  # every plan of all units at once starts from it
    plans = [_bisect(costs, shares, load, groups, rounds, False, whole=whole)]
    if any(shares):
        plans += [_bisect(costs, shares, load, groups, rounds, True, whole=whole),
                  _by_bucket(costs, shares, load, groups, rounds),
                  *(_bisect(costs, shares, load, groups, rounds, tight, True, whole=whole) for tight in (False, True))]

    def key(plan: tuple[list[int], list[int], list[float]]) -> tuple[float, float]:
        pipeline, busiest = round_sum(costs, shares, plan[0], plan[1], groups), max(plan[2])
        return (busiest, pipeline) if in_flight else (pipeline, busiest)

    owners, shared, best = min(plans, key=key)
    load[:] = best
    return owners, shared


def assign_within(within: Sequence[tuple[int, ...] | None], costs: Sequence[float], shares: Sequence[Shares],
                  load: list[float], groups: Sequence[Any], *, share: bool, in_flight: bool = False,
                  mirrors: Sequence[Callable[[int], Sequence[int]] | None] | None = None
                  ) -> tuple[list[int], list[int]]:
    """The owner of each unit and its block's size (:func:`assign`; without ``share``, ``distributed.assign_owners``
    and no block), each unit whose pieces only the ranks ``within[i]`` hold (not ``None``: an expert of a stack that
    FSDP2 shards on dimension 0 over ``dp`` and TP splits over ``tp``, whose pieces lie on its TP group, a node's
    GPUs) owned by one of them, so that its exchange stays among them. Those units are planned first, each set of
    ranks as a world of its own on their loads (shared only by blocks inside it: where it is consecutive ranks
    aligned to its size), then the others on every rank. Without such units, :func:`assign`'s plan itself.
    ``mirrors[i]`` (where not ``None``): the ranks that repeat unit ``i``'s work in the other replica groups, given
    its owner (``owners.Pieces.mirrors``; such a unit is whole, and ``within[i]`` its first replica group's ranks):
    each is charged its cost as the owner is, so that the balance counts what every rank computes.
    ``load`` is updated in place; identical on every rank, no collective."""
    owners, shared = [0] * len(costs), [0] * len(costs)
    sets: dict[tuple[int, ...] | None, list[int]] = {}
    for i, w in enumerate(within):
        sets.setdefault(w, []).append(i)
    free = sets.pop(None, [])
    for ranks, idx in [*sorted(sets.items()), *([(None, free)] if free else [])]:
        world = ranks or range(len(load))
        aligned = ranks is None or (ranks == tuple(range(ranks[0], ranks[0] + len(ranks)))
                                    and not ranks[0] % len(ranks))
        sub = [load[r] for r in world]
        offered = [{z: v for z, v in shares[i].items() if aligned and not len(world) % z} for i in idx]
        c, g = [costs[i] for i in idx], [groups[i] for i in idx]
        o, z = assign(c, offered, sub, g, in_flight=in_flight) if share else (assign_owners(c, sub, g), [0] * len(c))
        for i, a, b in zip(idx, o, z, strict=True):
            owners[i], shared[i] = world[a], b
        for r, x in zip(world, sub, strict=True):
            load[r] = x
        for i in idx:
            for m in mirrors[i](owners[i]) if mirrors and mirrors[i] else ():
                load[m] += costs[i]
    return owners, shared


class Blocks:
    """The blocks of ``size`` consecutive ranks of the optimizer's process group ``pg``, one process group each
    (made by every rank in the same order, as ``torch.distributed.new_group`` asks), and this rank's."""

    def __init__(self, pg: Any, size: int, name: str = "ns_group") -> None:
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        self.check(size, world, name)
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(world))
        self.size, self.rank = size, rank
        #: This rank's block, and its place in it (its rank in :attr:`pg`).
        self.index, self.place = divmod(rank, size)
        groups = [dist.new_group(ranks[b * size : (b + 1) * size]) for b in range(world // size)]
        #: This rank's block's process group (block-local ranks ``0 .. size - 1``).
        self.pg = groups[self.index]

    @staticmethod
    def check(size: int, world: int, name: str = "ns_group") -> None:
        """Refuses blocks of ``size`` that do not divide ``world`` ranks, naming the optimizer's keyword ``name``."""
        if size < 1 or world % size:
            raise ValueError(f"{name}={size} must divide the optimizer's {world} ranks (its blocks are consecutive "
                             "ranks, a node's GPUs)")

    def members(self, owner: int) -> range:
        """The ranks (of the optimizer's group) of ``owner``'s block."""
        return block_of(owner, self.size)


def _put(parts: Sequence[Tensor], me: int, mine: Tensor, got: Tensor) -> None:
    """Every member's part into ``parts`` (views of one whole): this member's ``mine``, the others' from ``got``, the
    bytes an :func:`~.distributed.exchange_flat` received from them in member order."""
    start = 0
    for j, part in enumerate(parts):
        if j == me:
            part.copy_(mine)
            continue
        n = part.numel() * part.element_size()
        part.copy_(received_as(got[start : start + n], part.dtype, part.shape))
        start += n


class SharedNS:
    """One shared unit's Newton-Schulz on a block: called at the owner as the group's method is
    (``driver.directions``' ``ns``: ``(X, steps, coefficients, dtype, batched=, out=, ...)`` of the unit's stack
    ``(K, m, n)``, returning ``U``), and on every other member with :meth:`help`. Both run :meth:`_run`, the same
    collectives in the same order. ``owner``: the owner's place in the block. ``done``: whether the collectives
    have run (an owner whose ``pre`` raised runs them with zeros, :meth:`finish`)."""

    def __init__(self, blocks: Blocks, owner: int, how: str, shape: tuple[int, int, int], group: dict,
                 dtype: torch.dtype, batched: bool, device: torch.device, ctx: StepContext) -> None:
        self.blocks, self.owner, self.how, self.shape, self.group = blocks, owner % blocks.size, how, shape, group
        self.dtype, self.batched, self.device, self.ctx = dtype, batched, device, ctx
        self.done = False

    def __call__(self, X: Tensor, steps: int, coefficients: Any, dtype: torch.dtype, *, batched: bool = False,
                 out: Tensor | None = None, inplace: bool = False, **_: Any) -> Tensor:
        U = self._run(X.reshape(self.shape).to(dtype, copy=not inplace))  # scratch only where the caller says so
        return U.view(X.shape) if out is None else out.copy_(U.view(X.shape))

    def help(self) -> None:
        """A member's part of the owner's unit."""
        self._run(None)

    def finish(self) -> None:
        """The collectives with zeros, where the owner's computation raised before they ran."""
        if not self.done:
            self._run(torch.zeros(self.shape, dtype=self.dtype, device=self.device))

    def _kept(self, like: Tensor, fn: Any, *args: Any, **kwargs: Any) -> Tensor:
        """``fn(*args, **kwargs)``, or zeros like ``like`` where it raised (the error kept on the step's commit), so
        that the block's collectives still pair up."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            self.ctx.keep(e)
            return torch.zeros_like(like)

    def _parts(self, t: Tensor) -> tuple[Tensor, ...]:
        """The members' parts of a whole stack ``t``, views: its matrices, or its columns of the wide orientation (the
        first ``n % g`` members one more, ``torch.tensor_split``'s)."""
        _, m, n = self.shape
        g = self.blocks.size
        return t.tensor_split(g) if self.how == "matrices" else (t.mT if m > n else t).tensor_split(g, dim=-1)

    def _run(self, X: Tensor | None) -> Tensor | None:
        """The parts of ``X`` (the owner's stack, scratch; ``None`` on the other members) out over the block, each
        member's part through Newton-Schulz, the parts back to the owner, put together there in ``X``."""
        self.done = True
        g, me, owner, pg = self.blocks.size, self.blocks.place, self.owner, self.blocks.pg
        like = self._parts(torch.empty(self.shape, dtype=self.dtype, device="meta"))
        sizes = [p.numel() * self.dtype.itemsize for p in like]
        if X is not None and self.how == "columns":  # the owner normalises, as the quintic's first line
            X = self._kept(X, self._normalised, X)
        parts = self._parts(X) if X is not None else None
        send = [[parts[j]] if parts is not None and j != me else [] for j in range(g)]
        got = exchange_flat(send, [sizes[me] if j == owner != me else 0 for j in range(g)], pg, self.device)
        mine = parts[me].contiguous() if parts is not None else received_as(got, self.dtype, like[me].shape)
        mine = self._kept(mine, self._iterate, mine) if self.how == "matrices" else self._columns(mine)
        back = exchange_flat([[mine] if j == owner != me else [] for j in range(g)],
                             [sizes[j] if parts is not None and j != me else 0 for j in range(g)], pg, self.device)
        if parts is None:
            return None
        _put(parts, me, mine, back)
        return X

    def _normalised(self, X: Tensor) -> Tensor:
        """Each matrix of ``X`` normalised in place as the quintic's first line (``frobenius_normalize_``, with the
        method's ``eps`` and the schedule's scale)."""
        keywords = _quintic(self.group)
        _, scale = F.ns_schedule(self.group["ns_coefficients"], self.group["ns_steps"])
        for x in X:
            frobenius_normalize_(x, scale, keywords.get("eps", F.NS_EPS), keywords.get("eps_added", False))
        return X

    def _iterate(self, X: Tensor) -> Tensor:
        """A member's range of whole matrices through the group's method, as an owner runs them."""
        group = self.group
        return NS_METHODS[group["ns_method"]].function(X, group["ns_steps"], group["ns_coefficients"], self.dtype,
                                                      batched=self.batched, inplace=True)

    def _columns(self, Z: Tensor) -> Tensor:
        """A member's columns ``Z_j`` ``(K, s, L_j)`` of the wide orientation through the quintic's iterations: the
        Gram matrices summed over the block (in float32 where the iteration's dtype is narrower) by blocks of rows,
        each posted as soon as it is made (:data:`GRAM_CHUNKS`), ``B``'s rows made by their members and gathered."""
        g, me, itemsize = self.blocks.size, self.blocks.place, self.dtype.itemsize
        k, s = Z.shape[0], Z.shape[1]
        sizes = [p.numel() * itemsize for p in torch.empty(k, s, s, device="meta").tensor_split(g, dim=1)]
        schedule, _ = F.ns_schedule(self.group["ns_coefficients"], self.group["ns_steps"])
        for a, b, c in schedule:
            A, posted = Z.new_empty(k, s, s), []
            for lo, hi in gram_blocks(s):  # rows lo:hi on columns lo: (A is symmetric: the rest is their mirror)
                part = self._kept(A[:, lo:hi, lo:], torch.bmm, Z[:, lo:hi], Z[:, lo:].mT)
                total = part.float() if itemsize < 4 else part
                posted.append((lo, hi, total, dist.all_reduce(total, group=self.blocks.pg, async_op=True)))
            for lo, hi, total, work in posted:  # waited in posting order: on a GPU the stream waits, not the host
                work.wait()
                A[:, lo:, lo:hi] = total.mT  # the mirror first, so that the rows made here win their diagonal block
                A[:, lo:hi, lo:] = total  # rounded once to the iteration's dtype, as one process's product
            del posted
            rows = A.tensor_split(g, dim=1)[me]
            mine = self._kept(rows, torch.baddbmm, rows, rows, A, beta=b, alpha=c)
            got = exchange_flat([[mine] if j != me else [] for j in range(g)],
                                [n if j != me else 0 for j, n in enumerate(sizes)], self.blocks.pg, Z.device)
            B = torch.empty_like(A)
            _put(B.tensor_split(g, dim=1), me, mine, got)
            Z = self._kept(Z, torch.baddbmm, Z, B, Z, beta=a)
        return Z


class ReplicaShare(LocalSplit):
    """``placement.LOCAL``'s splitter for whole matrices that the ranks of a block hold alike, with ``ns_group``: a
    stack FSDP2 shards on the ``dp`` sub-mesh of a module tensor parallelism leaves alone (DeepSeek-V3's experts under
    FSDP2 x TP, repeated over ``tp``), a hidden ``Replicate()`` DTensor. Without it every member orthogonalises the
    same matrices (DeepSeek-V3 on 128 x 8 ranks: 348 expert matrices, 536 ms at each rank of a TP group,
    docs/benchmarks.md). With it each member orthogonalises its rows of every stack (:meth:`rows`) with the group's
    method, and all-gathers over the block (``pg``, the mesh dimension that replicates: consecutive ranks, a node's)
    put the stack together on every member: the work once, and every member the same bits. The stack goes in
    :data:`GATHER_ROUNDS` rounds, each round's all-gather in flight while the members compute the next.
    ``post`` runs on the whole stack at every member, as before. The batched form only (``forms.batched``);
    ``place``: this rank's place in the block."""

    #: The rounds a stack is gathered in (fewer where it has fewer than ``g`` matrices a round): a round's gather
    #: travels while the next round computes, so that what waits is the last round's, a quarter of the gather.
    GATHER_ROUNDS = 4

    def __init__(self, pg: Any, size: int, place: int) -> None:
        super().__init__()
        self.pg, self.size, self.place = pg, size, place

    @classmethod
    def rows(cls, k: int, g: int) -> tuple[int, int]:
        """How a stack of ``k`` matrices is cut for a block of ``g``: ``(rounds, s)``, round ``q`` its rows
        ``[q g s, (q + 1) g s)``, member ``j``'s ``[q g s + j s, q g s + (j + 1) s)`` of them (those below ``k``), so
        that each round's all-gather lands in place: ``s = ceil(k / (g min(GATHER_ROUNDS, ceil(k / g))))`` and
        ``ceil(k / (g s))`` rounds."""
        s = -(-k // (g * max(1, min(cls.GATHER_ROUNDS, -(-k // g)))))
        return -(-k // (g * s)), s  # no round of padding alone

    @classmethod
    def spans(cls, k: int, g: int, j: int) -> list[tuple[int, int]]:
        """Member ``j``'s rows ``[lo, hi)`` of a stack of ``k`` for a block of ``g``, round by round (:meth:`rows`;
        empty where the stack has ended)."""
        rounds, s = cls.rows(k, g)
        return [(min(q * g * s + j * s, k), min(q * g * s + j * s + s, k)) for q in range(rounds)]

    def ns_for(self, group: dict, ctx: StepContext) -> Callable[..., Tensor]:
        """``group``'s method on this member's rows of a stack ``X`` (:meth:`rows`), a round at a time, each round's
        part padded with zeros to ``s`` rows and all-gathered while the next round computes: the stack's ``U`` on
        every member (an error kept on ``ctx``, zeros in its place, so that the gathers still pair up)."""
        method = NS_METHODS[group["ns_method"]].function

        def share(X: Tensor, steps: int, coefficients: Any, dtype: torch.dtype, *, out: Tensor | None = None,
                  **kwargs: Any) -> Tensor:
            k, g = X.shape[0], self.size
            rounds, s = self.rows(k, g)
            whole = X.new_empty((rounds * g * s, *X.shape[1:]), dtype=dtype)
            pending = []
            for q, (lo, hi) in enumerate(self.spans(k, g, self.place)):
                mine = None
                if hi > lo:
                    try:
                        mine = method(X[lo:hi], steps, coefficients, dtype, **kwargs)
                    except Exception as e:  # kept on the step's commit; zeros go on, so the block's gathers pair up
                        ctx.keep(e)
                if mine is None or mine.shape[0] < s or mine.dtype != dtype or not mine.is_contiguous():
                    padded = X.new_zeros((s, *X.shape[1:]), dtype=dtype)
                    if mine is not None:
                        padded[: mine.shape[0]] = mine
                    mine = padded
                pending.append((_all_gather(whole[q * g * s : (q + 1) * g * s], mine, group=self.pg, async_op=True),
                                mine))
            for work, _ in pending:
                work.wait()
            return whole[:k] if out is None else out.copy_(whole[:k])

        return share
