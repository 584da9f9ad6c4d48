"""Where each parameter steps (``optim/placement.py``) and where its pieces lie (``optim/owners.py``).

- The pieces descriptors (runs of global indices per dimension, computed from the placements with no
  collective) are torch's own placement semantics: put together by ``DTensor.full_tensor()`` they give back
  every global index exactly once, under TP, FSDP2 over TP (``_StridedShard``) and uneven shards.
- Planning makes no collective: it runs on torch's fake process group, where collectives return nothing.
- The layout tests can fail: Newton-Schulz per shard (every DTensor stepped on its local piece, a
  monkeypatched placement) is far from one process under TP, where the real placement is within 1e-6.
- Expert parallelism as torchtitan lays it out (experts ``Shard(0)`` over an EP mesh, each rank holding whole
  experts, dense weights FSDP2-sharded over another mesh of the same ranks): the experts step with no
  collective and the whole model equals one process.
- Pipeline stages (torchtitan's model parts: a first stage without the head, a last one without the
  embedding): each stage's optimizer routes its parameters by role and the stages together step as the whole
  model's optimizer.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import zoo
from test_distributed import _spawn
from test_layouts import compare_under_layout, fsdp

import meqmuon
from meqmuon.optim.distributed import is_dtensor
from meqmuon.train.parallel import tp_plan

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")


def _every_index_once(model) -> list[str]:
    """Per DTensor parameter: this rank's piece by the descriptor, its shape checked against torch's, and all
    ranks' pieces put together by ``full_tensor()``, which must give back ``arange`` (an empty list: all did)."""
    from torch.distributed.tensor import DTensor

    from meqmuon.optim.owners import Pieces

    bad = []
    for name, p in model.named_parameters():
        if not is_dtensor(p) or p.device_mesh.size() != dist.get_world_size():  # the owner path's meshes span all
            continue
        whole = torch.arange(math.prod(p.shape), dtype=torch.float64).view(p.shape)
        piece = Pieces(p).take(whole, dist.get_rank())
        if piece.shape != p.to_local().shape:
            bad.append(f"{name}: {tuple(piece.shape)} vs {tuple(p.to_local().shape)}")
            continue
        back = DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride()).full_tensor()
        if not torch.equal(back, whole):
            bad.append(f"{name}: {tuple(p.placements)}")
    return bad


def _descriptor_worker(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, _ = zoo.llama()
    tp_plan(model, mesh["tp"])
    fsdp(model, mesh["dp"])
    assert sum(p.device_mesh.ndim == 2 for p in model.parameters()) > 10
    bad = _every_index_once(model)
    flat = init_device_mesh("cpu", (4,))
    odd = torch.nn.Module()  # uneven and empty shards: 3 rows over 4 ranks, 7 columns over 4
    odd.a = torch.nn.Parameter(distribute_tensor(torch.zeros(3, 5), flat, [Shard(0)]))
    odd.b = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 7), flat, [Shard(1)]))
    return bad + _every_index_once(odd)


def test_pieces_descriptors_are_torchs_placements_fsdp2_over_tp(tmp_path):
    for bad in _spawn(_descriptor_worker, tmp_path, world=4):
        assert bad == []


