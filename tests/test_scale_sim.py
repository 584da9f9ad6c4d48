"""The instruments of issue 47 measure what they say: ``benchmarks/step_accounting.py`` (bytes of collectives,
the floor, tensors held, transient allocations, matmul FLOPs, memory traffic), ``benchmarks/comm_bytes.py``
(gloo) and ``benchmarks/scale_sim.py`` (torch's fake process group); and issue 59's time model
(``benchmarks/time_model.py``) turns their counts into seconds as its docstring says.

Every count is checked against a number worked out by hand from shapes, on code we did not write where we can
(``torch.distributed`` collectives, ``torch.optim.AdamW``'s state, a DTensor's ``full_tensor()``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import _spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale_sim  # noqa: E402
import time_model  # noqa: E402
from rank_model import RankModel, adamw_bytes, rank_model  # noqa: E402
from step_accounting import AGREEMENT_BYTES, StepMeter, floor_bytes, held_bytes  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")


def test_meter_counts_allocations_until_freed_and_matmul_flops():
    for device in ("cpu", "meta"):
        meter = StepMeter()
        with meter:
            a = torch.empty(1000, device=device)  # 4000 B
            b = torch.ones(10, 20, device=device) @ torch.ones(20, 30, device=device)  # 2*10*20*30 FLOPs
            v = a[:10]  # a view: no new storage
            del a, v
            c = torch.zeros(250, device=device)  # 1000 B, after a's 4000 B are freed
        assert meter.flops == 2 * 10 * 20 * 30, device
        # alive at once at most: a (4000) + the two ones operands (800 + 2400) + the product (1200)
        assert meter.peak == 4000 + 800 + 2400 + 1200, device
        assert meter.live == 1200 + 1000, device  # b and c
        del b, c


def test_held_bytes_of_adamw_is_its_state_and_excludes_parameters_and_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4, bias=False))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    params = sum(p.numel() for p in model.parameters())
    held = held_bytes(opt)
    # exp_avg and exp_avg_sq per element, and one float32 step tensor per parameter
    assert held == {"state": 2 * 4 * params + 4 * 3, "other": 0, "total": 2 * 4 * params + 4 * 3,
                    "params": 4 * params}
    opt.scratch = {"kept": [torch.empty(7, dtype=torch.float64)], "grad view": model[0].weight.grad[:2]}
    assert held_bytes(opt)["other"] == 7 * 8  # the gradient's view is the gradient's storage: excluded


def test_one_walk_serves_the_package_and_the_benchmark_on_any_device():
    """``meqmuon.optim.memory.held_tensors`` is the walk of both ``optimizer_held_bytes`` and
    ``step_accounting.held_bytes``: each storage once with its kind (a parameter's and its gradient's
    ``params``, ``opt.state``'s ``state``, anything else the optimizer keeps ``other``), on ``meta`` as on CPU
    (a ``meta`` storage has its size), and torch's AdamW's state is what torch keeps."""
    from meqmuon.optim.memory import held_tensors, optimizer_held_bytes

    held = {}
    for device in ("cpu", "meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4, bias=False)).to(device)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        # a workspace, a view of a parameter, a view of a gradient
        opt.kept = [torch.empty(5, device=device), model[0].weight[1:], model[1].weight.grad[:2]]
        kinds = [(kind, t.untyped_storage().nbytes()) for t, kind in held_tensors(opt)]
        # the 3 parameters (one of them also through its view) and the gradient reached; 2 moments and a
        # float32 step per parameter; the workspace
        assert sorted(k for k, _ in kinds) == ["other"] + ["params"] * 4 + ["state"] * 9, (device, kinds)
        held[device] = optimizer_held_bytes(opt)
        assert held_bytes(opt)["state"] == held[device]["state"] and held_bytes(opt)["other"] == 20, device
    params = 4 * (16 * 8 + 8 + 8 * 4)
    assert held["cpu"] == held["meta"] == {"state": 2 * params + 3 * 4, "other": 5 * 4, "params": params}


def _collectives(rank: int) -> dict:
    """Known collectives on 2 gloo ranks, and MeqMuon's FSDP2 step of a stack of linears, metered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    import meqmuon

    mesh = init_device_mesh("cpu", (2,))
    meter = StepMeter()
    with meter:
        x = torch.ones(6, 5)  # every rank sends 2 rows to rank 0 and 4 to rank 1
        out = torch.empty(4 if rank == 0 else 8, 5)
        dist.all_to_all_single(out, x, [2, 2] if rank == 0 else [4, 4], [2, 4])
        dist.all_reduce(torch.ones(3, dtype=torch.float64))
        dist.all_gather_into_tensor(torch.empty(8, dtype=torch.int64), torch.ones(4, dtype=torch.int64))
        DTensor.from_local(torch.ones(2, 6), mesh, [Shard(0)]).full_tensor()  # a functional all-gather
    raw = meter.summary()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32, bias=False) for _ in range(4)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    groups = [{"params": list(model.parameters()), "kind": "hidden", "names": [f"{i}.weight" for i in range(4)]}]
    opt = meqmuon.build_optimizer("muon", groups, ns_dtype=torch.float32, foreach=True)
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        if step:
            step_meter = StepMeter()
            with step_meter:
                opt.step()
        else:
            opt.step()
    adamw = torch.optim.AdamW(model.parameters())
    adamw.step()
    return {"raw": raw, "step": step_meter.summary(), "floor": floor_bytes(opt, 4),
            "adamw": (held_bytes(adamw)["total"], adamw_bytes(model.parameters())), "owners": _owner_bytes(rank, mesh)}


