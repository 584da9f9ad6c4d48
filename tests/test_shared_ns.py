"""``ns_group``: one unit's Newton-Schulz shared by a block of ranks (``meqmuon/optim/shared_ns.py``, issue 59 item 2).

The plan (:func:`shared_ns.assign`) is checked on its own against the bound it aims at; the shared step on gloo
against one process (1e-6, float32 Newton-Schulz, as every layout), the column split's iteration against the
quintic written from the paper's eq. 3 in float64, and the overlapped forms against the blocking one bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import _spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import meqmuon
from meqmuon.optim import distributed, exchange, shared_ns
from meqmuon.optim.newton_schulz import method_flops, ns_flops
from meqmuon.optim.shared_ns import FLOPS_PER_BLOCK_BYTE, assign, column_flops, share, shares_by_size


def _rule_and_group(kind: str = "hidden") -> tuple:
    w = torch.nn.Parameter(torch.zeros(8, 8))
    opt = meqmuon.build_optimizer("muon", [{"params": [w], "kind": "hidden"}])
    return opt._rules[kind], opt.param_groups[0]


def _rule():
    return _rule_and_group()[0]


MUON = _rule_and_group()[1]


def test_a_member_of_a_column_split_does_its_columns_and_the_upper_trapezoids_of_the_gram_matrix():
    """Four Gram row blocks of ``s / 4`` rows, each made from its first row's column on: ``s/4 (s + 3s/4 + s/2 +
    s/4) = 0.625 s^2`` entries. Per iteration ``(2 s^2 + 2 e) L / g + 2 s^3 / g`` FLOPs: the quintic's own count
    less the mirrored ``s^2 - e`` entries' ``2 (s^2 - e) L``, divided by ``g``."""
    s, L = 16384, 53248
    assert shared_ns.gram_blocks(s) == [(0, 4096), (4096, 8192), (8192, 12288), (12288, 16384)]
    assert shared_ns.gram_entries(s) == 4096 * (16384 + 12288 + 8192 + 4096) == 0.625 * s * s
    assert shared_ns.gram_entries(3) == 3 + 2 + 1  # fewer rows than blocks: a row each, the upper triangle
    saved = 5 * 2 * (s * s - shared_ns.gram_entries(s)) * L
    assert column_flops(s, L, 5, 1) == ns_flops(s, L, 5) - saved
    assert column_flops(L, s, 5, 8) == (ns_flops(s, L, 5) - saved) // 8
    assert shared_ns.gram_blocks(30) == [(0, 7), (7, 15), (15, 22), (22, 30)]  # blocks of 7 or 8 of 30 rows
    e = 7 * 30 + 8 * 23 + 7 * 15 + 8 * 8
    assert column_flops(30, 100, 5, 8) == 5 * (2 * (30 * 30 + e) * 13 + 2 * 30 * 30 * 4)


def test_share_splits_a_stack_by_matrices_and_a_matrix_by_columns_and_nothing_else():
    rule = _rule()
    how, cost = share(rule, [(2048, 7168)] * 256, MUON, 8)  # ns_dtype None: bf16, a GPU's
    moved = 2 * 256 * 2048 * 7168 * 2 * 7 / 8  # the owner's parts out and back
    assert how == "matrices" and cost == 32 * method_flops(MUON, 2048, 7168) + FLOPS_PER_BLOCK_BYTE * moved
    how, cost = share(rule, [(28672, 8192)], MUON | {"ns_dtype": torch.float32}, 8)
    # each iteration's Gram all-reduce (its upper trapezoids, 4, 3, 2 and 1 tenths of them), every row block but
    # the last behind the next's matmul as far as that lasts
    e = 0.625 * 8192**2
    gram = [2 * 7 / 8 * e * w / 10 * 4 for w in (4, 3, 2, 1)]
    made = [2 * e * w / 10 * 3584 / FLOPS_PER_BLOCK_BYTE for w in (4, 3, 2, 1)]
    hidden = sum(min(r, f) for r, f in zip(gram[:3], made[1:], strict=True))
    moved = 2 * 28672 * 8192 * 4 * 7 / 8 + 5 * (sum(gram) - hidden + 8192**2 * 4 * 7 / 8)  # + B's rows
    assert how == "columns" and cost == pytest.approx(column_flops(28672, 8192, 5, 8) + FLOPS_PER_BLOCK_BYTE * moved)
    assert share(rule, [(64, 32), (32, 32)], MUON, 2) is None  # two shapes: not one stack
    assert share(rule, [(64, 32)], MUON | {"ns_method": "gram"}, 2) is None  # the column split is the quintic's
    assert share(rule, [(64, 32)] * 2, MUON | {"ns_method": "gram"}, 2)[0] == "matrices"  # any method, whole
    assert share(_rule_and_group("vector")[0], [(64, 32)], MUON, 2) is None
    assert share(rule, [(64, 32)], MUON, 1) is None


