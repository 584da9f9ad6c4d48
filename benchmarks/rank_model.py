"""Every rank's share of an optimizer step, read off the plan that any one rank makes (issue 47, item 5):
which rank of a simulated layout moves the most bytes and which runs the most Newton-Schulz FLOPs, the
bytes that whole-matrix owners cannot avoid, and AdamW's state on the same layout.

The optimizer's plan is deterministic and needs no collective (``owners.OwnerPlan``: every rank assigns every
owner from the same costs; the FSDP2 row path: ``distributed.assign_counts`` per shape bucket), so one
simulated rank knows every rank's work. For each hidden-kind parameter (the Newton-Schulz kind), per rank
``r`` of the default group:

- ``local[r]``: elements of its pieces of matrices it does not hold whole (what the floor counts:
  ``step_accounting.floor_bytes = 2 x itemsize x local[r]``), read from the placements by torch's own
  ``_compute_local_shape_and_global_offset``;
- ``owned[r]``: elements of the whole matrices it puts together and orthogonalises for its replica group
  (its own pieces of them included);
- ``flops[r]``: the Newton-Schulz FLOPs it runs (``newton_schulz.method_flops``): its owned matrices, its
  whole local matrices (experts ``Shard(0)``), and every matrix it holds replicated (``Replicate()``);
- ``rounds``: the same work by exchange round, for a time model (``benchmarks/time_model.py``): one per shape
  bucket, as the step exchanges them (one ``all_to_all_single`` out and one back per bucket, on the row path
  and the owner path alike), each with every rank's ``local`` elements in it and how many units of work each
  owner orthogonalises (``owned``: ``[rank, count]`` pairs; a unit is ``matrices``: one matrix of the bucket's
  ``shape`` on the row path, a parameter's matrices on the owner path, whose bucket is the parameter's shape);
  whole local matrices are rounds without an exchange (``local`` empty).

**The reachable bound.** With whole-matrix Newton-Schulz at owners, rank ``r`` must send its pieces as
Newton-Schulz input and the directions of every piece of its owned matrices, and receive those pieces and
its own directions, counted as ``StepMeter`` counts an ``all_to_all_single`` (the share a rank keeps for
itself included): ``bound[r] = itemsize x (local[r] + owned[r])`` each way, in the Newton-Schulz dtype. The
floor, ``2 x itemsize x local[r]``, is this with ``owned[r] = local[r]`` (each rank owns its share); a rank
owning more than its share cannot reach the floor, one owning less moves less than it. Averaged over ranks
the two agree (``sum(owned) = sum(local)`` for every layout without replication).

Reads the engine's kept plan (``RoleOptimizer._plan()``, ``_owners``, ``_owned``): a benchmark's window into
internals, checked against the measured bytes and FLOPs of every rank in ``tests/test_scale_sim.py`` (fake
group, every rank simulated) and against real gloo bytes, so that a change of the assignment shows there.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

import torch

__all__ = ["RankModel", "adamw_bytes", "local_numels", "rank_model"]


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
        NotImplementedError: for a path the model does not know (DDP's plain tensors, row shards on a
            group smaller than the world).
    """
    import torch.distributed as dist

    from meqmuon.optim import distributed, driver
    from meqmuon.optim.distributed import assign_counts
    from meqmuon.optim.newton_schulz import method_flops
    from meqmuon.optim.placement import Path

    world = dist.get_world_size()
    model = RankModel(world, itemsize, [0] * world, [0] * world, [0] * world)
    cache: dict = {}
    rounds: dict[tuple, dict] = {}  # (path, m, n) -> round, in first-appearance order

    def round_of(key: tuple, m: int, n: int, exchanged: bool, matrices: list | None = None) -> dict:
        return rounds.setdefault(key, {"shape": [m, n], "matrices": [list(s) for s in matrices or [(m, n)]],
                                       "local": [0] * world if exchanged else [], "owned": {}})
    # the row path's owners: carried from the owner path's planned work where the splitter has one
    # (``ShardedSplit.bucket_owners``: every bucket of a call at once, longest first); else each bucket from
    # no load (``assign_counts``: the left-over matrices to the lowest ranks)
    load = list(opt._owners.load) if getattr(opt._owners, "load", None) is not None else [0.0] * world
    for call, (group, entries, split, _) in enumerate(opt._plan()):
        buckets: dict[tuple, list] = {}  # shape bucket (first-appearance order) -> [count, FLOPs, cost]
        for e in entries:
            if e.kind != "hidden":
                continue
            shapes = e.layout.shapes()
            numels = local_numels(e.param, world, cache)
            if e.path is Path.ROWS:
                if split.world_size != world:
                    raise NotImplementedError("rank_model: row shards on a group of part of the world (HSDP)")
                for r, n in enumerate(numels):
                    model.local[r] += n
                for m, n in shapes:
                    b = buckets.setdefault((e.param.dtype, m, n), [0, method_flops(group, m, n),
                                                                   driver.cost(e.rule, (m, n), group)])
                    b[0] += 1
                size = sum(m * n for m, n in shapes)
                for (m, n), c in Counter(shapes).items():  # each shape's bucket gets its share of the rows
                    local = round_of(("rows", call, e.param.dtype, m, n), m, n, True)["local"]
                    for r, k in enumerate(numels):
                        local[r] += k * c * m * n // size
            elif e.path is Path.LOCAL:  # whole local matrices: replicated, or a stack's own members
                total = sum(method_flops(group, m, n) for m, n in shapes)
                for r, n in enumerate(numels):
                    model.flops[r] += total * n // e.param.numel()
                    for (m, c), k in Counter(shapes).items() if n else ():  # the whole matrices rank r holds
                        owned = round_of(("local", m, c), m, c, False)["owned"]
                        owned[r] = owned.get(r, 0) + k * n // e.param.numel()
            else:
                raise NotImplementedError(f"rank_model: path {e.path} of {e.name}")
        if not buckets:
            continue
        if hasattr(split, "bucket_owners"):
            counts, costs = ([b[i] for b in buckets.values()] for i in (0, 2))
            owners = distributed.bucket_owners(counts, costs, load)
        else:
            owners = [[r for r, c in enumerate(assign_counts([k], [f], world)[0]) for _ in range(c)]
                      for k, f, _ in buckets.values()]
        for ((dtype, m, n), (_, f, _)), ranks in zip(buckets.items(), owners, strict=True):
            owned = round_of(("rows", call, dtype, m, n), m, n, True)["owned"]
            for r in ranks:
                model.owned[r] += m * n
                model.flops[r] += f
                owned[r] = owned.get(r, 0) + 1
    plan = opt._owners
    for (group, *_), owned in zip(opt._plan(), opt._owned, strict=True):
        for index, p, _, kind, _, layout in owned:
            if kind != "hidden":
                continue
            shapes = layout.shapes()
            total = sum(method_flops(group, m, n) for m, n in shapes)
            # the engine's bucket: the parameter's global shape (engine._shape_buckets), its matrices' shape
            rnd = round_of(("pieces", tuple(p.shape)), *shapes[0], True, shapes)
            owners = set()
            for r, n in enumerate(local_numels(p, world, cache)):
                q = plan.owner_of(index, r)
                model.local[r] += n
                model.owned[q] += n
                rnd["local"][r] += n
                owners.add(q)
            for q in owners:
                model.flops[q] += total
                rnd["owned"][q] = rnd["owned"].get(q, 0) + 1
    model.rounds = [{**r, "owned": sorted(r["owned"].items())} for r in rounds.values()]
    return model


def adamw_bytes(params) -> int:
    """The bytes of ``torch.optim.AdamW``'s state for ``params`` on this rank: ``exp_avg`` and ``exp_avg_sq``
    of each local piece, in the parameter's dtype, and a float32 ``step`` per parameter
    (``torch.optim.adam``'s ``_init_group``, capturable off)."""
    return sum(2 * getattr(p, "_local_tensor", p).numel() * p.element_size() + 4 for p in params)