def _owner_bytes(rank: int, mesh) -> dict:
    """Three 32 x 32 matrices on 2 ranks, rowwise ``Shard(1)`` as tensor parallelism's and ``Shard(0)`` as
    FSDP2's, both through the one exchange: rank 0 owns two of them (equal costs, longest-first greedy over all
    units), so it receives 2 x 1024 elements of pieces and sends 2 x 1024 of directions against a floor of its
    3 x 512."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import meqmuon

    out = {}
    for name, placement in (("tp", Shard(1)), ("rows", Shard(0))):
        torch.manual_seed(1)
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(32, 32), mesh, [placement])) for _ in range(3)]
        groups = [{"params": params, "kind": "hidden", "names": [f"w{i}" for i in range(3)]}]
        opt = meqmuon.build_optimizer("muon", groups, ns_dtype=torch.float32, foreach=True)
        meter = StepMeter()
        for step in range(2):
            for p in params:
                p.grad = distribute_tensor(torch.randn(32, 32), mesh, [placement])
            if step:
                with meter:
                    opt.step()
            else:
                opt.step()
        model = rank_model(opt, 4)
        out[name] = {"step": meter.summary(), "floor": floor_bytes(opt, 4), "model_floor": model.floor(rank),
                     "bound": model.bound(rank), "owned": model.owned}
    return out


def test_meter_counts_the_bytes_of_c10d_and_functional_collectives_on_gloo(tmp_path):
    got = _spawn(_collectives, tmp_path)
    for rank, r in enumerate(got):
        raw = r["raw"]
        assert raw["calls"] == {"alltoall_base_": 1, "allreduce_": 1, "_allgather_base_": 1,
                                "all_gather_into_tensor": 1}, raw["calls"]
        recv_a2a = (4 if rank == 0 else 8) * 5 * 4
        # a2a: 30 floats out; all-reduce: 24 B each way; all-gather: 32 B out, 64 B in; full_tensor of a
        # (4, 6) float32 Shard(0): 2 x 6 out, 4 x 6 in
        assert raw["sent"] == 30 * 4 + 24 + 32 + 12 * 4, raw
        assert raw["received"] == recv_a2a + 24 + 64 + 24 * 4, raw
        assert raw["bytes_by_group_size"] == {2: raw["sent"] + raw["received"]}, raw
        # Muon's FSDP2 step of four 32 x 32 row-sharded matrices: each rank's 16 x 32 pieces out, directions
        # back, float32: the floor is 2 x 4 B x 4 x 512; the step moves at least that and at most 5% more
        assert r["floor"] == 2 * 4 * 4 * 16 * 32
        assert r["floor"] <= r["step"]["sent"] <= 1.05 * r["floor"], r
        assert r["floor"] <= r["step"]["received"] <= 1.05 * r["floor"], r
        # AdamW's state as torch keeps it (two moments of the local shard, a float32 step per parameter)
        assert r["adamw"][0] == r["adamw"][1] == 4 * (2 * 4 * 16 * 32 + 4), r["adamw"]
        # rank 0 owns matrices 0 and 2, rank 1 matrix 1 (whole 32 x 32 each), under TP's Shard(1) and FSDP2's
        # Shard(0) alike; the bound, itemsize x (local + owned), is exactly what the step moves each way, above
        # the floor at rank 0 (4 x (1536 + 2048) B against 8 x 1536 B) and below it at rank 1 (4 x (1536 + 1024) B)
        for name, o in r["owners"].items():
            assert o["owned"] == [2048, 1024], (name, o["owned"])
            assert o["floor"] == o["model_floor"] == 2 * 4 * 3 * 32 * 16, name
            assert o["bound"] == 4 * (3 * 512 + (2048 if rank == 0 else 1024)), name
            # and the step's one decision (the skip flag's all-reduce, issue 56)
            assert o["step"]["sent"] == o["step"]["received"] == o["bound"] + AGREEMENT_BYTES, (
                name, rank, o["step"], o["bound"])


def test_simulator_steps_fsdp2_and_ep_on_the_fake_group_and_meta_accounts_as_cpu():
    meta = scale_sim.simulate("llama-tiny", "fsdp2", "8", 0, layers=1, device="meta")
    cpu = scale_sim.simulate("llama-tiny", "fsdp2", "8", 0, layers=1, device="cpu")
    assert "error" not in meta and "error" not in cpu, (meta.get("error"), cpu.get("error"))
    for key in ("sent", "received", "calls", "floor", "flops", "held"):
        assert meta[key] == cpu[key], key  # the meta device's accounting is the real allocations'
    # the transient peak too, for a rule whose kernels are the same on every device: MeqMuon's eq. 8 casts U
    # into a float32 copy on CPU only (functional.adaptive_normalize_stacks), which an owner's peak includes
    muon = [scale_sim.simulate("llama-tiny", "fsdp2", "8", 0, layers=1, device=d, optimizer="muon")
            for d in ("meta", "cpu")]
    assert muon[0]["peak"] == muon[1]["peak"] > 0, [m["peak"] for m in muon]
    # floor: the hidden matrices' local rows (64-wide, 8 ranks: 8 rows of 64 each of q, o; k, v have
    # 2 x 16 = 32 rows, 4 each; gate, up 128 rows, 16 each; down 64 rows of 128, 8 each), 2 x 4 B per element
    local = 8 * 64 * 2 + 4 * 64 * 2 + 16 * 64 * 2 + 8 * 128
    assert meta["floor"] == 2 * 4 * local
    assert meta["sent"] >= meta["floor"] and meta["calls"]
    assert meta["held"]["state"] > 0
    replicated = scale_sim.simulate("moe-tiny", "ep-replicated", "8", 0, layers=2, device="meta")
    # nothing moves but the step's one decision (the skip flag's all-reduce, issue 56)
    assert replicated["floor"] == 0 and replicated["sent"] == replicated["received"] == AGREEMENT_BYTES, replicated
    # AdamW's state there: whole moments of every replicated parameter, an eighth of the 8 experts' stacks
    whole = scale_sim.build_model("moe-tiny", 2).parameters()
    assert replicated["adamw"] == sum(2 * 4 * (p.numel() // 8 if p.ndim == 3 else p.numel()) + 4 for p in whole)


def test_one_rank_counts_every_newton_schulz_flop_and_table_reports_unplannable_layouts():
    one = scale_sim.simulate("llama-tiny", "fsdp2", "1", 0, layers=1, device="meta", optimizer="muon")
    assert one["floor"] == 0 and one["sent"] == 0
    assert one["flops"] == one["ns_total"] > one["ns_largest"] > 0  # all of it on the one rank
    summary = scale_sim.summarise({"rows": [one], "wall_s": 1.0, "rss": 2**30})
    assert summary["owner_load"] == pytest.approx(1.0)
    two_d = scale_sim.simulate("llama-tiny", "fsdp2xtp", "4x2", 0, layers=1, device="meta")
    summary = scale_sim.summarise({"rows": [two_d], "wall_s": 1.0, "rss": 2**30})
    line = scale_sim.table([summary]).splitlines()[-1]
    # the exchange plans from placements alone (no collective), so FSDP2 x TP plans on the fake group;
    # a layout that cannot be planned would say so in one line instead
    assert ("not plannable on fake PG: " in line) == ("error" in two_d), line
    assert line.startswith("| llama-tiny | fsdp2xtp | 4x2 | 0 |")
    assert line.count("|") == scale_sim.HEADER.count("|"), line


def _every_rank(model: str, layout: str, ranks: str, optimizer: str = "meqmuon") -> list[dict]:
    world = scale_sim.world_of(ranks)
    return [scale_sim.simulate(model, layout, ranks, r, layers=2, device="meta", optimizer=optimizer)
            for r in range(world)]


@pytest.mark.parametrize("model,layout,ranks", [("llama-tiny", "fsdp2", "4"), ("llama-tiny", "fsdp2", "3"),
                                                ("moe-tiny", "ep", "4")])
def test_rank_model_read_on_one_rank_predicts_every_rank(model, layout, ranks):
    """Every rank simulated: the plan read on any rank is the same, and it gives every rank's floor and its
    Newton-Schulz FLOPs exactly (the exchange's owners, planned once for all units; torchtitan's EP experts
    orthogonalised where they lie, its FSDP2 rest at owners); no rank moves less than its bound; the model's
    busiest rank by FLOPs is the measured one."""
    rows = _every_rank(model, layout, ranks)
    assert all("error" not in r for r in rows), [r.get("error") for r in rows]
    m = rows[0]["ranks_model"]
    assert all(r["ranks_model"] == m for r in rows)
    # the rounds (the time model's view of the same plan): one all-to-all out and one back per exchanged round,
    # as measured; every rank's pieces and owned matrices split among them without remainder
    exchanged = [rd for rd in m["rounds"] if rd["local"]]
    assert 2 * len(exchanged) == rows[0]["calls"]["alltoall_base_"], (len(exchanged), rows[0]["calls"])
    for r in range(len(rows)):
        assert sum(rd["local"][r] for rd in exchanged) == m["local"][r], r
        assert sum(k * sum(a * b for a, b in rd["matrices"]) for rd in exchanged for q, k in rd["owned"] if q == r) \
            == m["owned"][r], r
    for rd in exchanged:  # by peer: what a rank sends its node's (the other nodes') owners, they receive
        assert sum(rd["near"]) == sum(rd["near_owned"]) and sum(rd["far"]) == sum(rd["far_owned"]), rd
        assert all(a + b <= c for a, b, c in zip(rd["near"], rd["far"], rd["local"], strict=True)), rd
    ranks_model = RankModel(len(rows), 4, m["local"], m["owned"], m["flops"])
    assert sum(m["owned"]) == sum(m["local"])  # every piece goes to exactly one owner
    for r, row in enumerate(rows):
        assert ranks_model.floor(r) == row["floor"], r
        assert row["flops"] == m["flops"][r], (r, row["flops"], m["flops"])
        assert min(row["sent"], row["received"]) >= ranks_model.bound(r), r
    assert max(range(len(rows)), key=lambda r: (rows[r]["flops"], -r)) == ranks_model.busiest()["flops"]
    summary = scale_sim.summarise({"rows": rows, "wall_s": 1.0, "rss": 2**30})
    assert summary["flops_model_exact"] and summary["worst"]["ratio"] >= rows[0]["sent"] / rows[0]["floor"]


def test_torchtitan_ep_keeps_whole_experts_on_every_rank_and_shards_the_rest():
    """torchtitan's EP: the stacked experts ``Shard(0)`` over the "ep" mesh, everything else FSDP2's ``Shard(0)``
    over "dp"; the experts take no part in the exchange (their matrices are whole on each rank), so its floor is
    the rest's, which FSDP2 of the same ranks also has."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        model = scale_sim.build_model("moe-tiny", 2)
        scale_sim.torchtitan_ep(model, init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)),
                                init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
        for name, p in model.named_parameters():
            assert tuple(p.placements) == (Shard(0),), name
            assert p.device_mesh.mesh_dim_names == (("ep",) if p.ndim == 3 else ("dp",)), name
        assert any(p.ndim == 3 for p in model.parameters())
    finally:
        dist.destroy_process_group()
    ep = scale_sim.simulate("moe-tiny", "ep", "4", 1, layers=2, device="meta")
    fsdp2 = scale_sim.simulate("moe-tiny", "fsdp2", "4", 1, layers=2, device="meta")
    assert 0 < ep["floor"] == fsdp2["floor"], (ep["floor"], fsdp2["floor"])
    experts = sum(p.numel() // 4 for p in scale_sim.build_model("moe-tiny", 2).parameters() if p.ndim == 3)
    assert ep["ranks_model"]["local"][1] * 4 * 2 == ep["floor"] and experts > 0


def _owner_peak(placements: tuple, shapes: list[tuple[int, int]], *, foreach: bool = True,
                keep: str | None = None, overlap: bool = False) -> tuple[int, int]:
    """Rank 0 of 4 on the fake group, ``meta``: MeqMuon's step (float32 Newton-Schulz) of one matrix of each of
    ``shapes``, placed by ``placements`` on a 1-D mesh of 4 (FSDP2's ``Shard(0)``) or a 2 x 2 one (FSDP2 over TP,
    ``(Shard(0), Shard(1))``), both through the one exchange, metered at its second step. ``keep``: a negative
    control that keeps references while the step runs: ``"pieces"``, to every piece this rank hands the exchange
    (``Exchange.to_owners``' ``pieces``); ``"wholes"``, to every whole direction input the exchange puts together
    at this owner (what ``to_owners`` returns). Returns the peak and the bytes of what the control kept."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import meqmuon
    from meqmuon.optim import exchange

    kept: list[torch.Tensor] = []

    def keeping(self, indices, pieces, keys, into=None, *, wait=True):
        if keep == "pieces":
            kept.extend(p for ps in pieces for p in ps)
        wholes = to_owners(self, indices, pieces, keys, into, wait=True)
        if keep == "wholes":
            kept.extend(ws[0] for ws in wholes if ws is not None)
        return wholes if wait else exchange.InFlight(None, lambda: wholes)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mp = pytest.MonkeyPatch()
    try:
        if keep is not None:
            to_owners = exchange.Exchange.to_owners
            mp.setattr(exchange.Exchange, "to_owners", keeping)
        mesh = init_device_mesh("cpu", (4,) if len(placements) == 1 else (2, 2))
        params = []
        for m, n in shapes:
            local = (m // 4, n) if len(placements) == 1 else (m // 2, n // 2)
            params.append(torch.nn.Parameter(DTensor.from_local(torch.empty(local, device="meta"), mesh, placements,
                                                                run_check=False, shape=(m, n), stride=(n, 1))))
            params[-1].grad = torch.zeros_like(params[-1])
        groups = [{"params": params, "kind": "hidden", "names": [f"w{i}" for i in range(len(params))]}]
        opt = meqmuon.build_optimizer("meqmuon", groups, ns_dtype=torch.float32, foreach=foreach, overlap=overlap)
        opt.step()
        kept.clear()
        meter = StepMeter()
        with meter:
            opt.step()
        held = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in kept}.values())
        kept.clear()
        return meter.peak, held
    finally:
        mp.undo()
        dist.destroy_process_group()


def test_pieces_handed_to_the_exchange_go_before_the_step_peaks():
    """At an owner (rank 0 of 4, one 64 x 48 matrix of four, MeqMuon batched), this rank's pieces of the
    direction inputs it hands the exchange (four 16 x 48 float32 rows of FSDP2's ``Shard(0)``, four 32 x 24
    pieces of ``(Shard(0), Shard(1))``) are let go once in the send buffer, and the send buffer once sent: neither
    is alive at the step's transient peak (the owner's Newton-Schulz or its way back). A control that keeps the
    pieces alive raises the metered peak by exactly their bytes, so the simulator's peak sees them go."""
    from torch.distributed.tensor import Shard

    for placements in ((Shard(0),), (Shard(0), Shard(1))):
        released, _ = _owner_peak(placements, [(64, 48)] * 4)
        kept, pieces = _owner_peak(placements, [(64, 48)] * 4, keep="pieces")
        assert pieces == 4 * (64 * 48 // 4) * 4, (placements, pieces)
        assert kept - released == pieces, (placements, kept, released, pieces)


@pytest.mark.parametrize("foreach", [True, False], ids=["batched", "per-tensor"])
def test_an_owner_holds_its_whole_matrix_once_and_no_earlier_bucket(foreach):
    """An owner's transient peak is Newton-Schulz of the whole matrices it owns, held once, and nothing of a
    bucket it is done with. Rank 0 of 4 owns the 64 x 48 matrix (the first shape bucket; longest first, ties to
    the lowest rank) and one of four 64 x 64 ones (the second), FSDP2's ``Shard(0)`` and FSDP2 over TP's
    ``(Shard(0), Shard(1))``, both forms. The bound is what the row path and the owner path of 497228e met at
    these shapes (68,664 B and 69,696 B, both forms): Newton-Schulz of the received 64 x 64 matrix iterated in
    its own buffer (it, the result, two 64 x 64 Gram buffers: 4 x 16 KiB), beside it one rank's piece of such a
    matrix (64 x 64 / 4 float32: a direction of the earlier bucket waiting for the update, or this rank's input
    piece), and the per-matrix counters and norms (128 B). A second copy of the received matrix (a stack of it
    beside it, or Newton-Schulz copying it), or the earlier bucket's whole matrix or stack kept to the step's end,
    is 12-16 KiB more."""
    from torch.distributed.tensor import Shard

    m = n = 64
    bound = 4 * (2 * m * n + 2 * n * n) + 4 * (m * n // 4) + 128
    for placements in ((Shard(0),), (Shard(0), Shard(1))):
        peak, _ = _owner_peak(placements, [(64, 48)] + [(m, n)] * 4, foreach=foreach)
        assert peak <= bound, (placements, peak, bound)


@pytest.mark.parametrize("foreach", [True, False], ids=["batched", "per-tensor"])
def test_overlap_holds_at_most_two_buckets(foreach):
    """With ``overlap=True`` the next bucket's whole matrix is received while this one's Newton-Schulz runs, so an
    owner holds two buckets' matrices where it held one: the peak grows (the pipeline is real) by no more than one
    more bucket's whole matrices and its way in (the 64 x 64 matrix, its received bytes, this rank's piece), within
    twice the one-bucket bound of the test above; rank 0 of 4 owns one 64 x 48 and one 64 x 64 matrix, FSDP2's
    ``Shard(0)`` and FSDP2 over TP's ``(Shard(0), Shard(1))``."""
    from torch.distributed.tensor import Shard

    m = n = 64
    bound = 4 * (2 * m * n + 2 * n * n) + 4 * (m * n // 4) + 128
    for placements in ((Shard(0),), (Shard(0), Shard(1))):
        shapes = [(64, 48)] + [(m, n)] * 4
        serial, _ = _owner_peak(placements, shapes, foreach=foreach)
        piped, _ = _owner_peak(placements, shapes, foreach=foreach, overlap=True)
        assert serial < piped <= serial + 4 * (2 * m * n + m * n // 4) and piped <= 2 * bound, (serial, piped, bound)
        # overlap="all" holds every bucket: here the two, as overlap=True does
        assert _owner_peak(placements, shapes, foreach=foreach, overlap="all")[0] == piped


def test_an_owner_lets_its_received_matrix_go_before_post():
    """At an owner, the whole direction input the exchange put together is spent once Newton-Schulz has read
    it: it is let go before ``post`` (eq. 8) and the way back. With one wide 8 x 512 matrix (small Gram buffers:
    ``post`` and the way back make the peak), FSDP2's ``Shard(0)`` and FSDP2 over TP's ``(Shard(0), Shard(1))``, the
    control that keeps it alive raises the metered peak by more than half of its 8 x 512 x 4 B and at most all of it
    (not all: since the step writes last, its peak without the control is at Newton-Schulz, where the matrix is
    still read, a few KB above the peak after it)."""
    from torch.distributed.tensor import Shard

    for placements in ((Shard(0),), (Shard(0), Shard(1))):
        released, _ = _owner_peak(placements, [(8, 512)])
        kept, whole = _owner_peak(placements, [(8, 512)], keep="wholes")
        assert whole == 8 * 512 * 4, (placements, whole)
        assert whole // 2 < kept - released <= whole, (placements, kept, released, whole)


def test_meter_counts_the_ops_that_launch_and_the_bytes_memory_bound_ops_move():
    """``StepMeter.ops`` and ``.traffic`` follow ``op_count.TrafficCounter``'s rule (``op_traffic``): a float32
    ``add`` of 100 elements reads 800 B and writes 400 B, an in-place ``mul_`` reads its two operands and
    writes its first, a matmul moves no counted bytes (its FLOPs are counted), a view launches nothing."""
    import op_count

    def work():
        a, b = torch.ones(100), torch.ones(100)
        c = a + b  # 1,200 B
        c.mul_(b)  # 1,200 B
        d = torch.ones(4, 5) @ torch.ones(5, 6)  # FLOPs only
        return c.view(10, 10), d  # a view: no kernel

    with StepMeter() as meter:
        work()
    with op_count.TrafficCounter() as counted:
        work()
    assert meter.traffic == counted.total_bytes == 2 * 1200 + 4 * 100 * 2 + 4 * (20 + 30)  # and the ones' writes
    assert meter.ops == counted.total == 7  # 4 ones, add, mul_, mm
    assert meter.flops == 2 * 4 * 5 * 6


def _hardware(ranks_per_node: int, latency: float = 0.0) -> time_model.Hardware:
    link = time_model.Link(100e9, latency)
    return time_model.Hardware("test", hbm=1e12, peak={"bfloat16": 1e15, "float32": 1e14},
                               nvlink=time_model.Link(400e9, latency), network=link,
                               ranks_per_node=ranks_per_node, base_latency=latency, hbm_efficiency=1.0)


def test_exchange_time_is_each_rounds_busiest_rank_over_the_bandwidth_of_the_link_it_crosses():
    """Muon (float32 Newton-Schulz: it moves exactly the plan's bytes) on Llama-tiny under FSDP2 on 16 ranks,
    two layers: four rounds (q/o 64 x 64, k/v 32 x 64, gate/up 128 x 64, down 64 x 128), each with owners of one
    whole matrix, who move the most: 4 B x m x n each way, of which 1 / 16 is their own piece. One rank a node:
    all 15 / 16 over the network; eight a node: 7 / 16 over NVLink and 8 / 16 over the network at once, the
    slower sets the time; latencies add once per collective."""
    row = scale_sim.simulate("llama-tiny", "fsdp2", "16", 0, layers=2, device="meta", optimizer="muon")
    summary = scale_sim.summarise({"rows": [row], "wall_s": 1.0, "rss": 1}, 4)
    cal = time_model.Calibration("test", rate_fraction=0.5)
    largest = 4 * (64 * 64 + 32 * 64 + 128 * 64 + 64 * 128)  # bytes each round's owner moves, summed
    alone = time_model.step_times(summary, _hardware(1), cal)
    # Muon at its bound, measured (rank 0 sends 7 B more than its 51,200: the all-to-all's byte of each round and
    # the skip flag's 4 B all-reduce, issue 56)
    assert alone.factor == pytest.approx(1.0, abs=2e-4)
    f = alone.factor
    assert alone.exchange == pytest.approx(2 * f * largest * 15 / 16 / 100e9, rel=1e-12)
    nodes = time_model.step_times(summary, _hardware(8), cal)
    assert nodes.exchange == pytest.approx(2 * f * largest * max(7 / 16 / 400e9, 8 / 16 / 100e9), rel=1e-12)
    latent = time_model.step_times(summary, _hardware(8, latency=1e-6), cal)
    assert latent.exchange == pytest.approx(nodes.exchange + 8 * 2e-6, rel=1e-12)  # 8 collectives
    # twice the bytes, twice the time (bandwidth-bound)
    assert time_model.exchange_seconds(2e6, 16, _hardware(8)) == 2 * time_model.exchange_seconds(1e6, 16, _hardware(8))
    # Newton-Schulz: each round's owner at the calibrated time of its matrix, one after the other today
    ns = [time_model.ns_flops(m, n) / (0.5 * 1e14) for m, n in ((64, 64), (32, 64), (128, 64), (64, 128))]
    assert alone.ns_serial == pytest.approx(sum(ns), rel=1e-12)
    assert alone.serial >= alone.exchange + alone.ns_serial >= alone.overlapped
    # the host's floor: the rank's kernels (StepMeter.ops) at the launch cost each
    assert alone.kernels == row["ops"] > 0 and alone.host == pytest.approx(row["ops"] * 5e-6, rel=1e-12)


def test_overlap_never_exceeds_the_serial_step_and_is_the_compute_where_it_dominates():
    """``time_model.pipeline``: the two-bucket pipeline and every round in flight (``overlap="all"``) are never
    slower than the serial rounds and never faster than either side's sum (one in flight: the serial rounds); with
    nothing to exchange both are the compute; where every round's compute is at least both its ways' exchange it
    hides all but the first way out and the last way back."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        rounds, ranks = rng.randint(1, 6), rng.randint(1, 5)
        out = [rng.random() for _ in range(rounds)]
        back = [rng.random() for _ in range(rounds)]
        compute = [[rng.random() for _ in range(ranks)] for _ in range(rounds)]
        serial = time_model.pipeline(out, compute, back, overlap=False)
        overlapped = time_model.pipeline(out, compute, back, overlap=True)
        busiest = max(sum(c[r] for c in compute) for r in range(ranks))
        assert max(busiest, sum(out) + sum(back)) - 1e-12 <= overlapped <= serial + 1e-12
        in_flight = time_model.pipeline(out, compute, back, overlap=rounds)  # overlap="all"
        assert max(busiest, sum(out) + sum(back)) - 1e-12 <= in_flight <= serial + 1e-12
        assert time_model.pipeline(out, compute, back, overlap=2) == overlapped
        assert abs(time_model.pipeline(out, compute, back, overlap=1) - serial) < 1e-12
    # rounds owned by different ranks in turn: two in flight make rank 1 wait for round 0's way back before its
    # own round 1's inputs can follow; with every round in flight each rank runs its own rounds back to back
    turns = [[4.0, 0.0], [0.0, 4.0], [4.0, 0.0], [0.0, 4.0]]
    assert time_model.pipeline([1.0] * 4, turns, [1.0] * 4, overlap=False) == 24.0
    assert time_model.pipeline([1.0] * 4, turns, [1.0] * 4, overlap=True) == 14.0
    assert time_model.pipeline([1.0] * 4, turns, [1.0] * 4, overlap=4) == 11.0
    compute = [[3.0, 1.0]] * 4
    assert time_model.pipeline([0.0] * 4, compute, [0.0] * 4, overlap=True) == \
        time_model.pipeline([0.0] * 4, compute, [0.0] * 4, overlap=False) == 12.0
    e = 1.5  # every round's 3.0 of compute >= 2e: the exchange hides behind it but the pipeline's ends
    assert time_model.pipeline([e] * 4, compute, [e] * 4, overlap=True) == e + 12.0 + e
    assert time_model.pipeline([e] * 4, compute, [e] * 4, overlap=False) == 4 * (2 * e + 3.0)


def test_calibration_table_is_read_and_shapes_outside_it_are_extrapolated_and_said_so(tmp_path):
    """A table written by ``benchmarks/ns_calibrate.py`` (CPU, two tiny shapes) is read back; a shape in it
    gets its measured time, in either orientation; one outside it the rate of the entry nearest in FLOPs,
    "extrapolated"; a dtype without entries the nearest entry's rate scaled by the peaks; a table with a
    fraction of the peak for what it lacks, that."""
    import ns_calibrate

    path = tmp_path / "cal.json"
    ns_calibrate.main(["--shapes", "8x16,32x32", "--dtypes", "float32", "--device", "cpu", "--repeats", "1",
                       "--stack-flop", "1e6", "--out", str(path)])
    cal = time_model.Calibration.load(path)
    hw = _hardware(8)
    assert {(e["m"], e["n"], e["dtype"]) for e in cal.entries} == {(8, 16, "float32"), (32, 32, "float32")}
    small = next(e for e in cal.entries if e["m"] == 8)
    assert cal.seconds(16, 8, "float32", hw) == (small["seconds"], "measured")
    rate = time_model.ns_flops(32, 32) / next(e for e in cal.entries if e["m"] == 32)["seconds"]
    seconds, how = cal.seconds(64, 64, "float32", hw)  # nearest in FLOPs: 32 x 32
    assert how == "extrapolated" and seconds == pytest.approx(time_model.ns_flops(64, 64) / rate, rel=1e-12)
    seconds, how = cal.seconds(64, 64, "bfloat16", hw)  # no bf16 entries: float32's rate, times 1e15 / 1e14
    assert how == "extrapolated" and seconds == pytest.approx(time_model.ns_flops(64, 64) / (10 * rate), rel=1e-9)
    cal.rate_fraction = 0.5
    assert cal.seconds(64, 64, "bfloat16", hw)[0] == time_model.ns_flops(64, 64) / 0.5e15
    assert cal.seconds(8, 16, "float32", hw) == (small["seconds"], "measured")  # the table still first
    shipped = time_model.Calibration.load(time_model.DEFAULT_CALIBRATION)
    assert shipped.seconds(1024, 2736, "bfloat16", time_model.H100)[1] == "derived"
    assert shipped.seconds(16384, 53248, "bfloat16", time_model.H100)[1] == "extrapolated"


@pytest.mark.parametrize("optimizer,form", [("muon", "batched"), ("meqmuon", "per-tensor")])
def test_a_rank_that_holds_no_expert_steps(optimizer, form):
    """FSDP2 on more ranks than experts, dimension 0 (``fsdp2-rows``: ``moe-tiny``'s 8 routed experts, ``Shard(0)``
    over 64 ranks, where torchtitan would take dimension 1): the last rank
    holds none of them, so its ``LOCAL`` call of the experts has no matrices. It joins no collective, so the rank
    skips it and steps the rest (it raised ``Tensor list must have at least one tensor`` in the momentum's
    ``_foreach_mul_`` before; DeepSeek-V3 on 1,024 ranks the same)."""
    row = scale_sim.simulate("moe-tiny", "fsdp2-rows", "64", 63, layers=None, device="meta", optimizer=optimizer,
                             ns_dtype=torch.float32, foreach=form == "batched")
    assert "error" not in row, row["error"]
    assert row["sent"] > 0 and row["held"]["state"] > 0, {k: row[k] for k in ("sent", "held")}


def test_fsdp2_puts_experts_on_dimension_1_where_ranks_outnumber_them():
    """torchtitan's rule (``meqmuon.train.parallel.expert_placement``): a stack of ``E`` experts shards on dimension 1
    over more than ``E`` ranks, so every rank holds a piece of every expert and sends it to its owner; on dimension 0
    (``fsdp2-rows``) rank 63 of 64 holds no expert of ``moe-tiny``'s 8 and sends only its other pieces."""
    from torch.distributed.tensor import Shard

    from meqmuon.train.parallel import expert_placement

    stack, matrix = torch.nn.Parameter(torch.empty(8, 4, 6)), torch.nn.Parameter(torch.empty(4, 6))
    assert expert_placement(16)(stack) == Shard(1) and expert_placement(8)(stack) is None
    assert expert_placement(16)(matrix) is None
    sent = {layout: scale_sim.simulate("moe-tiny", layout, "64", 63, layers=None, device="meta", optimizer="muon",
                                       ns_dtype=torch.float32)["sent"] for layout in ("fsdp2", "fsdp2-rows")}
    experts = sum(p.numel() // 64 * 4 for p in scale_sim.build_model("moe-tiny", None).parameters() if p.ndim == 3)
    assert sent["fsdp2"] - sent["fsdp2-rows"] >= experts, (sent, experts)


def _best_plan(units: list[tuple[tuple[int, float], ...]], world: int) -> float:
    """The least busiest rank of any plan of the form: each unit whole on one rank or shared by an aligned block of
    ``z`` ranks, each member ``t_z``, found by trying every plan."""
    import itertools

    choices = [[(z, t, start) for z, t in ways for start in range(0, world, z)] for ways in units]
    best = float("inf")
    for plan in itertools.product(*choices):
        load = [0.0] * world
        for z, t, start in plan:
            for r in range(start, start + z):
                load[r] += t
        best = min(best, max(load))
    return best


def test_the_form_bound_counts_how_units_pack_and_no_plan_goes_below_it():
    """``time_model.form_bound``: never above the best plan of the form (every plan tried, on 4 ranks), never below
    the fluid bound (every rank-second used, ``sum_u min z t_z <= W T``), and above it where units pack badly: 70B
    on 1,024 ranks in small, two MLP matrices (shared by 4: 23.68 ms a member, by 8: 16.10) and a q matrix (by 2:
    17.29, by 4: 12.20, by 8: 9.89) on 8 ranks. Beside a 4-share of an MLP matrix only the q matrix's 8-share fits,
    so the best plan is 23.68 + 9.89 ms, where the fluid bound says 28.0 ms."""
    import random

    def rounds(units):
        return [time_model.Round((1, 1), [], [], [], [], 0.0, 0.0, "measured", None, ways, 1) for ways in units]

    def fluid(units, world):
        t = max(min(s for _, s in w) for w in units)
        while sum(min(z * s for z, s in w if s <= t) for w in units) > world * t:
            t *= 1.0001
        return t

    mlp, q = ((4, 23.68), (8, 16.10)), ((2, 17.29), (4, 12.20), (8, 9.89))
    bound = time_model.form_bound(rounds([mlp, mlp, q]), 8)
    assert bound == pytest.approx(_best_plan([mlp, mlp, q], 8)) == pytest.approx(23.68 + 9.89)
    assert fluid([mlp, mlp, q], 8) == pytest.approx((2 * 4 * 23.68 + 2 * 17.29) / 8, rel=2e-4)
    rng, above = random.Random(0), 0
    for _ in range(60):
        units = []
        for _ in range(rng.randint(2, 4)):
            whole = rng.uniform(1.0, 4.0)
            units.append(((1, whole), (2, whole * rng.uniform(0.5, 0.8)), (4, whole * rng.uniform(0.25, 0.6))))
        bound, best = time_model.form_bound(rounds(units), 4), _best_plan(units, 4)
        assert fluid(units, 4) * (1 - 2e-4) <= bound <= best * (1 + 1e-9)
        above += bound > fluid(units, 4) * 1.01
    assert above  # the packing counted somewhere


def test_a_tp_pair_shares_the_experts_it_holds_alike_and_the_models_count_each_members_part(tmp_path):
    """DeepSeek-V3 in small under FSDP2 over the Llama TP plan (``fsdp2xtp-dense``) on 2 x 2 fake ranks with
    ``ns_group=2``: the experts FSDP2 shards on ``dp`` only, repeated over ``tp``, are whole local matrices each TP
    pair holds alike, which the pair shares (``shared_ns.ReplicaShare``). A pair's two ranks simulated, each in a
    process of its own: the rank model's FLOPs are their measured ones, its round of local matrices (the batched
    form's one bucket) gives each member half and the bytes it gathers of its partner's half in rounds, and the
    time model prices each round's gather over NVLink behind the next round's Newton-Schulz."""
    import json

    from meqmuon.optim.shared_ns import ReplicaShare

    path = tmp_path / "moe.json"
    scale_sim.main(["--model", "moe-tiny", "--layout", "fsdp2xtp-dense", "--ranks", "2x2", "--sample-ranks", "0,1",
                    "--ns-group", "2", "--layers", "2", "--save", str(path)])
    summary = json.loads(path.read_text())[0]
    assert summary["flops_model_exact"] and summary["sampled"] == [0, 1]
    inputs = summary["time_inputs"]
    local = [rd for rd in inputs["rounds"] if not rd["local"]]
    assert local and all(rd["replicas"] == 2 for rd in local)
    cal = time_model.Calibration("test", rate_fraction=0.5)
    hw = _hardware(8, latency=1e-6)
    rounds, _ = time_model.rounds_of(inputs, 4, cal, hw)
    for rd in local:  # one bucket: the (64, 32) matrices join the (32, 64) ones, as the batched form stacks them
        owned, (m, n) = dict(rd["owned"]), rd["shape"]
        assert sorted(owned) == [0, 1, 2, 3] and len(set(owned.values())) == 1  # half of each pair's stack each
        gathers, s = ReplicaShare.rows(2 * owned[0], 2)
        assert rd["gather_rounds"] == gathers > 1
        assert rd["gathered"] == [gathers * s * m * n * 4] * 4  # the partner's rows, float32, in gathers rounds
        got = next(r for r in rounds if list(r.shape) == rd["shape"] and not any(r.out))
        whole = owned[0] * cal.seconds(m, n, "float32", hw)[0]
        # each round's gather travelling while the next round computes (a flow shop of equal rounds)
        c = whole / gathers
        h = hw.base_latency + hw.nvlink.latency + s * m * n * 4 / hw.nvlink.bandwidth
        assert got.ns == pytest.approx([c + (gathers - 1) * max(c, h) + h] * 4)


def test_torchtitans_experts_under_tp_travel_each_to_an_owner_in_its_tp_group(tmp_path):
    """DeepSeek-V3 in small under FSDP2 over torchtitan's TP plan (``comm_bytes.deepseek_tp_plan``) on 2 x 2 fake
    ranks: each stack of experts is ``(Shard(0), Shard(1 or 2))``, a dp half's experts split over its TP pair. Each
    expert is an exchange unit of its own (``placement.by_matrix``; the pieces of the ranks that do not hold it
    empty) owned by a rank of that pair (``shared_ns.assign_within``), so no stack travels whole (it did: rank 0
    1.22x its floor, a transient peak of 0.6 MiB against 0.2), every rank moves within 1 % of its reachable bound, and
    the rank model still gives the simulated ranks' FLOPs exactly and counts the experts' bytes as its node's."""
    import json

    path = tmp_path / "ttp.json"
    scale_sim.main(["--model", "moe-tiny", "--layout", "fsdp2xtp", "--ranks", "2x2", "--sample-ranks", "0,2",
                    "--layers", "2", "--save", str(path)])
    summary = json.loads(path.read_text())[0]
    assert summary["flops_model_exact"] and summary["sampled"] == [0, 2]
    # within 1 % of the reachable bound (the per-matrix choices come back whole), 8 % of the floor (an owner's whole)
    assert summary["over_bound"] < 1.01 and summary["worst"]["ratio"] < 1.1, (summary["over_bound"], summary["worst"])
    rounds = [rd for rd in summary["time_inputs"]["rounds"] if rd["local"]]
    # a unit is one matrix, or gate_up's two halves (32 x 64 each): no stack of 8 experts travels whole
    assert all(len(rd["matrices"]) <= 2 for rd in rounds), rounds
    assert all(rd["node"] == 8 and not any(rd["far"]) for rd in rounds)  # 4 ranks: one node of 8
