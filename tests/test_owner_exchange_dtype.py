"""The exchange's way back in the Newton-Schulz dtype under tensor parallelism (``optim/exchange.py``,
``transfer.py``; issues 47 and 55).

On 2 gloo ranks, the tiny Llama under torchtitan's TP plan (``parallelize_module``: colwise q/k/v/gate/up
``Shard(0)``, rowwise o/down ``Shard(1)``, a vocabulary-parallel embedding and head), every hidden matrix, colwise
and rowwise, goes through the one exchange: each rank's piece of ``X`` out to the matrix's owner, the piece of its
direction back. The exchange is metered apart (``exchange.exchange_flat`` wrapped while the step runs, inside
``benchmarks/step_accounting.py``'s ``StepMeter`` of the whole step), and its bytes are exactly what the pieces'
shapes (read off the placements, ``owners.Pieces``) and the owners give:

- Muon's direction is Newton-Schulz's output itself (``transfer.IDENTITY``): with bf16 Newton-Schulz the owner
  sends each rank its piece of ``U`` in bf16 (widening bf16 to float32 is exact). The update equals one
  process's with the same bf16 Newton-Schulz bit for bit after several steps, and equals the float32 way
  back's (the control: the rule's ``transfer_form`` set to ``transfer.DIRECTION``), bit for bit; each rank
  moves ``2 B x (local + owned)`` elements each way, over both ranks exactly the floor ``2 x 2 B x local``; the
  control moves 1.5x the floor. Nothing else of Muon's step moves a byte (AdamW's embedding and head, the
  norms: in place). MuonEq's ``pre`` computes in float32, so its ``X`` goes out in float32, its ``U`` back in
  bf16.
- MeqMuon's direction is eq. 8's ``(U * row) * col``: the owner sends each rank its piece of ``U`` in bf16 with
  the row factors of its rows and the column factors of its columns (float32), from which the rank makes its
  ``D``, where those are fewer bytes than a float32 ``D`` (every piece here). Its hidden matrices equal one
  process bit for bit, every parameter equals the float32 ``D`` way back's (the control), whose bytes are
  more; the per-matrix counter ``rows_chosen`` comes back whole (int64) and counts as one process counts.
  NorMuon's row divisors and restoring scale the same way, its per-row second moment out and back as its
  piece where it is sharded with the rows (colwise), whole back where it is not (rowwise).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import zoo
from test_distributed import _spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_accounting import StepMeter, floor_bytes  # noqa: E402

import meqmuon  # noqa: E402
from meqmuon.optim import transfer  # noqa: E402
from meqmuon.optim.distributed import is_dtensor  # noqa: E402
from meqmuon.train.parallel import tp_plan  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

STEPS = 3
#: zoo.llama's hidden matrices: 2 layers of q, k, v, o, gate, up, down.
HIDDEN = 14


def _batch(step: int) -> dict:
    ids = torch.randint(0, zoo.VOCAB, zoo.TOKENS, generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids}


def _run(mesh, name: str, direction_back: bool = False) -> dict:
    """Optimizer ``name`` with bf16 Newton-Schulz under TP against one process fed the same gradients; the last
    step metered, and the exchange apart. ``direction_back``: the control, the optimizer's hidden rule sending
    ``D`` at the parameters' dtype (``transfer.DIRECTION``) instead of ``U`` (with factors)."""
    from meqmuon.optim import exchange

    model, _ = zoo.llama()
    ref = copy.deepcopy(model)
    tp_plan(model, mesh)
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
    opt, ref_opt = meqmuon.build_optimizer(name, model, **kw), meqmuon.build_optimizer(name, ref, **kw)
    rule = opt._rules["hidden"]
    meter, ex_meter, real = StepMeter(), StepMeter(), exchange.exchange_flat

    def metered(*args, **kwargs):
        with ex_meter:
            return real(*args, **kwargs)

    if direction_back:
        rule.transfer_form = transfer.DIRECTION  # an instance attribute over the class's
    try:
        for step in range(STEPS):
            model(**_batch(step)).loss.backward()
            grads = {n: (p.grad.full_tensor() if is_dtensor(p.grad) else p.grad) for n, p in model.named_parameters()}
            for n, p in ref.named_parameters():
                p.grad = grads[n].clone()
            if step == STEPS - 1:  # the whole step metered, and apart the exchange's collectives
                exchange.exchange_flat = metered
                with meter:
                    opt.step()
                exchange.exchange_flat = real
            else:
                opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    finally:
        exchange.exchange_flat = real
        if direction_back:
            del rule.transfer_form
    full = {n: (p.full_tensor() if is_dtensor(p) else p).detach().clone() for n, p in model.named_parameters()}
    unequal = [n for n, q in ref.named_parameters() if not torch.equal(full[n], q.detach())]
    ex = opt._exchange
    names = {id(p): n for n, p in model.named_parameters()}
    units = []
    for _, entries, _ in opt._plan():
        for e in entries:
            for i in e.units:
                u = ex.units[i]
                assert u.pieces.local_shape(ex.rank) == tuple(e.param.to_local().shape)  # torch's split
                units.append({"name": names[id(e.param)], "shape": tuple(u.pieces.shape), "owner": u.owner,
                              "local": [u.pieces.local_shape(r) for r in range(ex.world)],
                              "sharded": sorted(u.state_pieces)})
    return {"unequal": unequal, "params": full, "step": meter.summary(), "exchange": ex_meter.summary(),
            "units": units, "floor": floor_bytes(opt, 2), "dtensors": sum(is_dtensor(p) for p in model.parameters()),
            "counts": (opt.selection_counts(), ref_opt.selection_counts()) if name == "meqmuon" else None}