def test_the_gram_row_blocks_hide_all_but_one_blocks_all_reduce_behind_the_next_blocks_matmul():
    """``exposed_bytes``, from the schedule: of each iteration's Gram all-reduce (row block ``i``: ``R_i`` bytes, its
    trapezoid's 4, 3, 2, 1 tenths) the last block's travels alone, and each earlier block's behind the next block's
    matmul (``F_i+1`` FLOPs) as far as that lasts; the parts, ``B``'s rows and a split by matrices wait whole."""
    m, n, g, steps = 28672, 8192, 8, 5
    whole = shared_ns.block_bytes("columns", 1, m, n, 2, g, steps)
    assert whole == pytest.approx(2 * m * n * 2 * 7 / 8 + steps * 7 / 8 * (2 * 0.625 * n * n * 4 + n * n * 2))
    R = [2 * (g - 1) / g * 0.625 * n * n * w / 10 * 4 for w in (4, 3, 2, 1)]  # float32 where the iteration is bf16
    F = [2 * 0.625 * n * n * w / 10 * (m // g) for w in (4, 3, 2, 1)]
    assert shared_ns.exposed_bytes("columns", 1, m, n, 2, g, steps, 1e30) == pytest.approx(whole)  # matmul: none
    assert shared_ns.exposed_bytes("columns", 1, m, n, 2, g, steps, 0.0) == pytest.approx(
        whole - steps * sum(R[:3]))  # links free: only the last block's sum waits
    for fpb in (100.0, 1254.0, 1e4):  # the plan's 464e12 / 370e9 between: the matmul covers part of a block's sum
        expected = whole - steps * sum(min(r, f / fpb) for r, f in zip(R[:3], F[1:], strict=True))
        assert shared_ns.exposed_bytes("columns", 1, m, n, 2, g, steps, fpb) == pytest.approx(expected)
    assert shared_ns.exposed_bytes("matrices", 16, 2048, 7168, 2, g, steps, 1.0) == \
        shared_ns.block_bytes("matrices", 16, 2048, 7168, 2, g, steps)


@pytest.mark.parametrize("kw", [{"ns_group": 0}, {"ns_group": True}, {"ns_group": 2.0},
                                {"ns_group": 2, "compile": True}])
def test_an_ns_group_the_optimizer_cannot_take_is_refused_when_it_is_built(kw):
    with pytest.raises(ValueError, match="Invalid ns_group"):
        meqmuon.build_optimizer("meqmuon", [torch.nn.Parameter(torch.zeros(4, 4))], **kw)


def _llama3(h: int = 8192, f: int = 28672, layers: int = 80, g: int = 8) -> tuple[list[float], list, list]:
    """A Llama-3's hidden matrices (70B by default; 405B: 16,384, 53,248, 126; 8B: 4,096, 14,336, 32), each one
    unit: their predicted costs, their shares by the block sizes ``ns_group=g`` allows, their shapes (each its own
    shape bucket, as under FSDP2 x TP)."""
    rule, group = _rule(), MUON | {"ns_dtype": torch.bfloat16}
    shapes = [(h, h), (1024, h), (1024, h), (h, h)] * layers + [(f, h), (f, h), (h, f)] * layers
    return ([float(method_flops(group, *s)) for s in shapes], [shares_by_size(rule, [s], group, g) for s in shapes],
            shapes)


def _llama3_70b(g: int = 8) -> tuple[list[float], list]:
    return _llama3(g=g)[:2]


def test_block_sizes_are_the_divisors_of_ns_group_and_a_smaller_block_pays_fewer_bytes_per_flop():
    assert shared_ns.block_sizes(8) == [2, 4, 8] and shared_ns.block_sizes(6) == [2, 3, 6]
    assert shared_ns.block_sizes(1) == []
    rule, group = _rule(), MUON | {"ns_dtype": torch.bfloat16}
    by = shares_by_size(rule, [(53248, 16384)], group, 8)
    whole = method_flops(group, 53248, 16384)
    # a block's total: its members' shares; the collectives grow with the block (2 (g - 1) / g of the Gram matrix
    # each) while the work per member falls as 1 / g
    totals = [z * by[z][1] / whole for z in (2, 4, 8)]
    assert totals[0] < totals[1] < totals[2], totals
    assert by[2][1] > by[4][1] > by[8][1]


def test_blocks_share_llama3_70b_on_1024_ranks():
    """Llama-3 70B's 560 hidden matrices, blocks of up to 8, the shares with their collectives' bytes: on 1,024 ranks
    whole matrices leave the busiest rank at its largest matrix (an MLP's, 3.4x the mean), and sharing cuts it to
    below 0.55x that; every member of a shared unit's block carries its share, and blocks of 8 only (the plan
    before block sizes) leave the busiest rank higher. On 256 ranks whole matrices are within 1.2x of the mean,
    and what the plan shares it shares by pairs, leaving the busiest rank no higher."""
    costs, shares = _llama3_70b()
    for world in (1024, 256):
        whole_load, shared_load, eights = [0.0] * world, [0.0] * world, [0.0] * world
        whole_owners, none = assign(costs, [{}] * len(costs), whole_load)
        assert not any(none)
        owners, shared = assign(costs, shares, shared_load)
        assign(costs, [{8: s[8]} for s in shares], eights)
        assert max(shared_load) <= max(eights) and max(shared_load) <= max(whole_load)
        # every member of a shared unit's block carries its share: the loads add up
        total = sum(c if not z else z * s[z][1] for c, s, z in zip(costs, shares, shared, strict=True))
        assert sum(shared_load) == pytest.approx(total)
        assert all(o // z * z <= o < o // z * z + z for o, z in zip(owners, shared, strict=True) if z)
        if world == 256:
            assert max(whole_load) < 1.2 * sum(costs) / world
            assert set(shared) <= {0, 2}, set(shared)
            continue
        assert max(whole_load) == max(costs) > 3 * sum(costs) / world
        assert max(shared_load) < 0.55 * max(whole_load) and max(shared_load) < 0.95 * max(eights), (
            max(shared_load) / max(whole_load), max(shared_load) / max(eights))
        assert {shares[i][z][0] for i, z in enumerate(shared) if z} == {"columns"}


def test_whole_units_go_to_the_least_loaded_rank_then_the_one_with_fewest_of_their_bucket():
    """``_fill``'s rule for a whole unit, against a scan of every rank: longest first, the least-loaded rank, ties to
    the rank holding the fewest units of the unit's shape bucket, then the lowest. Alike units tie at every turn
    (DeepSeek-V3's experts as units of their own: 30,242 on 1,024 ranks), which its per-bucket heaps answer without
    walking the tied ranks, so that the plan stays seconds at that size."""
    gen = torch.Generator().manual_seed(0)
    costs = [float(c) for c in torch.randint(1, 4, (300,), generator=gen)]
    groups = [int(k) for k in torch.randint(0, 5, (300,), generator=gen)]
    world, load0 = 16, [float(x) for x in torch.randint(0, 3, (16,), generator=gen)]
    load, held, expected = list(load0), {}, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], held.get((groups[i], r), 0), r))
        expected[i], load[r] = r, load[r] + costs[i]
        held[groups[i], r] = held.get((groups[i], r), 0) + 1
    owners, shared, got = shared_ns._whole(costs, load0, groups)
    assert owners == expected and got == load and not any(shared)


