"""The owner path's way back in the Newton-Schulz dtype (issue 47; ``optim/exchange.py``'s ``returns_orth``).

Muon's direction is Newton-Schulz's output itself (no ``post``), so with bf16 Newton-Schulz the owner sends each
rank its piece of ``D`` in bf16: widening bf16 to float32 is exact, and each rank adds it as one process adds its
bf16 direction (``driver.apply_update``). On 2 gloo ranks, the tiny Llama under torchtitan's TP plan
(``parallelize_module``: colwise q/k/v/gate/up, rowwise o/down, a vocabulary-parallel embedding and head):

- the update equals one process's with the same bf16 Newton-Schulz, bit for bit, after several steps; and equals
  the float32 way back's (the path before this change), bit for bit;
- the owner path's exchanges (here the rowwise ``o_proj`` and ``down_proj``, ``Shard(1)``; the colwise ``Shard(0)``
  weights take the row path, ``ShardedSplit``), metered by ``benchmarks/step_accounting.py``'s ``StepMeter``
  (torch's own c10d ops), carry each rank exactly ``2 B x (local + owned)`` elements each way (the bf16 input
  out, the bf16 direction back), and over both ranks exactly the floor ``2 x 2 B x local elements``; the negative
  control, the float32 way back, moves 1.5x the floor and fails it; the rest of the step moves the same bytes.

MeqMuon's direction is eq. 8's ``(U * row) * col``: on those plain matrices the owner sends each rank its piece of
``U`` in bf16 with the row factors of its rows and the column factors of its columns (float32), from which the
rank makes its ``D`` (``exchange.factors_pay``): the update equals one process's bit for bit, and equals the
float32 ``D`` way back's (the control: the decision patched to no), whose bytes are more; each way's bytes are
exactly what the pieces' shapes give; the per-matrix counter ``rows_chosen`` comes back as one process counts.
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

from step_accounting import StepMeter  # noqa: E402

import meqmuon  # noqa: E402
from meqmuon.optim.distributed import is_dtensor  # noqa: E402
from meqmuon.train.parallel import tp_plan  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

STEPS = 3


def _batch(step: int) -> dict:
    ids = torch.randint(0, zoo.VOCAB, zoo.TOKENS, generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids}


def _run(mesh, name: str, float32_back: bool = False) -> dict:
    """Optimizer ``name`` with bf16 Newton-Schulz under TP against one process fed the same gradients; the last
    step metered. ``float32_back``: the control, ``returns_orth`` and ``factors_pay`` answering no (the way back
    at the parameters' dtype). ``factored``: how many of the step's owner-path jobs took eq. 8's factors."""
    from meqmuon.optim import exchange

    model, _ = zoo.llama()
    ref = copy.deepcopy(model)
    tp_plan(model, mesh)
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
    opt, ref_opt = meqmuon.build_optimizer(name, model, **kw), meqmuon.build_optimizer(name, ref, **kw)
    meter, owner_meter, orth, pay = StepMeter(), StepMeter(), exchange.returns_orth, exchange.factors_pay
    decisions: list[bool] = []

    def factors_pay(plan, job, d_dtype):
        decisions.append(False if float32_back else pay(plan, job, d_dtype))
        return decisions[-1]

    exchange.returns_orth = (lambda rule: False) if float32_back else orth
    exchange.factors_pay = factors_pay
    try:
        for step in range(STEPS):
            model(**_batch(step)).loss.backward()
            grads = {n: (p.grad.full_tensor() if is_dtensor(p.grad) else p.grad) for n, p in model.named_parameters()}
            for n, p in ref.named_parameters():
                p.grad = grads[n].clone()
            if step == STEPS - 1:  # the whole step metered, and apart the owner path's exchanges
                plan = opt._owners
                plan._exchange = _metered(plan._exchange, owner_meter)
                with meter:
                    opt.step()
            else:
                opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    finally:
        exchange.returns_orth, exchange.factors_pay = orth, pay
    full = {n: (p.full_tensor() if is_dtensor(p) else p).detach().clone() for n, p in model.named_parameters()}
    unequal = [n for n, q in ref.named_parameters() if not torch.equal(full[n], q.detach())]
    local = sum(o.param.to_local().numel() for o in plan.owned)
    owned = sum(o.param.numel() for i, o in enumerate(plan.owned) if plan.mine(i))
    return {"unequal": unequal, "params": full, "step": meter.summary(), "owner_path": owner_meter.summary(),
            "local": local, "owned": owned, "on_owner_path": len(plan.owned),
            "owner_names": [n for n, p in model.named_parameters() if any(o.param is p for o in plan.owned)],
            "dtensors": sum(is_dtensor(p) for p in model.parameters()), "factored": sum(decisions[-len(plan.owned):]),
            **({"back": {f: _back_bytes(plan, f) for f in (False, True)},
                "counts": (opt.selection_counts(), ref_opt.selection_counts())} if name == "meqmuon" else {})}


def _back_bytes(plan, factored: bool) -> int:
    """What this rank, as owner, sends back for MeqMuon from the pieces' shapes (``Pieces.local_shape``): per
    matrix it owns and rank ``r`` of its group with a piece of ``m x n``, float32 ``D`` (``4 m n``) or bf16 ``U``
    with ``m`` row and ``n`` column float32 factors (``2 m n + 4 (m + n)``), and the matrix's counter
    ``rows_chosen`` whole (int64, the only per-matrix state of MeqMuon's hidden rule)."""
    total = 0
    for i, o in enumerate(plan.owned):
        if not plan.mine(i):
            continue
        counter = o.state["rows_chosen"]
        counter = counter.to_local() if is_dtensor(counter) else counter
        assert counter.dtype == torch.int64 and counter.numel() == 1
        for r in plan.senders(i):
            m, n = o.pieces.local_shape(r)
            total += (2 * m * n + 4 * (m + n) if factored else 4 * m * n) + 8
    return total


def _metered(exchange, meter: StepMeter):
    """``OwnerPlan._exchange`` with ``meter`` on while it runs (a meter adds up over its entries)."""
    def run(send, sizes):
        with meter:
            return exchange(send, sizes)
    return run


def _worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return {"bf16": _run(mesh, "muon"), "float32": _run(mesh, "muon", float32_back=True),
            "muoneq": _run(mesh, "muoneq-r")}


def _meq_worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return {"factors": _run(mesh, "meqmuon"), "direction": _run(mesh, "meqmuon", float32_back=True),
            "normuon": _run(mesh, "normuon"), "normuon_direction": _run(mesh, "normuon", float32_back=True)}


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


def test_returns_orth_is_the_rules_whose_direction_is_newton_schulzs_output():
    """Muon (Moonlight's), MuonEq and Aurora keep the identity ``post``; every rule with a ``post`` or a
    ``post_all`` of its own (MeqMuon's eq. 8, NorMuon, Muon+, MeqShape, a user's variant) does not."""
    from meqmuon.optim.exchange import returns_orth
    from meqmuon.optim.rules import RULES

    assert {n for n, r in RULES.items() if returns_orth(r)} == {"moonlight_hidden", "muoneq_hidden", "aurora_hidden"}

    class PostAll(meqmuon.HiddenRule):
        name = "post_all_only"

        def post_all(self, Us, group, states):
            return [U * 2 for U in Us]

    class Pre(meqmuon.HiddenRule):
        name = "pre_only"

        def pre(self, X, group, state=None):
            return X * 2

    assert not returns_orth(PostAll()) and returns_orth(Pre())


def test_tp_muon_bf16_directions_come_back_in_bf16_at_the_floor_and_equal_one_process(tmp_path):
    got = _spawn(_worker, tmp_path)
    for rank, r in enumerate(got):
        new, old = r["bf16"], r["float32"]
        assert new["dtensors"] > 10 and new["on_owner_path"] == 4, (new["dtensors"], new["on_owner_path"])
        assert new["unequal"] == [] and old["unequal"] == [], (rank, new["unequal"], old["unequal"])
        assert all(torch.equal(new["params"][n], p) for n, p in old["params"].items())  # today's bits
        # this rank's bf16 X pieces out and its owned matrices' bf16 D back (and the reverse): 2 B per element
        bound = 2 * (new["local"] + new["owned"])
        assert new["owner_path"]["sent"] == new["owner_path"]["received"] == bound, (rank, new["owner_path"], bound)
        assert set(new["owner_path"]["calls"]) == {"alltoall_base_"}, new["owner_path"]["calls"]
        # the float32 way back: 4 B per element of D
        assert old["owner_path"]["sent"] == 2 * old["local"] + 4 * old["owned"], (rank, old["owner_path"])
        # the rest of the step (the row path's exchange) is not touched
        rest = [r["step"]["sent"] - r["owner_path"]["sent"] for r in (new, old)]
        assert rest[0] == rest[1] > 0, rest
        # MuonEq: its pre computes in float32 (X goes out in float32), its direction is Newton-Schulz's (bf16 back)
        eq = r["muoneq"]
        assert eq["unequal"] == [], (rank, eq["unequal"])
        assert eq["owner_path"]["sent"] == 4 * eq["local"] + 2 * eq["owned"], (rank, eq["owner_path"])
    floor = sum(2 * 2 * r["bf16"]["local"] for r in got)  # the floor: 2 x itemsize(bf16) x local elements
    assert sum(r["bf16"]["owner_path"]["sent"] for r in got) == floor
    assert sum(r["bf16"]["owner_path"]["received"] for r in got) == floor
    # the negative control: 2 B out and 4 B back per element, 1.5x the floor
    assert sum(r["float32"]["owner_path"]["sent"] for r in got) == 3 * floor // 2 > floor


def test_tp_meqmuon_bf16_eq8_factors_come_back_with_u_and_equal_one_process(tmp_path):
    """MeqMuon, bf16 Newton-Schulz, TP on 2 ranks: its 4 owner-path matrices (rowwise, ``Shard(1)``) come back
    as bf16 ``U`` with eq. 8's factors of each piece, equal to one process bit for bit, and every parameter to
    the float32 ``D`` way back's (the control), at exactly the bytes the pieces' shapes give; the control's
    bytes are exactly ``D``'s, more. NorMuon's row divisors and restoring scale the same way."""
    got = _spawn(_meq_worker, tmp_path)
    for rank, r in enumerate(got):
        new, old = r["factors"], r["direction"]
        assert new["on_owner_path"] == new["factored"] == 4 and old["factored"] == 0, (new["factored"], old["factored"])
        owner_names = new["owner_names"]
        assert len(owner_names) == 4 and all(n.endswith(("o_proj.weight", "down_proj.weight")) for n in owner_names)
        # the owner path's matrices equal one process bit for bit (the rest of the step, the row path and the
        # embeddings, is not this path's: with bf16 Newton-Schulz it is not bit for bit one process's)
        assert not set(owner_names) & set(new["unequal"] + old["unequal"]), (rank, new["unequal"], old["unequal"])
        assert all(torch.equal(new["params"][n], p) for n, p in old["params"].items())  # today's bits, everywhere
        for way in (new, old):  # rows_chosen as one process counts it, on the owner path's matrices too
            mine, ref = way["counts"]
            assert mine == ref and set(owner_names) <= set(ref), (rank, mine, ref)
        # bf16 X pieces out, then the way back: exactly the pieces' shapes' bytes (_back_bytes)
        assert new["owner_path"]["sent"] == 2 * new["local"] + new["back"][True], (rank, new["owner_path"])
        assert old["owner_path"]["sent"] == 2 * old["local"] + old["back"][False], (rank, old["owner_path"])
        assert new["back"][True] < new["back"][False]
        rest = [w["step"]["sent"] - w["owner_path"]["sent"] for w in (new, old)]
        assert rest[0] == rest[1] > 0, rest  # the row path's bytes are not touched
    for way in ("factors", "direction"):  # what the owners send is what the ranks receive
        assert sum(r[way]["owner_path"]["sent"] for r in got) == sum(r[way]["owner_path"]["received"] for r in got)
    assert sum(r["factors"]["owner_path"]["sent"] for r in got) < sum(r["direction"]["owner_path"]["sent"] for r in got)
    # NorMuon likewise, with its row divisors and restoring scale (F.apply_factors' divide): its owner-path matrices
    # one process's bits, every parameter the control's, fewer bytes
    for rank, r in enumerate(got):
        new, old = r["normuon"], r["normuon_direction"]
        assert new["factored"] == 4 and old["factored"] == 0, (new["factored"], old["factored"])
        assert not set(new["owner_names"]) & set(new["unequal"] + old["unequal"]), (rank, new["unequal"])
        assert all(torch.equal(new["params"][n], p) for n, p in old["params"].items())
        assert new["owner_path"]["sent"] < old["owner_path"]["sent"], (rank, new["owner_path"], old["owner_path"])
