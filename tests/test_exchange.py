"""The one exchange (``optim/exchange.py``, issue 55) at the floor, on every layout, DDP included.

- The owners of every ``placement.OWNERS`` unit of an optimizer are planned at once, longest first by
  ``driver.cost`` onto the least-loaded rank (``distributed.assign_owners``), as ``engine._prepare`` plans
  them: for Llama-3 70B's hidden matrices on 512 ranks the busiest rank is within 1.1x of
  ``max(total / ranks, largest unit)``; planned bucket by bucket from no load it would be over 2x. On the
  fake process group of 512 ranks the engine's own plan (``opt._exchange.load``) meets the same bound.
- FSDP2 on 2 gloo ranks: every rank's rows go once to their owner and the owners' directions come back once
  (``benchmarks/step_accounting.py``'s meter, which reads only torch's collectives), one pair of
  ``all_to_all_single`` per shape bucket, nothing padded, one ``Exchange`` for every param group, and the step
  equals one process. With bf16 Newton-Schulz every byte is what the pieces' shapes give: bf16 ``X`` out with
  NorMuon's per-row second moment as its sharded piece; back bf16 ``U`` (Muon), ``U`` with eq. 8's or NorMuon's
  factors where fewer bytes than a float32 ``D`` (else ``D``), NorMuon's second moment as its piece, and
  MeqMuon's per-matrix counter whole (one int64, 8 B per matrix per receiving rank).
- DDP on 2 gloo ranks (issue 55 item 1): the rules without Newton-Schulz run in place on every rank (0 bytes),
  each hidden direction goes once from its owner to the other rank; on a model whose embedding and head
  are larger than its hidden matrices every rank sends at most 1.05x the floor (``floor_bytes``: each
  direction once to every other rank), exactly the owned directions' bytes, the ranks end bit-identical with
  equal ``state_dict()`` and equal to one process bit for bit. The negative control, a rank that skips the
  embedding's in-place update, fails the identity check. A plain and a sharded matrix of one shape in one
  batched call (two param groups with the same hyperparameters) step as one process in either order.
- What travels back per rule class (``transfer.form_of``, ``HiddenRule.transfer_form``) and when the factors
  pay (``transfer.pays``).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import _spawn

import meqmuon
from meqmuon.optim import driver, transfer
from meqmuon.optim.distributed import assign_owners
from meqmuon.optim.newton_schulz import method_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_accounting import AGREEMENT_BYTES, AGREEMENT_CALLS, StepMeter, floor_bytes  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

#: Llama-3 70B's hidden matrices of one decoder layer (q, o; k, v; gate, up; down).
LLAMA3_70B_LAYER = [(8192, 8192)] * 2 + [(1024, 8192)] * 2 + [(28672, 8192)] * 2 + [(8192, 28672)]


def _hidden_rule_and_group(name: str = "meqmuon") -> tuple:
    w = torch.nn.Parameter(torch.zeros(8, 8))
    opt = meqmuon.build_optimizer(name, [{"params": [w], "kind": "hidden"}])
    return opt._rules["hidden"], opt.param_groups[0]


def _busiest_over_bound(costs: list[float], owners: list[int], world: int) -> float:
    load = [0.0] * world
    for c, r in zip(costs, owners, strict=True):
        assert 0 <= r < world
        load[r] += c
    return max(load) / max(sum(costs) / world, max(costs))


def test_llama3_70b_owners_on_512_ranks_are_within_1_1x_of_the_bound():
    """Longest first over all units at once, as the engine plans: within 1.1x of the bound; bucket by bucket
    from no load (each shape's matrices on ranks 0, 1, ... again), over 2x."""
    rule, group = _hidden_rule_and_group()
    world, layers = 512, 80
    shapes = LLAMA3_70B_LAYER * layers
    cost = {s: driver.cost(rule, s, group) for s in LLAMA3_70B_LAYER}
    costs = [cost[s] for s in shapes]
    owners = assign_owners(costs, [0.0] * world)
    assert owners == assign_owners(costs, [0.0] * world)  # deterministic: every rank plans the same
    assert _busiest_over_bound(costs, owners, world) <= 1.1
    per_bucket = [0] * len(shapes)
    for s in dict.fromkeys(shapes):
        at = [i for i, t in enumerate(shapes) if t == s]
        for i, r in zip(at, assign_owners([costs[i] for i in at], [0.0] * world), strict=True):
            per_bucket[i] = r
    assert _busiest_over_bound(costs, per_bucket, world) > 2.0


def test_the_engines_plan_of_llama3_70b_on_512_fake_ranks_is_within_1_1x_of_the_bound():
    """The engine's own plan (``engine._prepare``: one ``Exchange`` over every unit), rank 0 of torch's fake
    process group of 512 ranks, 70B's hidden matrices replicated on ``meta`` (DDP's units): its owners' load is
    the plan above, within 1.1x of the bound."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rule, group = _hidden_rule_and_group()
    world, layers = 512, 80
    shapes = LLAMA3_70B_LAYER * layers
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
        opt = meqmuon.build_optimizer("meqmuon", [{"params": params, "kind": "hidden"}])
        opt._plan()
        ex = opt._exchange
        load = list(ex.load)
        owners = [u.owner for u in ex.units]
    finally:
        dist.destroy_process_group()
    cost = {s: driver.cost(rule, s, group) for s in LLAMA3_70B_LAYER}
    costs = [cost[s] for s in shapes]
    assert len(owners) == len(shapes) and owners == assign_owners(costs, [0.0] * world)
    assert max(load) / max(sum(costs) / world, max(costs)) <= 1.1, max(load)


def test_assign_owners_carry_the_load_across_calls():
    load = [0.0, 0.0]
    assert assign_owners([5.0, 2.0, 2.0], load) == [0, 1, 1] and load == [5.0, 4.0]
    assert assign_owners([3.0], load) == [1] and load == [5.0, 7.0]


# ---- FSDP2 on 2 gloo ranks ---------------------------------------------------------------------------------

#: The gloo model: a bucket of one 48 x 32 matrix, one of two 32 x 32, one of a 3 x 32 (rows 2 and 1 on two
#: ranks: the uneven split), so every bucket but one has fewer matrices than ranks; two param groups (the
#: first two matrices, the last two) with the same hyperparameters, which share one exchange.
SHAPES = [(48, 32), (32, 32), (32, 32), (3, 32)]
SPLIT = 2


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _groups(params: list) -> list[dict]:
    return [{"params": params[:SPLIT], "kind": "hidden", "names": [f"{i}.weight" for i in range(SPLIT)]},
            {"params": params[SPLIT:], "kind": "hidden",
             "names": [f"{i}.weight" for i in range(SPLIT, len(params))]}]


def _fsdp2_step(rank: int, name: str, ns: str = "float32") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(n, m, bias=False) for m, n in SHAPES)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    params = [layer.weight for layer in model]
    opt = meqmuon.build_optimizer(name, _groups(params), ns_dtype=getattr(torch, ns), foreach=True)
    out = {}
    for step in range(3):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = distribute_tensor(g, mesh, p.placements)
        if step < 2:
            opt.step()  # the first plans (its DTensor ops are not the exchange's); the third is metered
            continue
        meter = StepMeter()
        with meter:
            opt.step()
        out = meter.summary()
    ex = opt._exchange
    out["exchanges"] = {id(e.split) for _, entries, _ in opt._plan() for e in entries} == {id(ex)}
    out["owners"], out["load"] = [u.owner for u in ex.units], list(ex.load)
    out["floor"] = floor_bytes(opt, getattr(torch, ns).itemsize)
    out["local"] = [tuple(p.to_local().shape) for p in params]
    out["params"] = [p.full_tensor() for p in params]
    out["reference"] = _one_process(name, ns)  # in the worker: the same threads as the sharded step
    return out


def _one_process(name: str, ns: str = "float32") -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(n, m, bias=False) for m, n in SHAPES)
    params = [layer.weight for layer in model]
    opt = meqmuon.build_optimizer(name, _groups(params), ns_dtype=getattr(torch, ns), foreach=True)
    for step in range(3):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def _f32_steps(rank: int) -> dict:
    return {name: _fsdp2_step(rank, name) for name in ("muon", "meqmuon")}


def test_fsdp2_exchange_sends_each_piece_once_with_no_padding_and_equals_one_process(tmp_path):
    """Muon, float32 Newton-Schulz: each rank sends its rows once and the whole directions of the matrices it
    owns (each owned once), receives the same, one pair of exchanges per shape bucket; the owners are the one
    plan over both param groups (longest first by ``driver.cost``), whose busiest rank does the least
    Newton-Schulz work any assignment gives. MeqMuon's counter adds 8 B per matrix per rank, nothing else."""
    got = _spawn(_f32_steps, tmp_path)
    rule, group = _hidden_rule_and_group("muon")
    costs = [driver.cost(rule, s, group) for s in SHAPES]
    plan, load = assign_owners(costs, [0.0, 0.0]), [0.0, 0.0]
    assign_owners(costs, load)
    # planned group by group from no load, the owners would differ: the test tells the two apart
    assert plan != assign_owners(costs[:SPLIT], [0.0, 0.0]) + assign_owners(costs[SPLIT:], [0.0, 0.0])
    whole = [4 * m * n for m, n in SHAPES]  # bytes of each matrix in float32
    for name, counter in (("muon", 0), ("meqmuon", 8)):
        for rank, r in enumerate(got):
            r = r[name]
            assert r["exchanges"] and r["owners"] == plan and r["load"] == load, (name, rank, r["owners"])
            local = sum(4 * a * b for a, b in r["local"])
            assert r["floor"] == 2 * local, (rank, r["floor"])
            # out: this rank's rows of every matrix to their owners; back: each owner's whole directions, each
            # rank its rows (and MeqMuon's counter, whole to each rank). So sent = local + the whole matrices
            # it owns, and received the same, nothing padded.
            owned = sum(w + 2 * counter for w, o in zip(whole, plan, strict=True) if o == rank)
            assert r["sent"] == local + owned + AGREEMENT_BYTES, (name, rank, r["sent"], local, owned)
            received = local + sum(w for w, o in zip(whole, plan, strict=True) if o == rank) + counter * len(SHAPES)
            assert r["received"] == received + AGREEMENT_BYTES, (name, rank, r["received"], received)
            assert r["calls"] == {"alltoall_base_": 6, **AGREEMENT_CALLS}, r["calls"]  # one pair per shape bucket
        _equal_one_process([r[name] for r in got])
    group = _hidden_rule_and_group()[1] | {"ns_method": "quintic", "ns_steps": 5}
    flops = [method_flops(group, m, n) for m, n in SHAPES]
    best = min(max(sum(c for c, o in zip(flops, a, strict=True) if o == r) for r in (0, 1))
               for a in itertools.product((0, 1), repeat=len(flops)))
    for rank, r in enumerate(got):
        assert r["muon"]["flops"] == sum(c for c, o in zip(flops, plan, strict=True) if o == rank), rank
    assert max(r["muon"]["flops"] for r in got) == best, ([r["muon"]["flops"] for r in got], best)


def _bf16_steps(rank: int) -> dict:
    return {name: _fsdp2_step(rank, name, "bfloat16") for name in ("muon", "meqmuon", "normuon")}


def _factored(m: int, rows: list[int], n: int) -> bool:
    """Whether an ``m x n`` bucket's directions come back as bf16 ``U`` with float32 factors: fewer bytes than a
    float32 ``D`` for every rank's piece of ``r`` rows (its ``r`` row factors and ``n`` column factors against
    2 B more for each of its ``r x n`` elements)."""
    return all(2 * r * n + 4 * (r + n) < 4 * r * n for r in rows if r)


def test_bf16_newton_schulz_fsdp2_pieces_travel_in_bf16_at_exactly_their_shapes_bytes(tmp_path):
    """With bf16 Newton-Schulz (the CUDA default) every rank's rows go out in bf16 (NorMuon's per-row second
    moment beside them as its float32 piece); the directions come back as Muon's bf16 ``U``, or MeqMuon's and
    NorMuon's bf16 ``U`` with the factors of the rank's rows and of the ``n`` columns where those are fewer
    bytes than a float32 ``D`` (not for the 3 x 32 matrix, 2 rows a rank: its ``D``), with NorMuon's second
    moment as its piece and MeqMuon's counter whole (int64). Counted exactly per rank from the shapes and the
    owners; the same bits as one process with bf16 Newton-Schulz."""
    got = _spawn(_bf16_steps, tmp_path)
    world = len(got)
    rows = [[c.numel() for c in torch.arange(m).chunk(world)] for m, _ in SHAPES]  # FSDP2's rows per rank
    rows = [c + [0] * (world - len(c)) for c in rows]

    def way_back(name: str, i: int, r: int) -> int:  # bytes rank r receives of matrix i from its owner
        (m, n), q = SHAPES[i], rows[i][r]
        direction = 2 * q * n + 4 * (q + n) if name != "muon" and _factored(m, rows[i], n) else \
            (2 if name == "muon" else 4) * q * n
        return direction + {"muon": 0, "meqmuon": 8, "normuon": 4 * q}[name]

    def way_out(name: str, i: int, r: int) -> int:  # bytes rank r sends of matrix i to its owner
        q, n = rows[i][r], SHAPES[i][1]
        return 2 * q * n + (4 * q if name == "normuon" else 0)

    assert [_factored(m, rows[i], n) for i, (m, n) in enumerate(SHAPES)] == [True, True, True, False]
    for name in ("muon", "meqmuon", "normuon"):
        for q, r in enumerate(got):
            r = r[name]
            plan = r["owners"]
            mine = [i for i, o in enumerate(plan) if o == q]
            sent = sum(way_out(name, i, q) for i in range(len(SHAPES))) + \
                sum(way_back(name, i, s) for i in mine for s in range(world))
            received = sum(way_back(name, i, q) for i in range(len(SHAPES))) + \
                sum(way_out(name, i, s) for i in mine for s in range(world))
            assert (r["sent"] - AGREEMENT_BYTES, r["received"] - AGREEMENT_BYTES) == (sent, received), (
                name, q, r["sent"], r["received"], sent, received)
            assert r["calls"] == {"alltoall_base_": 6, **AGREEMENT_CALLS}, (name, r["calls"])  # a pair per bucket
            assert r["floor"] == 2 * 2 * sum(a * b for a, b in r["local"]), (q, r["floor"])
        _equal_one_process([r[name] for r in got])


def test_pieces_that_tile_a_stack_are_put_together_in_one_copy():
    """``assembly.put_together`` at an owner of 4 senders' pieces: a run of two float32 matrices whose rows the
    senders hold in equal blocks in rank order (FSDP2's even rows), and one whose 2 x 2 blocks of rows by columns they
    hold column by column (a grid, as FSDP2 x TP lays it out), are each copied into their stack by one kernel
    (``assembly._tiled``); a run whose pieces are two boxes each (interleaved rows) per sender and box. Every whole is
    what the senders hold."""
    from meqmuon.optim.assembly import Run, put_together

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2, 8, 3, generator=g), torch.randn(1, 8, 2, generator=g).bfloat16(),
               torch.randn(1, 4, 6, generator=g))
    full = (slice(0, 3),)
    rows = {r: ([((slice(2 * r, 2 * r + 2), *full), (slice(0, 2), *full))], (2, 3)) for r in range(4)}
    pairs = {r: ([((slice(r, r + 1), slice(0, 2)), (slice(0, 1), slice(0, 2))),
                  ((slice(r + 4, r + 5), slice(0, 2)), (slice(1, 2), slice(0, 2)))], (2, 2)) for r in range(4)}
    box = {r: (slice(2 * (r % 2), 2 * (r % 2) + 2), slice(3 * (r // 2), 3 * (r // 2) + 3)) for r in range(4)}
    grid = {r: ([(box[r], (slice(0, 2), slice(0, 3)))], (2, 3)) for r in range(4)}
    done = [Run([0, 1], torch.empty_like(a), [], [rows]), Run([2], torch.empty_like(b), [], [pairs]),
            Run([3], torch.empty_like(c), [], [grid])]
    out = torch.cat([t.reshape(-1).view(torch.uint8) for r in range(4)
                     for t in (a[:, 2 * r : 2 * r + 2], b[:, [r, r + 4]], c[(slice(None), *box[r])])])
    meter = StepMeter()
    with meter:
        put_together(done, out, 4)
    assert torch.equal(done[0].stack, a) and torch.equal(done[1].stack, b) and torch.equal(done[2].stack, c)
    assert meter.ops == 1 + 4 * 2 + 1
    # uneven shards, the first sender's piece empty (rows 0, 3, 3, 2 of 8): a copy per sender that holds any
    cuts = [0, 0, 3, 6, 8]
    uneven = {r: ([((slice(cuts[r], cuts[r + 1]), *full), (slice(0, cuts[r + 1] - cuts[r]), *full))],
                  (cuts[r + 1] - cuts[r], 3)) for r in range(4)}
    run = Run([0, 1], torch.empty_like(a), [], [uneven])
    put_together([run], torch.cat([a[:, cuts[r] : cuts[r + 1]].reshape(-1).view(torch.uint8) for r in range(4)]), 4)
    assert torch.equal(run.stack, a)


def test_the_way_back_travels_part_by_part_and_is_read_back_as_stacks():
    """``assembly.in_runs`` and ``received_back``, the two ends of the way back, without a collective: an owner's
    units for one rank (bf16 ``U``, float32 factors, an int64 counter) in stretches of alike units, sent part by part;
    read back behind another owner's 3 bytes (every block unaligned), each unit's parts are what was sent, a
    stretch's part is one stack, and the unaligned blocks are copied by one kernel (``assembly.aligned``)."""
    from meqmuon.optim.assembly import in_runs, received_back

    g = torch.Generator().manual_seed(0)

    def unit(m: int, n: int) -> list[torch.Tensor]:
        return [torch.randn(m, n, generator=g).bfloat16(), torch.randn(m, generator=g), torch.randn(n, generator=g),
                torch.randint(0, 9, (1,), generator=g)]

    units = [unit(3, 5), unit(3, 5), unit(2, 5), unit(3, 5), unit(3, 5), unit(3, 5)]
    sent = in_runs(units)
    assert [t.shape for t in sent[:4]] == [(3, 5), (3, 5), (3,), (3,)]  # the first stretch's U, then its rows
    # owner 0 sends 3 bytes first; unit 1 is owner 2's, a DDP owner's own, not received
    head = torch.tensor([7, 7, 7], dtype=torch.uint8)
    flat = torch.cat([head, *(t.reshape(-1).view(torch.uint8) for t in sent)])
    specs = [[((3,), torch.uint8)], None, *([(tuple(t.shape), t.dtype) for t in ps] for ps in units)]
    meter = StepMeter()
    with meter:
        got = received_back(specs, [0, 2] + [1] * len(units), [None, ["own"], *[None] * len(units)], flat,
                            [3, flat.numel() - 3, 0])
    assert torch.equal(got[0][0], head) and got[1] == ["own"]
    for ps, back in zip(units, got[2:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ps, back, strict=True))
    assert [members for members, _ in got.runs] == [[0], [2, 3], [4], [5, 6, 7]]
    members, stacks = got.runs[3]
    assert all(torch.equal(stacks[k][i], units[j - 2][k]) for k in range(4) for i, j in enumerate(members))
    assert meter.ops == 1  # owner 1's blocks all lie unaligned: one cat copies them all


#: A stack of experts ``(E, 32, 48)`` on its dimension 1 (torchtitan's layout where the ranks outnumber the experts):
#: 16 rows a rank, where eq. 8's factors pay for every piece (bf16 ``U``, ``transfer.pays``).
EXPERT = (32, 48)


def _experts_step(experts: int, name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))

    def build(shard: bool):
        torch.manual_seed(0)
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(torch.randn(experts, *EXPERT) * 0.02)
        if shard:
            fully_shard(module, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
        return module.w, meqmuon.build_optimizer(name, [{"params": [module.w], "kind": "hidden", "names": ["w"],
                                                                        "views": ["stacked"]}],
                                                 ns_dtype=torch.bfloat16, foreach=True,
                                                 **({"exchange_unit": "matrix"} if shard else {}))

    (w, opt), (ref, ref_opt) = build(True), build(False)
    meter = StepMeter()
    for step in range(3):
        g = torch.randn(experts, *EXPERT, generator=torch.Generator().manual_seed(100 + step))
        w.grad, ref.grad = distribute_tensor(g, mesh, w.placements), g.clone()
        with meter if step == 2 else contextlib.nullcontext():  # the first plans; the third is metered
            opt.step()
        ref_opt.step()
    return {"ops": meter.ops, "units": len(opt._exchange.units), "owners": [u.owner for u in opt._exchange.units],
            "diff": (w.full_tensor() - ref.detach()).abs().max().item()}


def _experts_worker(rank: int) -> dict:
    from meqmuon.optim import newton_schulz

    # Newton-Schulz of a shape bucket in one batched call, as on a GPU (on CPU it runs matrix by matrix, a kernel
    # set each, which is faster there): what is left to grow with the experts is the exchange's own
    newton_schulz.BATCHED_NS_DEVICES = newton_schulz.BATCHED_NS_DEVICES | {"cpu"}
    return {(e, name): _experts_step(e, name) for e in (4, 16) for name in ("meqmuon", "normuon")}


def test_a_stacks_experts_come_back_as_stacks_in_kernels_flat_in_the_experts(tmp_path):
    """``exchange_unit="matrix"`` with bf16 Newton-Schulz on 2 gloo ranks, a stack of experts on its dimension 1: each
    expert a unit, half of them owned by each rank; each comes back as bf16 ``U`` with eq. 8's (NorMuon's) factors,
    an owner's alike units part by part (``assembly.in_runs``), so that a rank applies the factors to a stretch of
    experts in one product (``transfer.apply_received``): the step's kernels at 16 experts are those at 4, and its
    weights are one process's bit for bit."""
    got = _spawn(_experts_worker, tmp_path)
    for r in got:
        for (experts, name), run in r.items():
            assert run["units"] == experts and sorted(run["owners"]) == sorted([0, 1] * (experts // 2)), run["owners"]
            assert run["diff"] == 0, (experts, name, run["diff"])
        for name in ("meqmuon", "normuon"):
            assert r[(16, name)]["ops"] == r[(4, name)]["ops"], (name, r[(16, name)]["ops"], r[(4, name)]["ops"])


def _equal_one_process(got: list[dict]) -> None:
    """Within tests/test_layouts.py's bound (1e-6) of one process; the matrices with even shards bit for bit
    (the 3 x 32 one differs by an ulp of one process's, before this exchange as after)."""
    for r in got:
        for i, (p, q) in enumerate(zip(r["params"], r["reference"], strict=True)):
            torch.testing.assert_close(p, q, rtol=0, atol=0 if SHAPES[i][0] % 2 == 0 else 1e-6)


# ---- DDP on 2 gloo ranks: at the floor (issue 55 item 1) ----------------------------------------------------

#: A replicated Llama with Llama-60M's proportions at a quarter of the width, one decoder layer, and a
#: vocabulary whose embedding and head (2 x 1024 x 128) outweigh the hidden matrices (4 x 128^2 + 3 x 128 x 352):
#: were they to travel, a rank would send more than the floor.
DDP_LLAMA = dict(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=64, attn_implementation="eager",
                 tie_word_embeddings=False)
DDP_OPTIMIZERS = ("meqmuon", "muon", "normuon")
DDP_STEPS = 3


def _ddp_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**DDP_LLAMA)).float()


def _ddp_batch(step: int) -> dict:
    ids = torch.randint(0, DDP_LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids}


def _ddp_run(name: str, ns: str, skip_embedding: bool = False) -> dict:
    """``name`` on the replicated model, the same batch on every rank (every rank's gradients are those DDP's
    all-reduce leaves), the last step metered. ``skip_embedding``: the negative control, rank 1 leaves out the
    embedding's update in the last step (a rule run in place on only one rank)."""
    model = _ddp_llama()
    opt = meqmuon.build_optimizer(name, model, lr=0.02, weight_decay=0.1, ns_dtype=getattr(torch, ns), foreach=True)
    meter = StepMeter()
    for step in range(DDP_STEPS):
        model(**_ddp_batch(step)).loss.backward()
        if skip_embedding and dist.get_rank() == 1 and step == DDP_STEPS - 1:
            model.model.embed_tokens.weight.grad = None
        if step == DDP_STEPS - 1:
            with meter:
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    ex = opt._exchange
    return {**meter.summary(), "floor": floor_bytes(opt, getattr(torch, ns).itemsize),
            "units": [(tuple(u.pieces.shape), u.owner) for u in ex.units],
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "state": opt.state_dict(),
            "counts": opt.selection_counts() if name == "meqmuon" else None}


def _ddp_worker(rank: int) -> dict:
    out = {(name, ns): _ddp_run(name, ns) for name in DDP_OPTIMIZERS for ns in ("float32", "bfloat16")}
    out["control"] = _ddp_run("muon", "float32", skip_embedding=True)
    return out


def _ddp_one_process(name: str, ns: str) -> tuple[dict, dict, dict | None]:
    model = _ddp_llama()
    opt = meqmuon.build_optimizer(name, model, lr=0.02, weight_decay=0.1, ns_dtype=getattr(torch, ns), foreach=True)
    for step in range(DDP_STEPS):
        model(**_ddp_batch(step)).loss.backward()
        opt.step()
        opt.zero_grad()
    return ({n: p.detach() for n, p in model.named_parameters()}, opt.state_dict(),
            opt.selection_counts() if name == "meqmuon" else None)


def _identical(a: dict, b: dict) -> None:
    """Two ranks' (or a rank's and one process's) parameters and ``state_dict()`` bit for bit."""
    assert a["params"].keys() == b["params"].keys()
    for n, p in a["params"].items():
        assert torch.equal(p, b["params"][n]), n
    _state_equal(a["state"], b["state"])


def _state_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k, st in a["state"].items():
        assert st.keys() == b["state"][k].keys(), k
        for key, v in st.items():
            w = b["state"][k][key]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, key)


def _ddp_back_bytes(name: str, ns: str, shape: tuple[int, int]) -> int:
    """What an owner sends each other rank of one hidden ``m x n`` matrix under DDP: float32 Newton-Schulz, ``D``
    in float32; bf16, Muon's ``U`` in bf16, MeqMuon's and NorMuon's bf16 ``U`` with float32 factors of its ``m``
    rows and ``n`` columns (fewer bytes than ``D`` at these widths); then the per-matrix state whole (MeqMuon's
    int64 counter, NorMuon's ``m`` float32 second moments)."""
    m, n = shape
    if ns == "float32":
        direction = 4 * m * n
    else:
        direction = 2 * m * n + (4 * (m + n) if name != "muon" else 0)
    return direction + {"muon": 0, "meqmuon": 8, "normuon": 4 * m}[name]


def test_ddp_sends_each_hidden_direction_once_at_the_floor_and_equals_one_process(tmp_path):
    """MeqMuon, Muon and NorMuon under DDP, float32 and bf16 Newton-Schulz: the embedding, head and norms step in
    place on every rank (no bytes: only the hidden directions' ``all_to_all_single``, one per shape bucket, as
    a DDP unit's input never travels); each rank sends exactly the directions it owns, once to the other rank,
    and receives the rest, at most 1.05x the floor; the ranks end bit-identical, ``state_dict()`` included, and
    equal to one process bit for bit (float32 and bf16 Newton-Schulz alike)."""
    got = _spawn(_ddp_worker, tmp_path)
    world = len(got)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' threads: the same bits
    try:
        reference = {key: _ddp_one_process(*key) for key in got[0] if key != "control"}
    finally:
        torch.set_num_threads(threads)
    hidden = 4 * 128 * 128 + 3 * 128 * 352
    embedding = 2 * 1024 * 128
    assert embedding > hidden  # were the embedding and head to travel, they would dominate
    for (name, ns), ref in reference.items():
        runs = [r[(name, ns)] for r in got]
        itemsize = getattr(torch, ns).itemsize
        for rank, r in enumerate(runs):
            assert r["floor"] == itemsize * hidden, (name, ns, r["floor"])
            assert sorted(s for s, _ in r["units"]) == sorted([(128, 128)] * 4 + [(352, 128)] * 2 + [(128, 352)])
            owned = sum(_ddp_back_bytes(name, ns, s) for s, o in r["units"] if o == rank)
            others = sum(_ddp_back_bytes(name, ns, s) for s, o in r["units"] if o != rank)
            assert (r["sent"] - AGREEMENT_BYTES, r["received"] - AGREEMENT_BYTES) == ((world - 1) * owned, others), (
                name, ns, rank, r["sent"], owned)
            assert r["sent"] <= 1.05 * r["floor"] and r["received"] <= 1.05 * r["floor"], (name, ns, rank, r)
            buckets = 3 if name == "normuon" else 2  # NorMuon's per-row state keeps (128, 352) apart
            assert r["calls"] == {"alltoall_base_": buckets, **AGREEMENT_CALLS}, (name, ns, r["calls"])
            assert 0 < owned, (name, ns, rank)  # the work is shared
        _identical(runs[0], runs[1])
        params, state, counts = ref
        _identical(runs[1], {"params": params, "state": state})
        assert runs[0]["counts"] == runs[1]["counts"] == counts
    # the negative control: rank 1 skips the embedding's in-place update; the identity check must see it
    with pytest.raises(AssertionError):
        _identical(got[0]["control"], got[1]["control"])
    with pytest.raises(AssertionError):
        _state_equal(got[0]["control"]["state"], got[1]["control"]["state"])
    # and nothing else differs: the hidden matrices still come from their owners
    c0, c1 = got[0]["control"]["params"], got[1]["control"]["params"]
    assert [n for n in c0 if not torch.equal(c0[n], c1[n])] == ["model.embed_tokens.weight"]


def _mixed_worker(rank: int) -> dict:
    """A plain (DDP) and a ``Shard(0)`` 32 x 32 hidden matrix in two param groups with the same hyperparameters,
    which the batched step merges into one call and one shape bucket of the exchange, in both orders; against
    one process (the same optimizer over a process group of this rank alone)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    solo = [dist.new_group([0]), dist.new_group([1])][rank]  # every rank makes every group
    g = torch.Generator().manual_seed(0)
    w, grad = [torch.randn(32, 32, generator=g) for _ in range(2)], [torch.randn(32, 32, generator=g) for _ in range(2)]
    one = [torch.nn.Parameter(t.clone()) for t in w]
    opt = meqmuon.build_optimizer("muon", [{"params": [p], "kind": "hidden"} for p in one], foreach=True,
                                  ns_dtype=torch.float32, process_group=solo)
    for p, t in zip(one, grad, strict=True):
        p.grad = t.clone()
    opt.step()
    out = {}
    for plain_first in (True, False):
        plain = torch.nn.Parameter(w[0].clone())
        sharded = torch.nn.Parameter(distribute_tensor(w[1].clone(), mesh, [Shard(0)]))
        plain.grad, sharded.grad = grad[0].clone(), distribute_tensor(grad[1].clone(), mesh, [Shard(0)])
        groups = [{"params": [plain], "kind": "hidden"}, {"params": [sharded], "kind": "hidden"}]
        opt = meqmuon.build_optimizer("muon", groups if plain_first else groups[::-1], foreach=True,
                                      ns_dtype=torch.float32)
        opt.step()
        out[plain_first] = [torch.equal(plain.detach(), one[0].detach()),
                            torch.equal(sharded.full_tensor(), one[1].detach())]
    return out


def test_plain_and_sharded_matrices_of_one_shape_in_one_call_step_as_one_process(tmp_path):
    """A plain hidden matrix (its Newton-Schulz shared as under DDP) and a sharded one of the same shape, in two
    param groups with the same hyperparameters (one batched call, one shape bucket): both equal one process, in
    either order of the groups."""
    for r in _spawn(_mixed_worker, tmp_path):
        assert r == {True: [True, True], False: [True, True]}, r


# ---- what travels back ------------------------------------------------------------------------------------


def test_what_an_owner_sends_back_follows_the_rules_post():
    """``transfer.form_of``, derived per class and kept as ``HiddenRule.transfer_form``: ``U`` alone where
    ``post`` is the identity (a ``pre`` or ``inputs`` of its own does not matter), ``U`` and factors where the
    class that defines ``post_factors`` also defines (or inherits below) ``post`` and ``post_all``, else ``D``
    (a rule with a step of its own too): a user's subclass of MeqMuon's rule that changes ``post`` must not
    travel as eq. 8's factors."""
    from meqmuon.optim.rules import RULES
    from meqmuon.optim.rules.meqmuon import MeqHidden
    from meqmuon.optim.rules.muon import MoonlightHidden
    from meqmuon.optim.rules.normuon import NorMuonHidden

    class OnlyPre(meqmuon.HiddenRule):
        name = "only_pre"

        def pre(self, X, group, state=None):
            return X * 2

    class OwnPost(MeqHidden):
        name = "own_post"

        def post(self, U, group, state):
            return U * 2

    class OwnPostAll(MeqHidden):
        name = "own_post_all"

        def post_all(self, Us, group, states):
            return [U * 2 for U in Us]

    class OwnStep(MoonlightHidden):
        name = "own_step"
        transposes = False

        def step_weights(self, W, D, scale, group):
            W.sub_(D)

    classes = (MoonlightHidden, OnlyPre, MeqHidden, NorMuonHidden, OwnPost, OwnPostAll)
    forms = {c: transfer.form_of(c, meqmuon.HiddenRule) for c in classes}
    assert forms == {MoonlightHidden: transfer.IDENTITY, OnlyPre: transfer.IDENTITY, MeqHidden: transfer.FACTORS,
                     NorMuonHidden: transfer.FACTORS, OwnPost: transfer.DIRECTION,
                     OwnPostAll: transfer.DIRECTION}, forms
    assert all(c.transfer_form == forms[c] for c in classes)
    assert OwnStep.transfer_form == transfer.DIRECTION  # its weights come back stepped
    hidden = {n: r.transfer_form for n, r in RULES.items() if isinstance(r, meqmuon.HiddenRule)}
    assert {n for n, f in hidden.items() if f == transfer.IDENTITY} == {
        "moonlight_hidden", "muoneq_hidden", "aurora_hidden", "muon_vs"}, hidden
    assert {n for n, f in hidden.items() if f == transfer.FACTORS} == {"meq_hidden", "normuon_hidden"}, hidden


def test_factors_travel_only_where_fewer_bytes_and_in_the_directions_dtype():
    """``transfer.pays``, the one rule of every layout: bf16 ``U`` with float32 factors for a piece of 16 x 4096
    (fewer bytes than a float32 ``D``), not for 2 rows (as many), not with float32 ``U``, not for a rule without
    factors, and not for a float64 ``D``: factors widened to float64 round eq. 8's products otherwise than one
    process, whose ``D`` is float32 (checked here)."""
    from meqmuon import functional as F

    pays, f, bf16, f32, f64 = transfer.pays, transfer.FACTORS, torch.bfloat16, torch.float32, torch.float64
    assert pays(f, 16, 4096, bf16, f32) and pays(f, 3, 4096, bf16, f32)
    assert not pays(f, 2, 4096, bf16, f32) and not pays(f, 16, 4096, f32, f32)
    assert not pays(transfer.IDENTITY, 16, 4096, bf16, f32) and not pays(transfer.DIRECTION, 16, 4096, bf16, f32)
    assert not pays(f, 16, 4096, bf16, f64)
    u = (torch.randn(1, 64, 48, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 48)).to(bf16)
    (d,), _ = F.adaptive_normalize_stacks([u])
    ((row, col),), _ = F.adaptive_normalize_factors([u])
    assert torch.equal(transfer.apply(u, row, col, False), d)
    assert not torch.equal(transfer.apply(u, row.double(), col.double(), False), d.double())


# ---- the exchange overlapped (the optimizer's ``overlap``) -------------------------------------------------


def _overlap_run(layout: str, foreach: bool, overlap: bool) -> dict:
    """MeqMuon (float32 Newton-Schulz) on :data:`SHAPES` in reverse (three shape buckets), FSDP2 or DDP
    (replicated, the same gradients on every rank), 3 steps; the last one's order of events recorded: ``"post"`` an
    exchange posted, ``"wait"`` a wait on one, ``"ns"`` an owner's bucket (``exchange._at_owners``), and the
    buckets' shapes in the order owners ran them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from meqmuon.optim import exchange

    torch.manual_seed(0)
    # the smallest first, so that the plan's order of buckets is not the longest first
    model = torch.nn.ModuleList(torch.nn.Linear(n, m, bias=False) for m, n in reversed(SHAPES))
    mesh = init_device_mesh("cpu", (2,)) if layout == "fsdp2" else None
    for layer in model if mesh is not None else ():
        fully_shard(layer, mesh=mesh)
    params = [layer.weight for layer in model]
    opt = meqmuon.build_optimizer("meqmuon", [{"params": params, "kind": "hidden"}], ns_dtype=torch.float32,
                                  foreach=foreach, overlap=overlap)  # one group: one pipeline of buckets
    events: list[str] = []
    shapes: list[tuple[int, ...]] = []
    flat, at_owners, wait = exchange.exchange_flat, exchange._at_owners, exchange.InFlight.wait

    def posted(*args, **kwargs):
        events.append("post")
        return flat(*args, **kwargs)

    def owners(c, *args, **kwargs):
        events.append("ns")
        shapes.append(tuple(c.bucket.global_shape))
        return at_owners(c, *args, **kwargs)

    def waited(self):
        if self._work is not None:
            events.append("wait")
        return wait(self)

    for step in range(3):
        for p, g in zip(params, reversed(_grads(step)), strict=True):
            p.grad = distribute_tensor(g, mesh, p.placements) if mesh is not None else g
        if step == 2:
            exchange.exchange_flat, exchange._at_owners, exchange.InFlight.wait = posted, owners, waited
        try:
            opt.step()
        finally:
            exchange.exchange_flat, exchange._at_owners, exchange.InFlight.wait = flat, at_owners, wait
    whole = (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)  # noqa: E731
    state = opt.state_dict()
    state["state"] = {k: {key: whole(v) for key, v in st.items()} for k, st in state["state"].items()}
    return {"events": events, "shapes": shapes, "depth": opt._exchange.depth,
            "params": {i: whole(p).detach().clone() for i, p in enumerate(params)}, "state": state}


OVERLAPS = (True, False, "all")


def _overlap_worker(rank: int) -> dict:
    return {(layout, foreach, overlap): _overlap_run(layout, foreach, overlap)
            for layout in ("fsdp2", "ddp") for foreach in (True, False) for overlap in OVERLAPS}


def _pipeline(buckets: int, out: bool, overlap: bool | str) -> list[str]:
    """The order a rank posts, waits and computes ``buckets`` shape buckets (``out``: the inputs travel, as under
    FSDP2; under DDP only the directions do): one at a time, each collective blocking (no wait of its own);
    ``True``: bucket ``k + 1``'s inputs posted and bucket ``k - 1``'s directions awaited around bucket ``k``'s
    Newton-Schulz; ``"all"``: every bucket's inputs posted first, every way back awaited last."""
    o = ["post", "wait"] if out else []
    if not overlap:
        return [e for _ in range(buckets) for e in (*o[:1], "ns", "post")]
    if overlap == "all":
        return [*o[:1] * buckets, *[e for _ in range(buckets) for e in (*o[1:], "ns", "post")], *["wait"] * buckets]
    events = o[:1]
    for k in range(buckets):
        events += [*(o[:1] if k + 1 < buckets else []), *o[1:], "ns", *(["wait"] if k else []), "post"]
    return events + ["wait"]


def test_overlap_pipelines_the_buckets_with_the_same_bits(tmp_path):
    """``overlap=True`` on 2 gloo ranks, FSDP2 and DDP, batched and per tensor: every rank posts bucket ``k + 1``'s
    inputs before bucket ``k``'s Newton-Schulz and waits for bucket ``k - 1``'s directions only after it (the
    recorded order is the pipeline's, not the blocking one's, which ``overlap=False`` still gives); with
    ``overlap="all"`` every bucket's inputs are posted before the first Newton-Schulz and every way back awaited
    after the last; the buckets longest first, and the parameters and ``state_dict()`` are those of
    ``overlap=False`` bit for bit."""
    got = _spawn(_overlap_worker, tmp_path)
    assert _pipeline(2, True, True) == ["post", "post", "wait", "ns", "post", "wait", "ns", "wait", "post", "wait"]
    assert _pipeline(2, True, "all") == ["post", "post", "wait", "ns", "post", "wait", "ns", "post", "wait", "wait"]
    for r in got:
        for (layout, foreach, overlap), run in r.items():
            assert run["depth"] == {False: 1, True: 2, "all": sys.maxsize}[overlap]
            buckets = run["events"].count("ns")
            assert buckets == 3, (layout, foreach, run["events"])  # every rank runs every bucket, owned or not
            assert run["events"] == _pipeline(buckets, layout == "fsdp2", overlap), (layout, foreach, overlap, run)
            other = r[(layout, foreach, False)]
            if overlap:
                _identical(run, other)
            if overlap:  # the longest Newton-Schulz first (one matrix a bucket per owner here: the largest first)
                assert run["shapes"] == sorted(other["shapes"], key=lambda s: -s[0] * s[1] * min(s)), run["shapes"]
                assert run["shapes"] != other["shapes"], run["shapes"]  # the plan's order is not it
    for key in got[0]:
        _identical(got[0][key], got[1][key])


def test_overlap_defaults_to_where_the_step_runs_and_is_checked():
    w = torch.nn.Parameter(torch.zeros(8, 8))
    for bad in (1, "al"):
        with pytest.raises(ValueError, match=f"Invalid overlap: {bad!r}"):
            meqmuon.build_optimizer("meqmuon", [{"params": [w], "kind": "hidden"}], overlap=bad)
    with pytest.raises(ValueError, match="Invalid overlap: 1"):
        meqmuon.build_optimizer("meqmuon", [{"params": [w], "kind": "hidden"}], overlap=1)
    assert meqmuon.build_optimizer("muon", [{"params": [w], "kind": "hidden"}], overlap=True)._overlap is True