def test_a_pair_that_costs_less_than_one_owner_shares_even_where_whole_units_fit():
    """Two units of 1 on two ranks, a pair's member paying 0.43 of one (the mirrored Gram entries saving more than
    the pair's bytes cost): the thrifty order of ways (``_ways``: fewest rank-seconds first) tries the pair first,
    and the plan shares both (busiest 0.86, not 1). Llama-3 70B on 256 ranks, ``ns_group=8`` at the plan's prices:
    whole first, the bisection's fill packs whole MLP matrices until the last units find no room and stops at
    1.01x the mean of whole matrices; the thrifty plans share every MLP, q and o matrix by a pair, 0.91x. At 1,024
    ranks, where every MLP matrix is shared anyway, they change nothing."""
    costs, shares = [1.0, 1.0], [{2: ("columns", 0.43)}] * 2
    assert shared_ns._ways(1.0, shares[0], False) == [0, 2] and shared_ns._ways(1.0, shares[0], True) == [2, 0]
    for in_flight in (False, True):
        load = [0.0, 0.0]
        assert assign(costs, shares, load, in_flight=in_flight)[1] == [2, 2] and load == pytest.approx([0.86, 0.86])
    costs, shares = _llama3_70b()
    for world, before, after in ((256, 1.01, 0.91), (1024, 1.18, 1.18)):
        mean = sum(costs) / world
        for tight in (False, True):
            *_, old = shared_ns._bisect(costs, shares, [0.0] * world, [None] * len(costs), 20, tight)
            *_, new = shared_ns._bisect(costs, shares, [0.0] * world, [None] * len(costs), 20, tight, True)
            assert max(old) / mean == pytest.approx(before, abs=0.005)
            assert max(new) / mean == pytest.approx(after, abs=0.005)
        load = [0.0] * world
        assign(costs, shares, load, in_flight=True)
        assert max(load) / mean == pytest.approx(after, abs=0.005)


def test_units_repeated_in_replica_groups_balance_the_work_each_rank_does(monkeypatch):
    """HSDP over 4 replica groups of 2 ranks (torch's fake process group, rank 0 of 8; ``(Replicate(), Shard(0))``):
    every group computes each matrix at its rank standing for the owner (``owners.Pieces.owner_for``), so the
    plan balances a group's 2 ranks, each charged with what its mirrors do too. Planned over 8 ranks as though
    each worked alone, the 8 matrices of decreasing cost went one to each, and the group's rank 0 computed the
    1st, 3rd, 5th and 7th largest: more than longest-first on 2 ranks gives it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    seen = {}

    def spy(within, costs, *args, **kwargs):
        seen.update(within=list(within), costs=list(costs))
        return shared_ns.assign_within(within, costs, *args, **kwargs)

    monkeypatch.setattr(exchange, "assign_within", spy)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (4, 2))
        ws = [torch.nn.Parameter(DTensor.from_local(torch.zeros(8, n), mesh, [Replicate(), Shard(0)],
                                                    run_check=False, shape=(16, n), stride=(n, 1)))
              for n in (64, 56, 48, 40, 32, 24, 16, 8)]
        opt = meqmuon.build_optimizer("muon", [{"params": ws, "kind": "hidden"}], ns_dtype=torch.float32)
        opt._plan()
        ex = opt._exchange
        costs = seen["costs"]
        assert len(costs) == 8 and costs == sorted(costs, reverse=True) and len(set(costs)) == 8
        assert seen["within"] == [(0, 1)] * 8  # the first replica group's ranks
        assert all(u.assigned in (0, 1) and u.owner == u.assigned for u in ex.units)
        # every rank carries what its group's rank of the same shard does: the loads mirror group by group
        assert all(ex.load[r] == ex.load[r % 2] for r in range(8)), ex.load
        pair = [0.0, 0.0]
        distributed.assign_owners(costs, pair)
        assert max(ex.load) == max(pair)
        blind = [0.0] * 8  # the plan over 8 ranks of their own; rank r computes for its group what 0 or 1 would
        distributed.assign_owners(costs, blind)
        assert max(sum(blind[s::2]) for s in (0, 1)) > 1.05 * max(pair), (blind, pair)
    finally:
        dist.destroy_process_group()


def test_units_that_a_node_alone_holds_are_owned_there_and_the_rest_balance_around_them():
    """``assign_within``: units whose pieces only a TP group holds (six on ranks 0-3, two on 4-7 of 8) are owned
    there, each group's balanced on its own (the six whole: 6, 6, 3, 3; with pairs, two shared: 5.4), not spread
    over all 8 ranks as longest first would (units 4 and 5 on ranks 4 and 5), and shared only by blocks inside
    their group (a block of 8 would span both); the free units then fill the least-loaded ranks of all 8. Without
    such units it is ``assign``'s plan, or ``assign_owners``' without sharing."""
    pinned = [(0, 1, 2, 3)] * 6 + [(4, 5, 6, 7)] * 2
    costs, shares = [3.0] * 8 + [2.0, 2.0, 1.0], [{2: ("matrices", 2.4), 8: ("matrices", 0.5)}] * 8 + [{}] * 3
    for sharing in (False, True):
        load = [0.0] * 8
        owners, shared = shared_ns.assign_within([*pinned, None, None, None], costs, shares, load, [None] * 11,
                                                 share=sharing)
        assert all(o in w for o, w in zip(owners, pinned, strict=False)), owners
        assert set(shared) <= {0, 2} and max(load) <= 6.0, (shared, load)
        if not sharing:
            assert sorted(owners[:6]) == [0, 0, 1, 1, 2, 3] and load[:4] == [6.0, 6.0, 3.0, 3.0], (owners, load)
        else:  # two of the six by pairs (2.4 each member) beat a rank holding two (6)
            assert shared[:6].count(2) == 2 and max(load[:4]) == pytest.approx(5.4), (shared, load)
    gen = torch.Generator().manual_seed(1)
    costs = [float(c) for c in torch.randint(1, 9, (40,), generator=gen)]
    shares = [{2: ("columns", 0.6 * c)} for c in costs]
    for sharing in (False, True):
        a, b = [0.5] * 8, [0.5] * 8
        plan = assign(costs, shares, a, [None] * 40) if sharing else (distributed.assign_owners(costs, a), [0] * 40)
        got = shared_ns.assign_within([None] * 40, costs, shares, b, [None] * 40, share=sharing)
        assert list(got) == list(plan) and a == b, (got, plan)


def test_round_sum_is_each_buckets_busiest_rank_added_up():
    """Two buckets on two blocks of two: bucket ``a`` a whole unit of 5 on rank 0 and one of 2 on rank 3, bucket
    ``b`` a unit shared by ranks 2 and 3 (3 each) and a whole one of 4 on rank 0: ``5 + 4``; written out."""
    costs, shares = [5.0, 2.0, 9.0, 4.0], [{}, {}, {2: ("columns", 3.0)}, {}]
    owners, shared, groups = [0, 3, 2, 0], [0, 0, 2, 0], ["a", "a", "b", "b"]
    assert shared_ns.round_sum(costs, shares, owners, shared, groups) == 5.0 + 4.0
    # moved to rank 2 the last unit joins that rank's share: bucket b's busiest is then 3 + 4
    assert shared_ns.round_sum(costs, shares, [0, 3, 2, 2], shared, groups) == 5.0 + 7.0


@pytest.mark.parametrize("size", ["8b", "70b", "405b"])
def test_the_plan_packs_the_shares_for_its_schedule(size):
    """Llama-3 on 1,024 ranks, ``ns_group=8``, each matrix its own bucket: the plan for every bucket in flight
    (``in_flight``, ``overlap="all"``) has the least busiest rank, the plan for a pipeline the least busiest
    bucket after bucket (``round_sum``), each at least as good as the other's by its own measure, and each under
    0.9x of what blocks of 8 reached before by the same measure (every unit at once, spread; in flight, best fit).
    In flight, the busiest rank is within 1.1x of the mean (8B's 224 matrices on 1,024 ranks: 1.2x)."""
    costs, shares, shapes = {"8b": _llama3(4096, 14336, 32), "70b": _llama3(),
                             "405b": _llama3(16384, 53248, 126)}[size]
    plans = {}
    for sizes in ("all", "8"):
        offered = shares if sizes == "all" else [{8: s[8]} if 8 in s else {} for s in shares]
        for in_flight in (False, True):
            load = [0.0] * 1024
            owners, shared = assign(costs, offered, load, shapes, in_flight=in_flight)
            plans[sizes, in_flight] = (max(load), sum(load) / 1024,
                                       shared_ns.round_sum(costs, offered, owners, shared, shapes))
    (pipe_max, _, pipe_rounds), (all_max, all_mean, all_rounds) = plans["all", False], plans["all", True]
    assert all_max <= pipe_max and pipe_rounds <= all_rounds
    # before: blocks of 8, every unit at once, each bucket's shares spread over the blocks
    eights = [{8: s[8]} if 8 in s else {} for s in shares]
    before = shared_ns._bisect(costs, eights, [0.0] * 1024, shapes, 20, False)
    before_rounds = shared_ns.round_sum(costs, eights, before[0], before[1], shapes)
    assert pipe_rounds < 0.9 * before_rounds and all_max < 0.9 * plans["8", True][0], (
        pipe_rounds / before_rounds, all_max / plans["8", True][0])
    assert all_max < (1.2 if size == "8b" else 1.1) * all_mean, all_max / all_mean


# ---- on gloo ----------------------------------------------------------------------------------------------

#: A large tall matrix, a stack of eight experts (its rows sharded; each expert split in two row blocks), a square and
#: a wide matrix: on two ranks in one block, the links free in the plan's balance, the plan shares the large matrix by
#: columns and the stack by its matrices (or each expert, a unit of its own with ``exchange_unit="matrix"``, by its
#: two); under DDP each block of an expert is a unit of its own, and the large matrix is shared.
SHAPES = [(192, 96), (8, 32, 64), (32, 32), (16, 32)]


def _model() -> torch.nn.ParameterList:
    torch.manual_seed(0)
    return torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s) / s[-1] ** 0.5) for s in SHAPES)


