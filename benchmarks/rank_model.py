"""Every rank's share of an optimizer step, read off the plan that any one rank makes (issue 47, item 5):
which rank of a simulated layout moves the most bytes and which runs the most Newton-Schulz FLOPs, the
bytes that whole-matrix owners cannot avoid, and AdamW's state on the same layout.

The optimizer's plan is deterministic and needs no collective: one exchange per optimizer
(``meqmuon.optim.exchange.Exchange``, ``opt._exchange``) plans the owner of every unit once, longest first
over all of them (``distributed.assign_owners``), from the same costs on every rank, and reads where every
rank's piece lies off the placements (``owners.Pieces``), so one simulated rank knows every rank's work. For
each hidden-kind parameter (the Newton-Schulz kind), per rank ``r`` of the default group:

- ``local[r]``: elements of its pieces of the matrices it does not hold whole, the exchange's units
  (``Pieces.numel(r)``; what the floor counts: ``step_accounting.floor_bytes = 2 x itemsize x local[r]``);
- ``owned[r]``: elements of the whole units it puts together and orthogonalises for its replica group (its
  own pieces of them included; under replicated mesh dimensions each replica group has its owner,
  ``Exchange.owner_of``);
- ``flops[r]``: the Newton-Schulz FLOPs it runs (``newton_schulz.method_flops``): its owned units' matrices,
  its whole local matrices (experts ``Shard(0)``), and every matrix it holds replicated (``Replicate()``).
- ``rounds``: the same work by exchange round, for a time model (``benchmarks/time_model.py``): one per shape
  bucket of a call, as ``exchange.step`` exchanges them (one ``all_to_all_single`` out and one back per bucket:
  the exchange's units grouped by the matrix shape of their global shape), each with every rank's ``local``
  elements in it and how many units each owner receives whole (``owned``: ``[rank, count]`` pairs; a unit's
  ``matrices``: its view's matrices) and of them the ones a block shares (``shared``: ``[owner, how, block
  size]`` per unit, ``shared_ns``; ``block``: the optimizer's ``ns_group``, the largest); whole local matrices are
  rounds without an exchange (``local`` empty). A shared unit's FLOPs are its members' shares (``shared_ns.share``).
  Each round's ``local`` and owned elements also by peer (``near``, ``far``, ``near_owned``, ``far_owned``: with
  the ranks of one's node of :data:`NODE_RANKS`, or the others; a rank's own piece neither), for the links the
  time model prices them on.
  Whole local matrices a block holds alike (``shared_ns.ReplicaShare``) are each member's rows of the block's
  ``K`` (``replicas``: ``z``; ``ReplicaShare.rows``), ``gathered``: the bytes each rank receives of the others' parts,
  in ``gather_rounds`` all-gathers.

**The reachable bound.** With whole-matrix Newton-Schulz at owners, rank ``r`` must send its pieces as
Newton-Schulz input and the directions of every piece of its owned matrices, and receive those pieces and
its own directions, counted as ``StepMeter`` counts an ``all_to_all_single`` (the share a rank keeps for
itself included): ``bound[r] = itemsize x (local[r] + owned[r])`` each way, in the Newton-Schulz dtype. The
floor, ``2 x itemsize x local[r]``, is this with ``owned[r] = local[r]`` (each rank owns its share); a rank
owning more than its share cannot reach the floor, one owning less moves less than it. Averaged over ranks
the two agree (``sum(owned) = sum(local)`` for every layout without replication).

Reads the engine's kept plan (``RoleOptimizer._plan()``: each entry's ``path`` and exchange ``units``;
``opt._exchange``: the units' descriptors and owners): a benchmark's window into internals, checked against
the measured bytes and FLOPs of every rank in ``tests/test_scale_sim.py`` (fake group, every rank simulated)
and against real gloo bytes, so that a change of the assignment shows there.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from hardware import PEERS  # the keys of a round's bytes by peer, in hardware.Split's order

__all__ = ["NODE_RANKS", "PEERS", "RankModel", "adamw_bytes", "local_numels", "rank_model"]

#: The node the rounds' bytes by peer are counted for: 8 GPUs (an H100 or H200 node; ``hardware.Hardware``'s
#: ``ranks_per_node``, which the time model checks against it).
NODE_RANKS = 8


def _coords(mesh) -> dict[int, tuple[int, ...]]:
    """Global rank -> its coordinate on ``mesh`` (ranks outside the mesh absent)."""
    grid = mesh.mesh
    return {int(grid[idx]): idx for idx in itertools.product(*(range(n) for n in grid.shape))}


def local_numels(p: torch.Tensor, world: int, cache: dict | None = None) -> list[int]:
    """Elements of DTensor ``p``'s local piece on every rank ``0..world-1`` (0 outside its mesh), from torch's
    own ``_compute_local_shape_and_global_offset`` (uneven and empty shards included); a plain tensor is
    whole on every rank."""
    if not hasattr(p, "placements"):
        return [p.numel()] * world
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    cache = {} if cache is None else cache
    key = (tuple(p.shape), tuple(p.placements), id(p.device_mesh))
    if key not in cache:
        mesh = p.device_mesh
        coords = _coords(mesh)
        out = [0] * world
        for r, c in coords.items():
            shape, _ = _compute_local_shape_and_global_offset(p.shape, tuple(mesh.mesh.shape), list(c), p.placements)
            out[r] = math.prod(shape)
        cache[key] = out
    return cache[key]


@dataclass
class RankModel:
    """Per rank of the default group: ``local``, ``owned`` (elements) and ``flops`` (see the module)."""

    world: int
    itemsize: int
    local: list[int] = field(default_factory=list)
    owned: list[int] = field(default_factory=list)
    flops: list[int] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)

    def floor(self, r: int) -> int:
        return 2 * self.itemsize * self.local[r]

    def bound(self, r: int) -> int:
        """What whole-matrix owners cannot avoid, each way (see the module)."""
        return self.itemsize * (self.local[r] + self.owned[r])

    def busiest(self) -> dict[str, int]:
        """The ranks to simulate: the most bytes, the most bytes per byte of floor, the most FLOPs, and the
        least bound per byte of floor (where an exchange that moves the same bytes on every rank, padded,
        is furthest from its bound); ties: the lowest rank."""
        ranks = range(self.world)
        per_floor = [self.bound(r) / self.floor(r) if self.floor(r) else 0.0 for r in ranks]
        return {"bytes": max(ranks, key=lambda r: (self.bound(r), -r)),
                "bytes / floor": max(ranks, key=lambda r: (per_floor[r], -r)),
                "flops": max(ranks, key=lambda r: (self.flops[r], -r)),
                "least bound / floor": min(ranks, key=lambda r: (per_floor[r] if self.floor(r) else math.inf, r))}

    def mean_bound_over_floor(self) -> float:
        """The mean over ranks with a floor of ``bound / floor``."""
        ratios = [self.bound(r) / self.floor(r) for r in range(self.world) if self.floor(r)]
        return sum(ratios) / len(ratios) if ratios else 0.0


def rank_model(opt: torch.optim.Optimizer, itemsize: int) -> RankModel:
    """:class:`RankModel` of a MeqMuon-family optimizer (``meqmuon.optim.engine.RoleOptimizer``) after its
    first step, on any rank. ``itemsize``: of the Newton-Schulz dtype.

    Raises:
        NotImplementedError: for what the model does not know: DDP's plain tensors (``owners.Replicas``: each
            direction is broadcast whole, not exchanged in pieces) and a hidden-kind parameter on the row-sums
            path (``Path.ROWS``: a rule without Newton-Schulz).
    """
    import torch.distributed as dist

    from meqmuon.optim.driver import matrix_shape
    from meqmuon.optim.newton_schulz import method_flops
    from meqmuon.optim.owners import Replicas
    from meqmuon.optim.placement import Path
    from meqmuon.optim.shared_ns import ReplicaShare, share_flops

    world = dist.get_world_size()
    model = RankModel(world, itemsize, [0] * world, [0] * world, [0] * world)
    ex, cache = opt._exchange, {}
    block = getattr(opt, "_ns_group", 1)  # the largest block a unit may be shared by
    rounds: dict[tuple, dict] = {}  # (call, dtype, m, n) -> round, in first-appearance order
    alike: dict[tuple[int, int], list] = {}  # (round, descriptor) -> [round, descriptor, units]

    def round_of(key: tuple, m: int, n: int, exchanged: bool, matrices: list | None = None) -> dict:
        return rounds.setdefault(key, {"shape": [m, n], "matrices": [list(s) for s in matrices or [(m, n)]],
                                       "local": [0] * world if exchanged else [], "owned": {}, "shared": [],
                                       "block": block, "node": NODE_RANKS,
                                       **{k: [0] * world if exchanged else [] for k in PEERS}})

    def by_peer(rnd: dict, r: int, q: int, n: int) -> None:  # rank r's n elements for owner q, by their link
        if q != r:
            near = q // NODE_RANKS == r // NODE_RANKS
            rnd["near" if near else "far"][r] += n
            rnd["near_owned" if near else "far_owned"][q] += n

    for index, (group, entries, batched) in enumerate(opt._plan()):
        for e in entries:
            if e.kind != "hidden":
                continue
            shapes = e.layout.shapes()
            if e.path is Path.LOCAL:  # whole local matrices: replicated, or a stack's own members
                total = sum(method_flops(group, m, n) for m, n in shapes)
                z = e.split.size if isinstance(e.split, ReplicaShare) else 1  # a block's alike, shared (below)
                blocks: dict[int, int] = {}  # a block's first rank (blocks of z aligned ranks) -> its elements
                for r, n in enumerate(local_numels(e.param, world, cache)):
                    if z > 1:
                        blocks[r - r % z] = n or blocks.get(r - r % z, 0)
                        continue
                    model.flops[r] += total * n // e.param.numel()
                    for (m, c), k in Counter(shapes).items() if n else ():  # the whole matrices rank r holds
                        rnd = round_of(("local", m, c), m, c, False)
                        rnd["owned"][r] = rnd["owned"].get(r, 0) + k * n // e.param.numel()
                for (first, n), ((m, c), k) in itertools.product(blocks.items(), Counter(shapes).items()):
                    # shared at the end, in the batched form's bucket (make_buckets: (n, m) joins (m, n) matrices)
                    rnd = round_of(("alike", *(sorted((m, c)) if e.rule.transposes else (m, c))), m, c, False)
                    held = rnd.setdefault("alike", {})
                    held[first] = held.get(first, 0) + k * n // e.param.numel()
                    rnd["replicas"], rnd["matrix_flops"] = z, method_flops(group, m, c)
                continue
            if e.path is not Path.OWNERS:
                raise NotImplementedError(f"rank_model: path {e.path} of {e.name}")
            # the step's call (engine._calls: a per-tensor group alone, batched ones merged by rule and values)
            values = sorted({"lr", "weight_decay", *e.rule.hyperparameters})
            call = (e.rule.name, *(repr(group[k]) for k in values)) if batched else index
            for i in e.units:
                unit = ex.units[i]
                if isinstance(unit.pieces, Replicas):
                    raise NotImplementedError(f"rank_model: DDP's plain tensor {e.name} (broadcast whole)")
                matrices = unit.layout.shapes() if unit.layout is not None else [matrix_shape(unit.pieces.shape)]
                total = sum(method_flops(group, m, n) for m, n in matrices)
                rnd = round_of((call, e.param.dtype, *matrix_shape(unit.pieces.shape)), *matrices[0], True, matrices)
                if unit.pieces.replicated_dims:  # an owner per replica group
                    owners = set()
                    for r in range(world):
                        n, q = unit.pieces.numel(r), ex.owner_of(unit, r)
                        model.local[r] += n
                        model.owned[q] += n
                        rnd["local"][r] += n
                        by_peer(rnd, r, q, n)
                        owners.add(q)
                else:  # one owner, every rank's piece: added per descriptor below (an expert's units share one)
                    owners = {unit.assigned}
                    model.owned[unit.assigned] += math.prod(unit.pieces.shape)
                    alike.setdefault((id(rnd), id(unit.pieces)), [rnd, unit.pieces, Counter()])[2][unit.assigned] += 1
                for q in owners:
                    rnd["owned"][q] = rnd["owned"].get(q, 0) + 1
                    if unit.shared is None:
                        model.flops[q] += total
                        continue
                    rnd["shared"].append([q, unit.shared, unit.block])
                    part = share_flops(unit.shared, matrices, group, unit.block)  # FLOPs: no link priced in
                    for member in ex.blocks[unit.block].members(q):
                        model.flops[member] += part
    for rnd in rounds.values():  # a block's alike stack: each member ceil(K / z) of its K, the others' gathered
        z, (m, c), flops = rnd.get("replicas", 1), rnd["shape"], rnd.pop("matrix_flops", 0)
        for first, k in rnd.pop("alike", {}).items():
            n, s = ReplicaShare.rows(k, z)  # n rounds of s matrices a member
            rnd["gather_rounds"] = max(n, rnd.get("gather_rounds", 1))
            for j in range(z):
                mine = sum(hi - lo for lo, hi in ReplicaShare.spans(k, z, j))
                rnd["owned"][first + j] = rnd["owned"].get(first + j, 0) + mine
                model.flops[first + j] += mine * flops
                rnd.setdefault("gathered", [0] * world)[first + j] += (z - 1) * n * s * m * c * itemsize
    for rnd, pieces, owners in alike.values():  # the units of one descriptor: every rank's piece once per unit
        count, nodes, held = sum(owners.values()), Counter(), {}
        for q, k in owners.items():
            nodes[q // NODE_RANKS] += k
        for r in range(world):
            if n := pieces.numel(r):
                held[r] = n
                model.local[r] += count * n
                rnd["local"][r] += count * n
        node_held = Counter()
        for r, n in held.items():
            node_held[r // NODE_RANKS] += n
        for r, n in held.items():  # to the owners in its node but itself, and to the others
            rnd["near"][r] += n * (nodes[r // NODE_RANKS] - owners.get(r, 0))
            rnd["far"][r] += n * (count - nodes[r // NODE_RANKS])
        total = sum(held.values())
        for q, k in owners.items():  # an owner's units' pieces from its node's other ranks, and from the others
            here = node_held[q // NODE_RANKS]
            rnd["near_owned"][q] += k * (here - held.get(q, 0))
            rnd["far_owned"][q] += k * (total - here)
    model.rounds = [{**r, "owned": sorted(r["owned"].items())} for r in rounds.values()]
    return model


def adamw_bytes(params) -> int:
    """The bytes of ``torch.optim.AdamW``'s state for ``params`` on this rank: ``exp_avg`` and ``exp_avg_sq``
    of each local piece, in the parameter's dtype, and a float32 ``step`` per parameter
    (``torch.optim.adam``'s ``_init_group``, capturable off)."""
    return sum(2 * getattr(p, "_local_tensor", p).numel() * p.element_size() + 4 for p in params)