def test_planning_makes_no_collective_on_the_fake_process_group():
    """FSDP2 over TP (4 x 2) of the tiny Llama on torch's fake process group, as rank 5 of 8: the optimizer
    plans (owners, descriptors) and every rank's piece lies where torch's placements put it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meqmuon.optim.owners import Pieces, piece_runs
    from meqmuon.optim.placement import Path

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        model, _ = zoo.llama()
        tp_plan(model, mesh["tp"])
        fsdp(model, mesh["dp"])
        opt = meqmuon.build_optimizer("meqmuon", model, ns_dtype=torch.float32)
        plan = opt._plan()
        ex = opt._exchange
        assert ex is not None and len(ex.units) > 0
        assert {u.owner for u in ex.units} == set(range(8))  # balanced over all ranks
        q = model.model.layers[0].self_attn.q_proj.weight
        pieces = Pieces(q)
        assert pieces.local_shape(5) == tuple(q.to_local().shape)
        rows = q.shape[0]
        # rank 5 is (dp 2, tp 1): TP's second half of the rows, then FSDP2's third quarter of it
        half = rows // 2
        assert piece_runs(q.shape, q.placements, (4, 2), (2, 1))[0] == ((half + half // 2, half + 3 * half // 4),)
        # every hidden matrix through the exchange, one unit each; the norms whole rows with sums over shards
        entries = [e for _, es, _ in plan for e in es]
        assert sum(len(e.units) for e in entries) == len(ex.units)
        assert {e.path for e in entries if e.kind == "hidden"} == {Path.OWNERS}
        assert all(e.split is ex for e in entries if e.path is Path.OWNERS)
    finally:
        dist.destroy_process_group()


def test_row_shards_of_a_one_rank_shard_group_are_local_and_the_calls_carry_their_path():
    """HSDP's ``(Replicate(), Shard(0))`` on a 2 x 1 mesh (torch's fake process group, rank 1 of 2) holds whole
    matrices on every rank: ``path_of`` says ``LOCAL`` (no exchange), where on 1 x 2 it says ``OWNERS``; and a
    step's rule calls carry their entries' path (``StepContext.path``), by which ``placement.EXECUTORS`` runs them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meqmuon.optim import engine
    from meqmuon.optim.placement import Path, path_of

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        paths = {}
        for dims in ((2, 1), (1, 2)):
            mesh = init_device_mesh("cpu", dims)
            local = torch.zeros(8 // dims[1], 8)
            w = torch.nn.Parameter(DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                                                      shape=(8, 8), stride=(8, 1)))
            opt = meqmuon.build_optimizer("muon", [{"params": [w], "kind": "hidden", "names": ["w"]}])
            rule, layout = opt._rules["hidden"], engine.group_layout(opt.param_groups[0], 0, w.shape, "w")
            paths[dims] = path_of(w, rule, layout, 2)
            w.grad = torch.zeros_like(w)
            calls, _, _ = opt._calls(opt._plan())
            assert [c[3].path for c in (*calls[0], *calls[1])] == [paths[dims]], dims
        assert paths == {(2, 1): Path.LOCAL, (1, 2): Path.OWNERS}, paths
    finally:
        dist.destroy_process_group()


def _per_shard_worker(rank):
    """Muon under TP twice: as placed, and with every DTensor stepped on its local piece alone."""
    from torch.distributed.device_mesh import init_device_mesh

    from meqmuon.optim import engine
    from meqmuon.optim.placement import Path

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    real = compare_under_layout("llama", ["muon"], lambda m: tp_plan(m, mesh), steps=2)["muon"]["diff"]
    placed = engine.path_of
    engine.path_of = lambda p, *a, **k: Path.LOCAL  # Newton-Schulz per shard
    try:
        per_shard = compare_under_layout("llama", ["muon"], lambda m: tp_plan(m, mesh), steps=2)["muon"]["diff"]
    finally:
        engine.path_of = placed
    return real, per_shard


def test_negative_control_newton_schulz_per_shard_fails_the_layout_bound(tmp_path):
    for real, per_shard in _spawn(_per_shard_worker, tmp_path):
        assert real <= 1e-6
        assert per_shard > 1e-4, per_shard  # what tests/test_layouts.py's bound would catch