def _groups(params) -> list[dict]:
    return [{"params": list(params), "kind": "hidden", "names": [f"p{i}" for i in range(len(params))],
             "views": ["matrix", "stacked", "matrix", "matrix"], "splits": [None, (16, 16), None, None]}]


def _grad(step: int, i: int) -> torch.Tensor:
    return torch.randn(SHAPES[i], generator=torch.Generator().manual_seed(1000 * step + i))


def _run(name: str, layout: str | None, ns_group: int, overlap, foreach: bool, steps: int = 3,
         relay_group: int = 1, exchange_unit: str = "tensor") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = _model()
    params = list(model)
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        from torch.distributed.tensor import Shard

        # the experts' rows sharded (torchtitan's FSDP2 of a stack over more ranks than experts): a unit each
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 3 else None)
        params = list(model)
    elif layout == "dp x tp":  # 4 ranks; the large matrix on both dimensions, the rest repeated over tp
        from torch.distributed.tensor import Replicate, Shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        places = [(Shard(0), Shard(1)), (Shard(0), Replicate()), (Shard(0), Replicate()), (Replicate(), Shard(1))]
        params = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, list(pl)))
                  for p, pl in zip(params, places, strict=True)]
    opt = meqmuon.build_optimizer(name, _groups(params), ns_dtype=torch.float32, foreach=foreach,
                                  ns_group=ns_group, overlap=overlap, relay_group=relay_group,
                                  exchange_unit=exchange_unit)
    out: dict = {"relayed": 0}
    relayed = exchange.relayed_flat

    def counted(*args, **kwargs):
        out["relayed"] += 1
        return relayed(*args, **kwargs)

    exchange.relayed_flat = counted
    planned = shared_ns.assign

    def recorded(*args, **kwargs):  # what the plan packs its shares for
        out["in_flight"] = kwargs["in_flight"]
        return planned(*args, **kwargs)

    shared_ns.assign = recorded  # what exchange.Exchange's plan calls, through shared_ns.assign_within
    for step in range(steps):
        for i, p in enumerate(params):
            g = _grad(step, i)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if layout else g
        opt.step()
    exchange.relayed_flat, shared_ns.assign = relayed, planned
    ex = opt._exchange
    out["shared"] = [] if ex is None else [u.shared for u in ex.units]
    out["blocks"] = [] if ex is None else [u.block for u in ex.units]
    out["params"] = [p.full_tensor() if layout else p.detach().clone() for p in params]
    return out