def _bytes(r: dict, rank: int, out, back) -> tuple[int, int]:
    """What ``rank`` sends and receives in the exchange: ``out(u, q)`` the bytes rank ``q`` sends of unit ``u`` to
    its owner, ``back(u, q)`` those the owner sends rank ``q``; every rank sends every unit's piece (its own
    owner's included: the all_to_all carries it) and each owner every rank its piece of the result."""
    world = len(r["units"][0]["local"])
    sent = sum(out(u, rank) for u in r["units"]) + \
        sum(back(u, q) for u in r["units"] if u["owner"] == rank for q in range(world))
    received = sum(back(u, rank) for u in r["units"]) + \
        sum(out(u, q) for u in r["units"] if u["owner"] == rank for q in range(world))
    return sent, received


def _elements(u: dict, q: int) -> int:
    m, n = u["local"][q]
    return m * n


def _worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return {"bf16": _run(mesh, "muon"), "float32": _run(mesh, "muon", direction_back=True),
            "muoneq": _run(mesh, "muoneq-r")}


def _meq_worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return {"factors": _run(mesh, "meqmuon"), "direction": _run(mesh, "meqmuon", direction_back=True),
            "normuon": _run(mesh, "normuon"), "normuon_direction": _run(mesh, "normuon", direction_back=True)}


def test_eq8_factors_give_the_direction_on_every_piece_of_rows_and_columns():
    """``F.apply_factors`` on any box of a matrix (a TP ``Shard(1)`` piece is a block of columns; FSDP2 over TP's
    a block of rows of a block of columns; ``_StridedShard`` pieces are runs of rows) with the factors of the
    rows and columns it covers gives that box of eq. 8's direction, bit for bit, for a bf16 ``U``."""
    from meqmuon import functional as F

    g = torch.Generator().manual_seed(3)
    U = (torch.randn(2, 24, 40, generator=g) * torch.linspace(0.1, 3.0, 40)).to(torch.bfloat16)
    (whole,), _ = F.adaptive_normalize_stacks([U], rho=0.8)
    ((row, col),), _ = F.adaptive_normalize_factors([U], rho=0.8)
    for k in range(2):
        boxes = ((slice(0, 24), slice(20, 40)), (slice(6, 12), slice(0, 20)), ([0, 1, 8, 9, 16], slice(5, 7)))
        for rows, cols in boxes:
            got = F.apply_factors(U[k][rows][:, cols], row[k, :, 0][rows][:, None], col[k, 0][cols][None, :])
            assert torch.equal(got, whole[k][rows][:, cols]), (k, rows, cols)