class _MoE(torch.nn.Module):
    """Four experts ``(E, out, in)``, a dense weight, a norm: torchtitan's MoE block in miniature."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.experts = torch.nn.Parameter(torch.randn(4, 12, 8, generator=g))
        self.dense = torch.nn.Parameter(torch.randn(8, 12, generator=g))
        self.norm = torch.nn.Parameter(torch.ones(8))


def _groups(m):
    return [{"params": [m.experts], "kind": "hidden", "views": ["stacked"], "names": ["experts"]},
            {"params": [m.dense], "kind": "hidden", "names": ["dense"]},
            {"params": [m.norm], "kind": "vector", "names": ["norm"]}]


def _ep_worker(rank):
    """Experts ``Shard(0)`` over the EP mesh, the rest FSDP2's ``Shard(0)`` over the DP mesh (same two ranks,
    two meshes, as torchtitan builds them): the experts' optimizer makes no collective but the step's decision (the
    skip flag's all-reduce, one a step); the whole equals one
    process fed the same gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, ref = _MoE(), _MoE()
    model.experts = torch.nn.Parameter(distribute_tensor(model.experts.detach(), ep, [Shard(0)]))
    for name in ("dense", "norm"):
        setattr(model, name, torch.nn.Parameter(distribute_tensor(getattr(model, name).detach(), dp, [Shard(0)])))
    calls = []
    originals = {n: getattr(dist, n) for n in ("all_to_all_single", "all_reduce", "all_gather", "broadcast",
                                               "all_gather_into_tensor")}
    for n, f in originals.items():
        setattr(dist, n, lambda *a, _f=f, _n=n, **k: (calls.append(_n), _f(*a, **k))[1])
    try:
        out = {}
        for name in ("meqmuon", "normuon"):
            m, r = copy.deepcopy(model), copy.deepcopy(ref)
            experts_only = meqmuon.build_optimizer(name, _groups(m)[:1], lr=0.02, ns_dtype=torch.float32)
            rest = meqmuon.build_optimizer(name, _groups(m)[1:], lr=0.02, ns_dtype=torch.float32)
            one = meqmuon.build_optimizer(name, _groups(r), lr=0.02, ns_dtype=torch.float32)
            expert_calls = 0
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                for pn, p in r.named_parameters():
                    p.grad = torch.randn(p.shape, generator=g)
                    q = getattr(m, pn)
                    q.grad = distribute_tensor(p.grad, q.device_mesh, q.placements)
                calls.clear()
                experts_only.step()
                expert_calls += len(calls)
                rest.step()
                one.step()
            diff = max((getattr(m, pn).full_tensor() - p).abs().max().item() for pn, p in r.named_parameters())
            out[name] = (expert_calls, diff)
        return out
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)


def test_expert_parallel_experts_step_with_no_collective_and_equal_one_process(tmp_path):
    for res in _spawn(_ep_worker, tmp_path):
        for name, (calls, diff) in res.items():
            assert calls == 3, (name, calls)  # the step's one decision a step (the skip flag's 4-byte all-reduce)
            assert diff <= 1e-6, (name, diff)


def test_pipeline_stage_optimizers_route_by_role_and_step_as_the_whole_model():
    """torchtitan's pipeline model parts: stage 0 keeps the embedding and the first layer, stage 1 the second
    layer, the final norm and the head (the others set to ``None`` / removed, as torchtitan's splitter does).
    Each stage's optimizer routes by role (no head in stage 0, no embedding in stage 1) and the two stages'
    updates equal the whole model's optimizer's."""
    model, _ = zoo.llama()
    assert len(model.model.layers) == 2
    whole = copy.deepcopy(model)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.lm_head, first.model.norm = None, None
    del first.model.layers[1]
    last.model.embed_tokens = None
    del last.model.layers[0]
    kinds = {}
    for stage, part in (("first", first), ("last", last)):
        kinds[stage] = {g["kind"] for g in meqmuon.param_groups(part) if g["params"]}
    assert "embedding" in kinds["first"] and "head" not in kinds["first"], kinds
    assert "head" in kinds["last"] and "embedding" not in kinds["last"], kinds
    for name in ("meqmuon", "muon"):
        w, f, la = copy.deepcopy(whole), copy.deepcopy(first), copy.deepcopy(last)
        opts = [meqmuon.build_optimizer(name, m, lr=0.02, ns_dtype=torch.float32) for m in (w, f, la)]
        parts = {**{f"model.{k}": v for k, v in f.model.named_parameters()},
                 **{f"model.{k}".replace("layers.0", "layers.1"): v for k, v in la.model.named_parameters()},
                 **{f"lm_head.{k}": v for k, v in la.lm_head.named_parameters()}}
        assert set(parts) == {n for n, _ in w.named_parameters()}
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            for n, p in w.named_parameters():
                p.grad = torch.randn(p.shape, generator=g)
                parts[n].grad = p.grad.clone()
            for opt in opts:
                opt.step()
        for n, p in w.named_parameters():
            assert torch.equal(p, parts[n]), (name, n)