def _one_process(name: str, foreach: bool) -> list[torch.Tensor]:
    params = list(_model())
    opt = meqmuon.build_optimizer(name, _groups(params), ns_dtype=torch.float32, foreach=foreach)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = _grad(step, i)
        opt.step()
    return [p.detach() for p in params]


def _worker(rank: int) -> dict:
    # links free in the plan's balance: at these sizes a block's collectives outweigh the FLOPs shared (the plan's
    # own tests above), and these test the shared step itself
    shared_ns.FLOPS_PER_BLOCK_BYTE = 0.0
    out = {}
    for name in ("muon", "meqmuon"):
        for layout in ("fsdp2", None):
            for foreach in (False, True):
                key = (name, layout, foreach)
                out[key] = _run(name, layout, 2, False, foreach, exchange_unit="matrix" if foreach else "tensor")
                out[key]["reference"] = _one_process(name, foreach)
    out["all"] = _run("meqmuon", "fsdp2", 2, "all", False)
    out["two"] = _run("meqmuon", "fsdp2", 2, True, False)
    out["refused"] = [_refused(3), _refused(1, relay_group=3)]
    out["hsdp"] = _hsdp()
    return out


def _hsdp() -> dict:
    """HSDP on a ``(1, 2)`` mesh, ``ns_group=2``: every unit's mesh has a dimension that replicates, so the plan
    keeps every unit whole (a block per replica group is not built) and the step is ``ns_group=1``'s."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    params = list(model)
    opt = meqmuon.build_optimizer("muon", _groups(params), ns_dtype=torch.float32, ns_group=2)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = distribute_tensor(_grad(step, i), p.device_mesh, p.placements)
        opt.step()
    return {"params": [p.full_tensor() for p in params], "shared": [u.shared for u in opt._exchange.units],
            "reference": _one_process("muon", False)}


def _refused(ns_group: int, relay_group: int = 1) -> str:
    """What a plan ``ns_group`` (or ``relay_group``) cannot make says: blocks that do not divide the ranks."""
    model = _model()
    params = list(model)
    opt = meqmuon.build_optimizer("muon", _groups(params), ns_dtype=torch.float32, ns_group=ns_group,
                                  relay_group=relay_group)
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        opt.step()
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "stepped"


def test_shared_newton_schulz_equals_one_process_under_fsdp2_and_ddp(tmp_path):
    """Two gloo ranks, one block (``ns_group=2``): under FSDP2 and DDP, per tensor and batched, Muon and MeqMuon
    step as one process does to 1e-6 (float32 Newton-Schulz) while the plan shares the stack of experts (or, with
    ``exchange_unit="matrix"``, each expert) by its matrices and the large matrices by columns; the overlapped forms
    equal the blocking one bit for bit."""
    got = _spawn(_worker, tmp_path)
    for key, r in got[0].items():
        if not isinstance(key, tuple):
            continue
        name, layout, foreach = key
        # under FSDP2 the stack of experts is a unit, shared by its 16 matrices, or (exchange_unit="matrix", here with
        # foreach) each expert is (placement.by_matrix), shared by its two row blocks
        first = ["columns", *["matrices"] * (8 if foreach else 1)] if layout == "fsdp2" else ["columns"]
        assert r["shared"][: len(first)] == first, (key, r["shared"])
        for rank in (0, 1):
            for a, b in zip(got[rank][key]["params"], r["params"], strict=True):
                assert torch.equal(a, b), (key, rank)  # every rank ends with the same weights
        for p, ref in zip(r["params"], r["reference"], strict=True):
            torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    divide, relay = got[0]["refused"]
    assert relay.startswith("ValueError: relay_group=3 must divide the optimizer's 2 ranks"), relay
    assert divide.startswith("ValueError: ns_group=3 must divide the optimizer's 2 ranks"), divide
    hsdp = got[0]["hsdp"]
    assert hsdp["shared"] and not any(hsdp["shared"]), hsdp["shared"]
    for p, ref in zip(hsdp["params"], hsdp["reference"], strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)
    blocking = got[0][("meqmuon", "fsdp2", False)]["params"]
    for form in ("all", "two"):
        for a, b in zip(got[0][form]["params"], blocking, strict=True):
            assert torch.equal(a, b), form
    # the plan packs for the schedule: every bucket in flight, or a pipeline
    assert got[0]["all"]["in_flight"] is True and got[0]["two"]["in_flight"] is False


def _mixed_blocks() -> dict:
    """``ns_group=4`` with the first unit (the large matrix) offered blocks of 2 only and the others blocks of 4 only:
    two block sizes in one step, their collectives on overlapping groups."""
    real, seen = shared_ns.shares_by_size, []

    def offered(*args):
        by, first = real(*args), not seen
        seen.append(True)
        return {z: x for z, x in by.items() if (z == 2) == first}

    shared_ns.shares_by_size = offered  # read by shared_ns.unit_prices, once per rule, shapes and group
    try:
        return _run("meqmuon", "fsdp2", 4, False, True)
    finally:
        shared_ns.shares_by_size = real


def _four(rank: int) -> dict:
    shared_ns.FLOPS_PER_BLOCK_BYTE = 0.0
    return {"mixed blocks": _mixed_blocks(),
            "shared": _run("meqmuon", "fsdp2", 2, False, False), "whole": _run("meqmuon", "fsdp2", 1, False, False),
            "reference": _one_process("meqmuon", False),
            # relayed through nodes of two: shared, and with every bucket in flight, batched; DDP's (direct)
            "relayed": _run("meqmuon", "fsdp2", 2, False, False, relay_group=2),
            "relayed in flight": _run("meqmuon", "fsdp2", 1, "all", True, relay_group=2),
            "in flight": _run("meqmuon", "fsdp2", 1, "all", True),
            "ddp relayed": _run("meqmuon", None, 1, False, True, relay_group=2),
            "ddp": _run("meqmuon", None, 1, False, True),
            # ns_group=4: blocks of 2 or 4, planned for a pipeline and for every bucket in flight
            "blocks of 4": _run("meqmuon", "fsdp2", 4, False, False),
            "blocks of 4 in flight": _run("meqmuon", "fsdp2", 4, "all", True),
            # FSDP2 over TP's 2 x 2 mesh: the large matrix shared, the matrices repeated over tp planned whole
            "dp x tp": _run("meqmuon", "dp x tp", 2, False, False)}


@pytest.mark.parametrize("world", [4])
def test_two_blocks_of_two_on_four_ranks_equal_one_process(tmp_path, world):
    """Four gloo ranks in two blocks: each block shares its own units, no rank waits on the other block; the
    weights equal one process's to 1e-6 and the unshared plan's to 1e-6. Relayed through two nodes of two
    (``relay_group=2``) the step receives the same bytes: the same weights bit for bit, blocking and in flight."""
    got = _spawn(_four, tmp_path, world=world)
    for r in got:
        for p, ref, whole in zip(r["shared"]["params"], r["reference"], r["whole"]["params"], strict=True):
            torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(p, whole, rtol=1e-6, atol=1e-6)
        for relayed, direct in (("relayed", "shared"), ("relayed in flight", "in flight"), ("ddp relayed", "ddp")):
            for a, b in zip(r[relayed]["params"], r[direct]["params"], strict=True):
                assert torch.equal(a, b), (relayed, direct)
            assert r[direct]["relayed"] == 0
        # FSDP2's ways out and back relayed, every bucket of every step; DDP's way back goes direct (the same whole
        # to every rank) and its way out does not travel
        assert r["relayed"]["relayed"] >= 2 * 3 and r["relayed in flight"]["relayed"] >= 2 * 3
        assert r["ddp relayed"]["relayed"] == 0
        # blocks of 2 and 4 (ns_group=4), planned for a pipeline and in flight, and both sizes in one step
        for key in ("blocks of 4", "blocks of 4 in flight", "mixed blocks"):
            for p, ref in zip(r[key]["params"], r["reference"], strict=True):
                torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
        assert set(r["blocks of 4"]["blocks"]) == {4} and r["mixed blocks"]["blocks"] == [2, 4, 4, 4], (
            r["blocks of 4"]["blocks"], r["mixed blocks"]["blocks"])
        for p, ref in zip(r["dp x tp"]["params"], r["reference"], strict=True):
            torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)
        assert r["dp x tp"]["shared"][0] == "columns" and not any(r["dp x tp"]["shared"][1:]), r["dp x tp"]["shared"]
    assert any(s is not None for s in got[0]["shared"]["shared"])


class _Failing:
    """``torch`` as ``shared_ns`` sees it, whose ``baddbmm`` (the column split's ``B`` rows and update) raises."""

    def __getattr__(self, name: str):
        if name == "baddbmm":
            def fail(*args, **kwargs):
                raise RuntimeError("injected: a block member's baddbmm failed")
            return fail
        return getattr(torch, name)


def _member_fails(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    shared_ns.FLOPS_PER_BLOCK_BYTE = 0.0
    model = _model()
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 3 else None)
    params = list(model)
    opt = meqmuon.build_optimizer("muon", _groups(params), ns_dtype=torch.float32, ns_group=2)

    def step(k: int) -> None:
        for i, p in enumerate(params):
            p.grad = distribute_tensor(_grad(k, i), p.device_mesh, p.placements)
        opt.step()

    def snapshot() -> list[torch.Tensor]:
        return [t.to_local().clone() for p in params for t in (p, *opt.state[p].values())
                if isinstance(t, torch.distributed.tensor.DTensor)]

    step(0)
    before = snapshot()
    if rank == 1:
        shared_ns.torch = _Failing()
    try:
        step(1)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    shared_ns.torch = torch
    unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True))
    step(1)  # fixed: the next step steps on every rank
    return {"raised": raised, "unchanged": unchanged, "shared": [u.shared for u in opt._exchange.units],
            "after_fix_changed": not all(torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True))}