def test_tp_muon_bf16_directions_come_back_in_bf16_at_the_floor_and_equal_one_process(tmp_path):
    got = _spawn(_worker, tmp_path)
    for rank, r in enumerate(got):
        new, old = r["bf16"], r["float32"]
        assert new["dtensors"] > 10 and len(new["units"]) == HIDDEN, (new["dtensors"], len(new["units"]))
        assert {u["name"].split(".")[-2] for u in new["units"]} == {
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # colwise and rowwise
        assert new["unequal"] == [] and old["unequal"] == [], (rank, new["unequal"], old["unequal"])
        assert all(torch.equal(new["params"][n], p) for n, p in old["params"].items())  # the control's bits
        # this rank's bf16 X pieces out and its owned matrices' bf16 U back (and the reverse): 2 B per element
        local = sum(_elements(u, rank) for u in new["units"])
        owned = sum(u["shape"][0] * u["shape"][1] for u in new["units"] if u["owner"] == rank)
        assert new["floor"] == 2 * 2 * local
        bound = 2 * (local + owned)
        assert new["exchange"]["sent"] == new["exchange"]["received"] == bound, (rank, new["exchange"], bound)
        assert set(new["exchange"]["calls"]) == {"alltoall_base_"}, new["exchange"]["calls"]
        # the float32 way back: 4 B per element of D
        assert (old["exchange"]["sent"], old["exchange"]["received"]) == (2 * local + 4 * owned, 2 * owned + 4 * local)
        # nothing else of Muon's step moves a byte: AdamW's embedding and head and the norms step in place
        assert new["step"]["sent"] == new["exchange"]["sent"] and old["step"]["sent"] == old["exchange"]["sent"]
        assert new["step"]["calls"] == new["exchange"]["calls"], new["step"]["calls"]
        # MuonEq: its pre computes in float32 (X goes out in float32), its direction is Newton-Schulz's (bf16 back)
        eq = r["muoneq"]
        assert eq["unequal"] == [], (rank, eq["unequal"])
        assert eq["exchange"]["sent"] == 4 * local + 2 * owned, (rank, eq["exchange"])
    floor = sum(r["bf16"]["floor"] for r in got)  # the floor: 2 x itemsize(bf16) x local elements
    assert sum(r["bf16"]["exchange"]["sent"] for r in got) == floor
    assert sum(r["bf16"]["exchange"]["received"] for r in got) == floor
    # the negative control: 2 B out and 4 B back per element, 1.5x the floor
    assert sum(r["float32"]["exchange"]["sent"] for r in got) == 3 * floor // 2 > floor


def _pays(m: int, n: int) -> bool:
    """bf16 ``U`` of an ``m x n`` piece with its float32 row and column factors is fewer bytes than float32 ``D``."""
    return 2 * m * n + 4 * (m + n) < 4 * m * n


def _meq_ways(name: str, factored: bool):
    """``(out, back)`` byte counts of one unit and rank for MeqMuon or NorMuon, bf16 Newton-Schulz: bf16 ``X``
    out (NorMuon's second moment beside it where it is sharded with the rows); back bf16 ``U`` with the factors
    of the piece's rows and columns where every piece of the unit's shape pays (``factored``), else float32
    ``D``; then MeqMuon's counter whole (int64), NorMuon's second moment as its piece or whole (float32)."""
    def out(u, q):
        m = u["local"][q][0]
        return 2 * _elements(u, q) + (4 * m if "second_moment" in u["sharded"] else 0)

    def back(u, q):
        m, n = u["local"][q]
        direction = 2 * m * n + 4 * (m + n) if factored else 4 * m * n
        if name == "meqmuon":
            return direction + 8
        return direction + 4 * (m if "second_moment" in u["sharded"] else u["shape"][0])

    return out, back


def test_tp_meqmuon_bf16_eq8_factors_come_back_with_u_and_equal_one_process(tmp_path):
    """MeqMuon, bf16 Newton-Schulz, TP on 2 ranks: its 14 hidden matrices, colwise and rowwise, come back as
    bf16 ``U`` with eq. 8's factors of each piece, equal to one process bit for bit, and every parameter to the
    float32 ``D`` way back's (the control), at exactly the bytes the pieces' shapes give; the control's bytes are
    exactly ``D``'s, more. NorMuon's row divisors and restoring scale the same way."""
    got = _spawn(_meq_worker, tmp_path)
    for name, new_key, old_key in (("meqmuon", "factors", "direction"), ("normuon", "normuon", "normuon_direction")):
        for rank, r in enumerate(got):
            new, old = r[new_key], r[old_key]
            assert len(new["units"]) == HIDDEN
            assert all(_pays(*s) for u in new["units"] for s in u["local"])  # every piece pays here
            hidden = {u["name"] for u in new["units"]}
            # the hidden matrices equal one process bit for bit (the embedding and head, summed over shards for
            # eq. 9 or stepped by AdamW, and the rest: not this exchange's)
            assert not hidden & set(new["unequal"] + old["unequal"]), (name, rank, new["unequal"], old["unequal"])
            assert all(torch.equal(new["params"][n], p) for n, p in old["params"].items())  # the control's bits
            for way, factored in ((new, True), (old, False)):
                expected = _bytes(way, rank, *_meq_ways(name, factored))
                assert (way["exchange"]["sent"], way["exchange"]["received"]) == expected, (name, rank, factored)
                if name == "meqmuon":  # rows_chosen as one process counts it, on every hidden matrix
                    mine, ref = way["counts"]
                    assert mine == ref and hidden <= set(ref), (rank, mine, ref)
            assert new["exchange"]["sent"] < old["exchange"]["sent"], (name, rank)
            rest = [w["step"]["sent"] - w["exchange"]["sent"] for w in (new, old)]
            assert rest[0] == rest[1], rest  # the rest of the step (eq. 9's sums) is not touched
            if name == "meqmuon":
                assert rest[0] > 0  # the vocabulary-parallel embedding and head: eq. 9's sums over shards
        for key in (new_key, old_key):  # what the owners send is what the ranks receive
            assert sum(r[key]["exchange"]["sent"] for r in got) == sum(r[key]["exchange"]["received"] for r in got)