def test_a_block_member_that_fails_in_a_shared_unit_commits_nothing_on_any_rank(tmp_path):
    """Two gloo ranks, one block, Muon under FSDP2: rank 1's part of a column-split unit raises (its ``baddbmm``).
    The block's collectives still pair up (zeros go on, ``StepContext.keep``), rank 1's step raises the error, and
    neither rank commits anything; the next step, without the failure, steps on both."""
    got = _spawn(_member_fails, tmp_path)
    assert "columns" in got[0]["shared"]
    assert got[1]["raised"] is not None and "injected" in got[1]["raised"], got[1]["raised"]
    assert got[0]["raised"] is None, got[0]["raised"]
    for r in got:
        assert r["unchanged"] and r["after_fix_changed"], r


def _eq3(X: torch.Tensor, coefficients, steps: int) -> torch.Tensor:
    """The paper's eq. 3 on one matrix, as written: ``X_0 = X / ||X||_F``, ``A = X X^T`` of the wide side,
    ``X <- a X + (b A + c A^2) X``."""
    Z = X.T if X.shape[0] > X.shape[1] else X
    Z = Z / torch.linalg.vector_norm(Z)
    a, b, c = coefficients
    for _ in range(steps):
        A = Z @ Z.T
        Z = a * Z + (b * A + c * A @ A) @ Z
    return Z.T if X.shape[0] > X.shape[1] else Z


def _float64(rank: int) -> dict:
    from meqmuon.optim.shared_ns import Blocks, SharedNS

    blocks = Blocks(None, 2)
    g = torch.Generator().manual_seed(7)
    out = {}
    for how, shape in (("columns", (1, 41, 23)), ("columns", (2, 23, 41)), ("matrices", (3, 23, 41))):
        X = torch.randn(shape, dtype=torch.float64, generator=g)
        ns = SharedNS(blocks, 1, how, shape, MUON, torch.float64, False, X.device, None)
        out[how, shape] = (ns(X.clone(), MUON["ns_steps"], MUON["ns_coefficients"], torch.float64) if rank == 1
                           else ns.help(), X)
    X = torch.randn((1, 96, 256), dtype=torch.float64, generator=g)
    ns = SharedNS(blocks, 1, "columns", tuple(X.shape), MUON, torch.bfloat16, False, X.device, None)
    out["bf16"] = (ns(X.clone(), MUON["ns_steps"], MUON["ns_coefficients"], torch.bfloat16) if rank == 1
                   else ns.help(), X)
    return out


def test_the_shared_iterations_are_the_quintic_of_eq3_in_float64(tmp_path):
    """Both splits on two gloo ranks, uneven parts (23 and 41 in two), a tall and a wide stack, the owner rank 1:
    the owner's ``U`` is eq. 3 of each matrix to 1e-12 in float64; the other member returns nothing."""
    got = _spawn(_float64, tmp_path)
    U, X = got[1].pop("bf16")
    # bf16: the Gram matrices summed in float32 and rounded once, as one process's product: no further from eq. 3
    # than one process's bf16 quintic (the default ns_dtype on GPUs)
    exact = _eq3(X[0], MUON["ns_coefficients"], MUON["ns_steps"])
    one = meqmuon.functional.orthogonalize(X[0], MUON["ns_steps"], MUON["ns_coefficients"], torch.bfloat16)
    err_shared, err_one = ((t.double() - exact).norm() / exact.norm() for t in (U[0], one))
    assert err_shared <= 1.25 * err_one, (err_shared, err_one)
    for key, (U, X) in got[1].items():
        assert got[0][key][0] is None
        for u, x in zip(U, X, strict=True):
            torch.testing.assert_close(u, _eq3(x, MUON["ns_coefficients"], MUON["ns_steps"]), rtol=1e-12, atol=1e-12,
                                       msg=lambda m, key=key: f"{key}: {m}")


def test_the_time_model_gives_each_block_member_its_share_and_the_blocks_collectives(monkeypatch):
    """Muon on Llama-tiny under FSDP2 on 16 fake ranks, blocks of 8 (links free in the plan, so that it shares at
    these sizes): the simulator's rounds name the shared units and their owners; the time model gives every member
    of a shared unit's block the member's share (the column split's FLOPs at the matrix's calibrated rate) and the
    block's collectives (``shared_ns.block_bytes`` over NVLink after their latencies), takes the unit from its
    owner's own time, and bounds the largest matrix by its block's share."""
    import scale_sim
    import time_model

    monkeypatch.setattr(shared_ns, "FLOPS_PER_BLOCK_BYTE", 0.0)
    row = scale_sim.simulate("llama-tiny", "fsdp2", "16", 0, layers=2, device="meta", optimizer="muon", ns_group=8)
    summary = scale_sim.summarise({"rows": [row], "wall_s": 1.0, "rss": 1}, 4)
    inputs = summary["time_inputs"]
    assert inputs["ns_group"] == 8 and inputs["ranks"][0]["block"] > 0
    # rank 0's blocks, by size: per shared unit and iteration, one all-reduce per Gram row block and one gather of
    # B's rows
    sizes = {g for rd in inputs["rounds"] for _, _, g in rd["shared"]}
    assert sizes and sizes <= {2, 4, 8}
    for z in sizes:
        units = sum(q < z and g == z for rd in inputs["rounds"] for q, _, g in rd["shared"])
        assert inputs["calls_by_group"].get(f"allreduce_@{z}", 0) == units * 5 * shared_ns.GRAM_CHUNKS
        assert inputs["calls_by_group"].get(f"alltoall_base_@{z}", 0) == units * (2 + 5)
    hw = time_model.Hardware("test", hbm=1e12, peak={"bfloat16": 1e15, "float32": 1e14},
                             nvlink=time_model.Link(400e9, 1e-6), network=time_model.Link(100e9, 1e-6),
                             base_latency=1e-6)
    cal = time_model.Calibration("test", rate_fraction=0.5)
    rounds, _ = time_model.rounds_of(inputs, 16, cal, hw)
    assert any(rd["shared"] for rd in inputs["rounds"])
    for rd, got in zip(inputs["rounds"], rounds, strict=True):
        (m, n), k = rd["matrices"][0], len(rd["matrices"])
        whole = time_model.ns_flops(m, n) / (0.5 * 1e14) * k
        expected = [0.0] * 16
        for r, count in rd["owned"]:
            expected[r] += count * whole
        for q, how, g in rd["shared"]:
            assert how == "columns" and k == 1
            expected[q] -= whole
            part = whole * column_flops(m, n, 5, g) / time_model.ns_flops(m, n)
            # parts out and back; per iteration two collectives, the all-reduce a ring's 2 (g - 1) steps
            latency = 2 * (1e-6 + 1e-6) + 5 * (2e-6 + (2 * (g - 1) + 1) * 1e-6)
            # the owner's bytes, less each Gram row block's all-reduce but the last where the next block's matmul
            # covers it (the blocks' upper trapezoids: e entries each)
            s_, L = min(m, n), max(m, n)
            entries = [(hi - lo) * (s_ - lo) for lo, hi in shared_ns.gram_blocks(s_)]
            sums = [2 * (g - 1) / g * e * 4 for e in entries]
            made = [2 * e * -(-L // g) / (0.5 * 1e14) * 400e9 for e in entries]
            hidden = 5 * sum(min(r, f) for r, f in zip(sums[:-1], made[1:], strict=True))
            moved = (shared_ns.block_bytes("columns", 1, m, n, 4, g, 5) - hidden) / 400e9
            for member in range(q // g * g, q // g * g + g):
                expected[member] += part + latency + moved
        assert got.ns == pytest.approx(expected, rel=1e-9, abs=1e-15), rd["shape"]
    times = time_model.step_times(summary, hw, cal)
    assert times.ns_largest == pytest.approx(time_model.ns_flops(128, 64) / (0.5 * 1e14) / 8)
    # the bound: every matrix's least work (the quintic, its Gram matrix mirrored: a column split's FLOPs
    # on one rank), no share's collectives, over the ranks
    work = sum(count * column_flops(*rd["matrices"][0], 5, 1) / (0.5 * 1e14) * len(rd["matrices"])
               for rd in inputs["rounds"] for _, count in rd["owned"])
    assert times.ns_work == pytest.approx(work / 16) and times.work_bound == max(times.ns_work, times.ns_largest)
    assert times.ns_mean > times.ns_work  # the shares' collectives
    # the bound of the form, collectives included: each unit whole (the full quintic) or shared by a block of 2, 4
    # or 8 (a member's part and the block's collectives); the least T where every unit has a way within T and the
    # units' rank-seconds at their thriftiest way within T fit 16 ranks for T. Found here by scanning T upwards (the
    # fluid bound; how units pack raises it nowhere here: tests/test_scale_sim.py tests the packing).
    units = [(sum(k for _, k in rd["owned"]), rd["matrices"]) for rd in inputs["rounds"] if rd["owned"]]

    def options(shapes):
        (m, n) = shapes[0]
        whole = time_model.ns_flops(m, n) / (0.5 * 1e14) * len(shapes)
        return [(1, whole), *((z, time_model.share_seconds("columns", shapes, "float32", z, cal, hw)
                               + time_model.block_seconds("columns", shapes, "float32", 4, z, cal, hw))
                              for z in (2, 4, 8))]

    def area(t):
        return sum(k * min(z * s for z, s in options(shapes) if s <= t) for k, shapes in units)

    t = max(min(s for _, s in options(shapes)) for _, shapes in units)
    while area(t) > 16 * t:
        t *= 1.0001
    assert times.ns_form == pytest.approx(t, rel=2e-4)
    assert times.work_bound <= times.ns_form <= times.ns_busiest


def test_the_time_model_relays_an_owners_bytes_through_its_node():
    """``time_model.relayed_seconds`` from the route (``meqmuon/optim/relay.py``) on two nodes of eight: rank 0 owns
    ``X`` bytes of whole units, every rank has ``L`` of pieces. The network hop carries a rank's pieces for the other
    node and one eighth of its node's owned bytes; the NVLink hop forwards 7/8 of what crossed the network for the
    owner; a rank's own node's pieces cross NVLink beside the network hop. One node: nothing relayed."""
    import time_model

    hw = time_model.Hardware("test", hbm=1e12, peak={"bfloat16": 1e15, "float32": 1e14},
                             nvlink=time_model.Link(400e9, 2e-6), network=time_model.Link(50e9, 5e-6),
                             base_latency=1e-6)
    L, X = 1e6, 64e6
    local, owned = [L] * 16, [X] + [0.0] * 15
    net = 5e-6 + 8 / 16 * max(L, X / 8) / 50e9
    near = 2e-6 + 7 / 16 * max(L, X) / 400e9
    forward = 2e-6 + 8 / 16 * 7 / 8 * X / 400e9  # rank 0 receives what its seven relays took for it
    assert time_model.relayed_seconds(local, owned, hw) == pytest.approx(2e-6 + max(net, near) + forward)
    direct = max(time_model.exchange_seconds(max(a, b), 16, hw) for a, b in zip(local, owned, strict=True))
    assert time_model.relayed_seconds(local, owned, hw) < direct / 3  # the owner's network bytes over eight NICs
    assert time_model.relayed_seconds(local[:8], owned[:8], hw) == max(
        time_model.exchange_seconds(max(a, b), 8, hw) for a, b in zip(local[:8], owned[:8], strict=True))


def test_bytes_by_peer_cross_the_link_they_take_and_spread_evenly_by_default():
    """``hardware.split_seconds`` and ``relayed_seconds(split=...)``: a round whose owners lie in each sender's node
    (``far`` zero: the experts of torchtitan's TP layout, owned in their TP group) crosses NVLink alone, direct or
    relayed; the bytes spread evenly over the ranks (what ``relayed_seconds`` assumes without a split) give its time
    without a split exactly."""
    import hardware
    import time_model

    hw = time_model.Hardware("test", hbm=1e12, peak={"bfloat16": 1e15, "float32": 1e14},
                             nvlink=time_model.Link(400e9, 2e-6), network=time_model.Link(50e9, 5e-6),
                             base_latency=1e-6)
    gen = torch.Generator().manual_seed(0)
    local, owned = ([float(x) for x in torch.randint(0, 10**6, (16,), generator=gen)] for _ in range(2))
    even = ([x / 2 for x in local], [x / 2 for x in owned], [7 / 16 * x for x in local], [7 / 16 * x for x in owned])
    spread = hardware.relayed_seconds(local, owned, hw)
    assert hardware.relayed_seconds(local, owned, hw, even) == pytest.approx(spread)
    node = ([0.0] * 16, [0.0] * 16, [100 * x for x in local], [100 * x for x in owned])
    nvlink = max(2e-6 + 100 * max(a, b) / 400e9 for a, b in zip(local, owned, strict=True))
    # the network hop's latency with nothing on it, then nothing to forward
    assert hardware.relayed_seconds(local, owned, hw, node) == pytest.approx(2e-6 + max(5e-6, nvlink) + 2e-6)
    assert nvlink > 5e-6
    assert hardware.split_seconds(1e6, 0.0, hw) == pytest.approx(1e-6 + 2e-6 + 1e6 / 400e9)
    assert hardware.split_seconds(1e6, 1e6, hw) == pytest.approx(1e-6 + 5e-6 + 1e6 / 50e9)
    assert hardware.split_seconds(0.0, 0.0, hw) == 0.0


def test_the_simulator_relays_every_exchange_through_the_nodes():
    """Muon on Llama-tiny under FSDP2 on 16 fake ranks, ``relay_group=8``: every exchange of the world pairs with one
    within the node (the second hop), and the plan and the FLOPs are the direct exchange's (each byte's route
    changed, not what it carries: the gloo test above has the same weights bit for bit)."""
    import scale_sim

    rows = {relay: scale_sim.simulate("llama-tiny", "fsdp2", "16", 0, layers=2, device="meta", optimizer="muon",
                                      relay_group=relay) for relay in (1, 8)}
    calls = rows[8]["calls_by_group"]
    assert calls["alltoall_base_@16"] == calls["alltoall_base_@8"] == rows[1]["calls_by_group"]["alltoall_base_@16"]
    assert rows[8]["flops"] == rows[1]["flops"] and rows[8]["ranks_model"]["rounds"] == rows[1]["ranks_model"]["rounds"]
    assert rows[8]["relay_group"] == 8
