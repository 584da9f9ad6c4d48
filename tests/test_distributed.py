"""Distributed MeqMuon: DDP work split and FSDP2/HSDP (DTensor) sharding, on gloo (CPU).

What is proven and why the tolerances:

- DDP (``ReplicatedSplit``): given identical gradients on every rank, 2 ranks produce *bit for bit*
  the parameters of one process after several steps, for MeqMuon, Muon and NorMuon. This holds
  because each parameter's owner runs exactly the per-matrix code of one process (Newton-Schulz of
  a matrix does not depend on its neighbours, checked directly below) and a broadcast copies bits.
  The work is really split: the two ranks together orthogonalise each hidden matrix exactly once
  per step, and MeqMuon's embedding and head are equilibrated once per step each, on different
  ranks.
- The optimizer state is complete on every rank: the two ranks' ``state_dict()`` are equal, and the
  one saved on rank 0 mid-run, loaded into a fresh *single-process* optimizer, continues bit for
  bit like the distributed run (KellerJordan/Muon issue 46 is the failure this rules out).
- FSDP2 (``fully_shard``, ``Shard(0)``; odd dim-0 sizes and an empty shard included): MeqMuon
  (hidden, embedding/head and vector rules), Muon, NorMuon and SCALE equal the unsharded optimizer
  to 1e-6 (float32 parameters). Newton-Schulz inputs arrive bit-identical at the owner rank; the
  only differences are the rounding of partial sums of squares reduced across shards (~1e-7
  relative), times a few steps of size ``lr``. MeqMuon's row/column choices are equal exactly.
  ``compile=True`` (the fused hidden update) meets the same bound against the eager unsharded run.
- HSDP (``fully_shard`` on a 2 x 2 mesh, 4 processes): the FSDP2 path over the shard dimension, the
  same 1e-6 bound on every rank, the two replica groups bit-identical, and a DCP resume bit for bit.
- FSDP2 checkpoints with ``torch.distributed.checkpoint`` (``get_state_dict``, ``dcp.save``/``dcp.load``,
  ``set_state_dict``; nested and flattened optimizer state dicts): MeqMuon and NorMuon resumed into
  a fresh model and optimizer end bit for bit where the uninterrupted run ends. Across world sizes
  (2 FSDP2 ranks -> 1 unsharded process, and back) they end within the FSDP2 bound of 1e-6.
- The batched step (``foreach=True``, test_foreach.py) under DDP: one exchange per shape bucket of hidden
  matrices and step, every rank identical, equal to one process to 1e-5; under FSDP2 equal to the
  unsharded per-tensor step to 1e-5 (the file's last section).

Which optimizers each layout runs is the ``distributed`` column of capabilities.py. Workers are
started inside the tests (:func:`_spawn`, for every distributed test file); each ends with
``destroy_process_group`` and ``os._exit`` (a gloo process may otherwise abort at interpreter exit after
finishing its work).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import socket
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from capabilities import NEWTON_SCHULZ, ddp_exchanges, runs
from torch import nn

import meqmuon
from meqmuon import functional as F
from meqmuon.optim import blockwise as B
from meqmuon.optim import compiled
from meqmuon.optim import distributed as D
from meqmuon.optim import newton_schulz as NS
from meqmuon.optim.exchange import Exchange

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

WORLD = 2
STEPS = 4
SAVE_AT = 2
# Shapes chosen so that shape buckets have 3, 2, 1 and 1 matrices (uneven split across 2 ranks),
# with tall, wide and square matrices and a convolution kernel.
HIDDEN = [(16, 32), (16, 32), (16, 32), (32, 16), (32, 16), (24, 24), (8, 4, 3)]
EMBED, HEAD, VECTORS = (40, 16), (40, 16), [(16,), (24,)]
# FSDP2 shapes: odd dim-0 sizes (uneven shards) and a 1-row matrix (rank 1's shard is empty).
FSDP_HIDDEN = [(15, 8), (15, 8), (7, 12), (7, 12), (7, 12), (12, 12), (1, 6)]
FSDP_EMBED, FSDP_HEAD, FSDP_VECTORS = (21, 8), (21, 8), [(15,), (7,)]
# "+compile": MeqMuon with compile=True. Under DDP an owner compiles statistics and step of its whole
# matrices in one graph; under FSDP2 the statistics (with cross-shard sums) stay eager.
DDP_NAMES = runs("ddp", "ddp-compile")
FSDP_NAMES = runs("fsdp2", "fsdp2-compile")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params(hidden, embed, head, vectors, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda shape: nn.Parameter(torch.randn(*shape, generator=g) * 0.1)  # noqa: E731
    return {
        "hidden": [make(s) for s in hidden],
        "embedding": [make(embed)],
        "head": [make(head)],
        "vector": [make(s) for s in vectors],
    }


def _groups(params):
    return [{"params": ps, "kind": k, "names": [f"{k}.{i}" for i in range(len(ps))]} for k, ps in params.items() if ps]


def _grads(params, step):
    """Deterministic gradients for a step, the same in every process (some rows zero, as for absent tokens)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for k, ps in params.items():
        out[k] = [
            torch.randn(p.shape, generator=g)
            * (1 + 0.5 * torch.rand(p.shape[:1], generator=g)).reshape(-1, *([1] * (p.ndim - 1)))
            for p in ps
        ]
    out["embedding"][0][::5] = 0.0
    return out


def _set_grads(params, step):
    for k, gs in _grads(params, step).items():
        for p, gr in zip(params[k], gs, strict=True):
            p.grad = gr


def _opt(name, groups, **kw):
    """``name`` is an optimizer name, optionally with ``+compile`` (``compile=True``), ``+foreach``
    (the batched step) or ``+f32`` (the per-tensor step, the batched step's reference).

    Newton-Schulz is always float32 here: the default ``ns_dtype=None`` is bf16 on a CPU with native
    bf16 and float32 elsewhere, and compiled and eager kernels round bf16 differently (3e-4 after a
    few steps), so a 1e-6 tolerance would hold on AVX2 and fail on AVX512_BF16/AMX. The bf16 path has
    its own tests with bf16 tolerances (``tests/test_precision.py``)."""
    base, _, flag = name.partition("+")
    if flag == "compile":
        kw["compile"] = True
    if flag in ("foreach", "f32"):  # the batched step (test_foreach.py), and its per-tensor reference
        kw["foreach"] = flag == "foreach"
    if flag == "relay":  # the exchange relayed through "nodes" of two ranks (relay.py); one process: nothing to relay
        kw["relay_group"] = 2 if dist.is_initialized() else 1
    if base in NEWTON_SCHULZ:
        kw.setdefault("ns_dtype", torch.float32)
    return meqmuon.build_optimizer(base, groups, lr=0.02, weight_decay=0.1, **kw)


def _flat(params):
    return [p.detach().clone() for k in ("hidden", "embedding", "head", "vector") for p in params[k]]


#: What the worker processes' server imports once (see :func:`_spawn`): torch, meqmuon, the transformers
#: model code (through meqmuon's model registry) and this module.
FORKSERVER_PRELOAD = ["torch", "torch.distributed.tensor", "meqmuon", "meqmuon.train.models", "test_distributed"]


def _spawn(fn, tmp_path, *args, world=WORLD):
    """``fn(rank, *args)`` on ``world`` gloo ranks; each rank's result, in rank order.

    The ranks are forked from multiprocessing's ``forkserver``: one clean interpreter (this process's
    ``sys.path`` and environment at its start, none of its state) that imported ``FORKSERVER_PRELOAD``
    once, so that a worker starts from freshly imported modules as a spawned one does, without paying
    ~2 CPU seconds of torch's import (~5 with transformers) per rank and launch: ~45 launches in the suite.
    """
    port = _free_port()
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    mp.start_processes(_entry, args=(fn, port, str(tmp_path), args, world), nprocs=world, join=True,
                       start_method="forkserver")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _entry(rank, fn, port, tmp, args, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A forked rank would share the server's unseeded generators with its peers; a spawned one has its own
    # (Python's ``random`` reseeds itself after a fork). Whatever is not seeded differs across ranks, as before.
    torch.seed()
    np.random.seed()
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, *args)
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


# ---- single-process facts the distributed path relies on ----------------------------------------


@pytest.mark.parametrize("shape", [(7, 16, 32), (5, 24, 12), (2, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_is_batch_size_independent(shape, dtype):
    """NS of any sub-stack equals the same matrices of the full-stack NS bit for bit (1 and 2 threads)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            full = F.orthogonalize(x, dtype=dtype)
            for lo, hi in [(0, 1), (1, 3), (2, shape[0]), (shape[0] - 1, shape[0])]:
                assert torch.equal(full[lo:hi], F.orthogonalize(x[lo:hi], dtype=dtype)), (t, lo, hi)
    finally:
        torch.set_num_threads(threads)


def test_ns_flops_formula():
    # square m=n: 5 * (4 m^3 + 2 m^3); tall and wide give the same count (wide orientation)
    assert NS.ns_flops(4, 4, 5) == 5 * 6 * 64
    assert NS.ns_flops(3, 8, 1) == NS.ns_flops(8, 3, 1) == 4 * 9 * 8 + 2 * 27


def test_process_group_none_without_distributed_is_single_process():
    assert not dist.is_initialized()
    params = _params(HIDDEN, EMBED, HEAD, VECTORS)
    opt = _opt("meqmuon", _groups(params))
    assert opt._process_group is None
    assert type(opt._splitter(opt.param_groups[0])) is D.LocalSplit


# ---- DDP ------------------------------------------------------------------------------------


def _ddp_worker(rank, name):
    ns_count = [0]
    real_ns = NS.NS_METHODS["quintic"].function

    def count(x, *args, **kw):  # a stack (k, m, n), per matrix or batched: the one entry of the table
        ns_count[0] += x.shape[0]
        return real_ns(x, *args, **kw)

    NS.NS_METHODS["quintic"] = NS.NSMethod(count)
    equilibrated = []
    real_eq = B.equilibrate_step_

    def counting_equilibrate(param, *args, **kw):
        equilibrated.append(tuple(param.shape))
        return real_eq(param, *args, **kw)

    B.equilibrate_step_ = counting_equilibrate
    params = _params(HIDDEN, EMBED, HEAD, VECTORS)
    opt = _opt(name, _groups(params))
    assert isinstance(opt._splitter(opt.param_groups[0]), Exchange)  # the hidden group: Newton-Schulz shared
    assert type(opt._splitter(opt.param_groups[1])) is D.LocalSplit  # the embedding's rule: in place on every rank
    saved = None
    for step in range(STEPS):
        _set_grads(params, step)
        opt.step()
        if step + 1 == SAVE_AT:
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            saved = (buf.getvalue(), _flat(params))
    counts = opt.selection_counts() if name.startswith("meqmuon") else None
    return {
        "params": _flat(params),
        "state": opt.state_dict(),
        "saved": saved,
        "ns": ns_count[0],
        "counts": counts,
        "equilibrated": len(equilibrated),
    }


def _single_process(name, hidden=HIDDEN, embed=EMBED, head=HEAD, vectors=VECTORS, steps=STEPS):
    params = _params(hidden, embed, head, vectors)
    opt = _opt(name, _groups(params))
    for step in range(steps):
        _set_grads(params, step)
        opt.step()
    return params, opt


def _state_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for key, v in a["state"][k].items():
            w = b["state"][k][key]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, key)


@pytest.mark.parametrize("name", DDP_NAMES)
def test_ddp_split_is_bit_exact_and_state_complete(name, tmp_path):
    results = _spawn(_ddp_worker, tmp_path, name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_params, ref_opt = _single_process(name)
    finally:
        torch.set_num_threads(threads)
    ref = _flat(ref_params)
    moved = max(
        (a - b).abs().max().item() for a, b in zip(ref, _flat(_params(HIDDEN, EMBED, HEAD, VECTORS)), strict=True)
    )
    assert moved > 1e-3
    for r, res in enumerate(results):
        for i, (p, q) in enumerate(zip(res["params"], ref, strict=True)):
            assert torch.equal(p, q), (name, r, i)
    # complete state on every rank, equal to the single process's
    _state_equal(results[0]["state"], results[1]["state"])
    _state_equal(results[0]["state"], ref_opt.state_dict())
    if name.startswith("meqmuon"):
        assert results[0]["counts"] == results[1]["counts"] == ref_opt.selection_counts()
    # Newton-Schulz work is split, not repeated: each matrix once per step over both ranks
    n_hidden = len(HIDDEN)
    assert results[0]["ns"] + results[1]["ns"] == n_hidden * STEPS
    assert 0 < results[0]["ns"] < n_hidden * STEPS and 0 < results[1]["ns"] < n_hidden * STEPS
    if name == "meqmuon":  # embedding and head: in place on every rank, each once per step (no bytes)
        assert results[0]["equilibrated"] == results[1]["equilibrated"] == 2 * STEPS


def test_assign_owners_balances_across_calls():
    load = [0.0, 0.0]
    first = D.assign_owners([5.0, 1.0, 1.0, 3.0], load)
    assert first == D.assign_owners([5.0, 1.0, 1.0, 3.0], [0.0, 0.0])  # deterministic
    assert first == [0, 1, 1, 1] and load == [5.0, 5.0]  # longest first, then the least-loaded rank
    # the load carries over: a single expensive item of the next group goes to rank 0, the next to rank 1
    assert D.assign_owners([4.0], load) == [0] and D.assign_owners([4.0], load) == [1]


def _resume_single_process(name, saved):
    """Load rank 0's mid-run state_dict into a fresh single-process optimizer and finish the run."""
    blob, flat = saved
    params = _params(HIDDEN, EMBED, HEAD, VECTORS, seed=123)
    with torch.no_grad():
        for p, v in zip([p for k in ("hidden", "embedding", "head", "vector") for p in params[k]], flat, strict=True):
            p.copy_(v)
    opt = _opt(name, _groups(params))
    opt.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    for step in range(SAVE_AT, STEPS):
        _set_grads(params, step)
        opt.step()
    return _flat(params)


@pytest.mark.parametrize("name", runs("ddp-resume"))
def test_state_dict_from_rank0_resumes_single_process(name, tmp_path):
    results = _spawn(_ddp_worker, tmp_path, name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resumed = _resume_single_process(name, results[0]["saved"])
    finally:
        torch.set_num_threads(threads)
    for i, (p, q) in enumerate(zip(resumed, results[1]["params"], strict=True)):
        assert torch.equal(p, q), i


# ---- FSDP2 ----------------------------------------------------------------------------------


class _Holder(nn.Module):
    def __init__(self, params):
        super().__init__()
        for k, ps in params.items():
            for i, p in enumerate(ps):
                self.register_parameter(f"{k}_{i}", p)


def _fsdp_worker(rank, names, mesh_shape=(WORLD,)):
    """FSDP2 on a 1-D mesh, or HSDP on a 2-D ``mesh_shape`` (replicate x shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    placements = [Replicate()] * (len(mesh_shape) - 1) + [Shard(0)]
    out = {}
    for name in names:
        params = _params(FSDP_HIDDEN, FSDP_EMBED, FSDP_HEAD, FSDP_VECTORS)
        holder = _Holder(params)
        fully_shard(holder, mesh=mesh)  # on a 2-D mesh: HSDP
        # fully_shard replaced the parameters by DTensors: look them up again, in the same order
        sharded = {k: [getattr(holder, f"{k}_{i}") for i in range(len(ps))] for k, ps in params.items()}
        assert all(list(p.placements) == placements for ps in sharded.values() for p in ps)
        local_rows = [p.to_local().shape[0] for p in sharded["hidden"]]
        opt = _opt(name, _groups(sharded))
        split = opt._splitter(opt.param_groups[0])
        for step in range(STEPS):
            for k, gs in _grads(params, step).items():
                for p, gr in zip(sharded[k], gs, strict=True):
                    p.grad = distribute_tensor(gr, mesh, placements)
            opt.step()
        full = [p.full_tensor().detach().clone() for k in ("hidden", "embedding", "head", "vector") for p in sharded[k]]
        counts = opt.selection_counts() if name.startswith("meqmuon") else None
        out[name] = {
            "params": full,
            "counts": counts,
            "local_rows": local_rows,
            "compiled": sorted({k[0] for k in compiled._bucket_graphs}),
            "split": (type(split).__name__, dist.get_world_size(split.pg)),
            # the ranks this rank exchanges with as an owner (its replica group: HSDP's shard group)
            "peers": sorted({r for u in getattr(split, "units", []) for r in u.group}),
        }
    if len(mesh_shape) == 1:  # a DTensor every rank holds whole steps as one process steps its tensor
        w, g = torch.randn(6, 4, generator=torch.Generator().manual_seed(5)), torch.randn(6, 4)
        rep = nn.Parameter(distribute_tensor(w, mesh, [Replicate()]))
        rep.grad = distribute_tensor(g, mesh, [Replicate()])
        plain = nn.Parameter(w.clone())
        plain.grad = g.clone()
        for p in (rep, plain):
            meqmuon.MeqMuon([{"params": [p], "kind": "hidden"}], ns_dtype=torch.float32).step()
        out["replicate_diff"] = (rep.to_local() - plain).abs().max().item()
    return out


def test_fsdp2_equals_unsharded(tmp_path):
    results = _spawn(_fsdp_worker, tmp_path, FSDP_NAMES)
    for name in FSDP_NAMES:  # Newton-Schulz through the exchange; SCALE's statistics summed over the shards
        assert results[0][name]["split"] == ("RowSums" if name == "scale" else "Exchange", 2), name
    assert results[0]["meqmuon"]["local_rows"] == [8, 8, 4, 4, 4, 6, 1]
    assert results[1]["meqmuon"]["local_rows"] == [7, 7, 3, 3, 3, 6, 0]  # uneven, and one empty shard
    assert results[0]["replicate_diff"] == results[1]["replicate_diff"] == 0.0
    assert results[0]["meqmuon+compile"]["compiled"] == ["meq_hidden"]  # the owners' graphs really ran
    init = _flat(_params(FSDP_HIDDEN, FSDP_EMBED, FSDP_HEAD, FSDP_VECTORS))
    for name in FSDP_NAMES:
        base = name.partition("+")[0]  # the reference is always the eager, unsharded optimizer
        ref_params, ref_opt = _single_process(base, FSDP_HIDDEN, FSDP_EMBED, FSDP_HEAD, FSDP_VECTORS)
        ref = _flat(ref_params)
        assert max((a - b).abs().max().item() for a, b in zip(ref, init, strict=True)) > 1e-3
        for r in range(WORLD):
            got = results[r][name]["params"]
            for i, (p, q) in enumerate(zip(got, ref, strict=True)):
                assert torch.allclose(p, q, rtol=0, atol=1e-6), (name, r, i, (p - q).abs().max().item())
        if base == "meqmuon":
            assert results[0][name]["counts"] == results[1][name]["counts"] == ref_opt.selection_counts()


def test_one_newton_schulz_dispatcher_batched_equals_per_matrix():
    """The driver's body chooses the Newton-Schulz form: a stack as one batched call (the batched step,
    and FSDP2 owners on batching devices) equals the per-matrix iteration (the per-tensor step)."""
    from meqmuon.optim.driver import HiddenRule, directions

    group = {"ns_steps": 5, "ns_coefficients": F.NS_COEFFICIENTS, "ns_dtype": torch.float64, "ns_method": "quintic"}
    stack = torch.randn(3, 7, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    rule = HiddenRule()
    ((per_matrix,),) = directions(rule, [(stack, 3, {})], group, None, batched=False, ns_dtype=torch.float64)
    ((batched,),) = directions(rule, [(stack.clone(), 3, {})], group, None, batched=True, ns_dtype=torch.float64)
    assert torch.allclose(batched, per_matrix, rtol=0, atol=1e-12)
    assert not torch.equal(per_matrix, stack)  # the per-matrix form leaves its input alone


def test_newton_schulz_sub_stack_regression():
    """Inputs on which a baddbmm-fused NS gave the last of 3 matrices other bits than NS alone."""
    g = torch.Generator().manual_seed(0)
    torch.randn(2, 32, 16, generator=g)
    x = torch.randn(3, 16, 32, generator=g)
    full = F.orthogonalize(x)
    assert all(torch.equal(full[i], F.orthogonalize(x[i])) for i in range(3))


# ---- HSDP (2 replica groups x 2 shards, 4 processes) ------------------------------------------

HSDP_NAMES = [*runs("hsdp"), "meqmuon+relay"]


def test_hsdp_equals_unsharded_and_replicas_agree(tmp_path):
    """HSDP shards rows over the mesh's last dimension and repeats the work in each replica group:
    every rank ends within the FSDP2 bound (1e-6) of the unsharded optimizer, and the two replica
    groups hold bit-identical parameters."""
    results = _spawn(_fsdp_worker, tmp_path, HSDP_NAMES, (2, 2), world=4)
    assert results[0]["meqmuon"]["split"] == ("Exchange", 4)
    # each replica group has its own owners: rank 0 exchanges with its shard group (ranks 0 and 1) alone
    assert results[0]["meqmuon"]["peers"] == [0, 1] and results[2]["meqmuon"]["peers"] == [2, 3]
    assert results[0]["meqmuon"]["local_rows"] == results[2]["meqmuon"]["local_rows"] == [8, 8, 4, 4, 4, 6, 1]
    assert results[1]["meqmuon"]["local_rows"] == [7, 7, 3, 3, 3, 6, 0]
    for name in HSDP_NAMES:
        ref_params, ref_opt = _single_process(name, FSDP_HIDDEN, FSDP_EMBED, FSDP_HEAD, FSDP_VECTORS)
        ref = _flat(ref_params)
        for r in range(4):
            got = results[r][name]["params"]
            for i, (p, q) in enumerate(zip(got, ref, strict=True)):
                assert torch.allclose(p, q, rtol=0, atol=1e-6), (name, r, i, (p - q).abs().max().item())
        for p, q in zip(results[0][name]["params"], results[2][name]["params"], strict=True):
            assert torch.equal(p, q), name  # replica groups in lockstep
        if name == "meqmuon":
            assert all(results[r][name]["counts"] == ref_opt.selection_counts() for r in range(4))


# ---- FSDP2 + torch.distributed.checkpoint ------------------------------------------------------


def _fsdp_dcp_worker(rank, names, ckpt_root, mesh_shape=(WORLD,)):
    """Per optimizer: STEPS steps uninterrupted; then, for nested and flattened optimizer state dicts,
    SAVE_AT steps, a DCP save, a fresh model (other init) and optimizer loaded from it, the remaining
    steps. A 2-D ``mesh_shape`` makes it HSDP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # DCP's HSDP support needs named mesh dimensions
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    placements = [Replicate()] * (len(mesh_shape) - 1) + [Shard(0)]

    def build(name, seed):
        params = _params(FSDP_HIDDEN, FSDP_EMBED, FSDP_HEAD, FSDP_VECTORS, seed=seed)
        holder = _Holder(params)
        fully_shard(holder, mesh=mesh)
        sharded = {k: [getattr(holder, f"{k}_{i}") for i in range(len(ps))] for k, ps in params.items()}
        return holder, sharded, _opt(name, _groups(sharded))

    def run(sharded, opt, steps):
        for step in steps:
            for k, gs in _grads(sharded, step).items():
                for p, gr in zip(sharded[k], gs, strict=True):
                    p.grad = distribute_tensor(gr, mesh, placements)
            opt.step()

    def full(sharded):
        return [p.full_tensor().detach().clone() for k in ("hidden", "embedding", "head", "vector") for p in sharded[k]]

    def counts(name, opt):
        return opt.selection_counts() if name == "meqmuon" else None

    out = {}
    for name in names:
        _, sharded, opt = build(name, seed=0)
        run(sharded, opt, range(STEPS))
        out[name] = {"ref": {"params": full(sharded), "counts": counts(name, opt)}}
        for flatten in (False, True):
            options = StateDictOptions(flatten_optimizer_state_dict=flatten)
            ckpt = os.path.join(ckpt_root, f"dcp_{name}_{flatten}")
            holder, sharded, opt = build(name, seed=0)
            run(sharded, opt, range(SAVE_AT))
            model_sd, optim_sd = get_state_dict(holder, opt, options=options)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
            del holder, sharded, opt, model_sd, optim_sd

            holder, sharded, opt = build(name, seed=123)
            init = full(sharded)
            model_sd, optim_sd = get_state_dict(holder, opt, options=options)  # templates: DCP loads in place
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=ckpt)
            set_state_dict(
                holder, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
            )
            run(sharded, opt, range(SAVE_AT, STEPS))
            out[name][flatten] = {"params": full(sharded), "counts": counts(name, opt), "init": init}
        # Another world size: the checkpoint the test saved from one unsharded process, loaded here.
        single_ckpt = os.path.join(ckpt_root, f"dcp_single_{name}")
        if os.path.exists(single_ckpt):
            holder, sharded, opt = build(name, seed=123)
            model_sd, optim_sd = get_state_dict(holder, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=single_ckpt)
            set_state_dict(holder, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            run(sharded, opt, range(SAVE_AT, STEPS))
            out[name]["from_single"] = {"params": full(sharded), "counts": counts(name, opt)}
    return out


def test_fsdp2_dcp_checkpoint_resumes_exactly(tmp_path):
    """FSDP2 + DCP (``get_state_dict``/``dcp.save``/``dcp.load``/``set_state_dict``, nested and flattened
    optimizer state): a fresh model and optimizer resumed mid-run end bit for bit where the
    uninterrupted run ends, with the same row/column choices. (Without the optimizer state the same
    resume differs by ~2e-2.) The state round-trips with its types: DTensor momentum/second moment,
    Python-int ``step``, plain 0-D ``rows_chosen`` (replicated, identical on every rank)."""
    names = runs("fsdp2-dcp")
    _check_dcp_resume(_spawn(_fsdp_dcp_worker, tmp_path, names, str(tmp_path)), names)


def test_hsdp_dcp_checkpoint_resumes_exactly(tmp_path):
    """The same resume under HSDP (2 replica groups x 2 shards, 4 processes): bit for bit on every rank."""
    names = runs("hsdp-dcp")
    _check_dcp_resume(_spawn(_fsdp_dcp_worker, tmp_path, names, str(tmp_path), (2, 2), world=4), names)


def _check_dcp_resume(results, names):
    for name in names:
        ref = results[0][name]["ref"]
        if name == "meqmuon":
            assert ref["counts"] and results[1][name]["ref"]["counts"] == ref["counts"]
        for r in range(len(results)):
            assert all(torch.equal(p, q) for p, q in zip(results[r][name]["ref"]["params"], ref["params"], strict=True))
            for flatten in (False, True):
                got = results[r][name][flatten]
                # the fresh model really started elsewhere
                assert max((a - b).abs().max().item() for a, b in zip(got["init"], ref["params"], strict=True)) > 1e-2
                for i, (p, q) in enumerate(zip(got["params"], ref["params"], strict=True)):
                    assert torch.equal(p, q), (name, r, flatten, i, (p - q).abs().max().item())
                assert got["counts"] == ref["counts"], (name, r, flatten)


def _unsharded_dcp_run(name, steps, load_from=None, save_to=None):
    """One process, no process group, no FSDP: optionally load a DCP checkpoint (saved by any world
    size), run ``steps``, optionally save one. Returns the parameters and the selection counts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    params = _params(FSDP_HIDDEN, FSDP_EMBED, FSDP_HEAD, FSDP_VECTORS, seed=0 if load_from is None else 123)
    holder = _Holder(params)
    opt = _opt(name, _groups(params))
    if load_from is not None:
        model_sd, optim_sd = get_state_dict(holder, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=load_from, no_dist=True)
        set_state_dict(holder, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in steps:
        _set_grads(params, step)
        opt.step()
    if save_to is not None:
        model_sd, optim_sd = get_state_dict(holder, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save_to, no_dist=True)
    return _flat(params), (opt.selection_counts() if name == "meqmuon" else None)


def test_dcp_checkpoint_resumes_across_world_sizes(tmp_path):
    """DCP checkpoints move between world sizes: one saved by 2 FSDP2 ranks resumes in one unsharded
    process, and one saved by one unsharded process resumes on 2 FSDP2 ranks. Both end where the
    uninterrupted 2-rank run ends, to the FSDP2-vs-unsharded bound (1e-6: partial sums of squares
    reduced across shards round differently), with the same row/column choices."""
    names = runs("fsdp2-dcp")
    for name in names:
        _unsharded_dcp_run(name, range(SAVE_AT), save_to=str(tmp_path / f"dcp_single_{name}"))
    results = _spawn(_fsdp_dcp_worker, tmp_path, names, str(tmp_path))
    for name in names:
        ref = results[0][name]["ref"]
        for r in range(WORLD):  # 1 process -> 2 ranks
            got = results[r][name]["from_single"]
            for i, (p, q) in enumerate(zip(got["params"], ref["params"], strict=True)):
                assert torch.allclose(p, q, rtol=0, atol=1e-6), (name, r, i, (p - q).abs().max().item())
            assert got["counts"] == ref["counts"]
        # 2 ranks -> 1 process (the 2-rank checkpoint with nested optimizer state, saved at SAVE_AT);
        # the fresh model starts from seed 123, ~0.1 away, so only a real load lands within 1e-6.
        params, counts = _unsharded_dcp_run(name, range(SAVE_AT, STEPS), load_from=str(tmp_path / f"dcp_{name}_False"))
        for i, (p, q) in enumerate(zip(params, ref["params"], strict=True)):
            assert torch.allclose(p, q, rtol=0, atol=1e-6), (name, i, (p - q).abs().max().item())
        assert counts == ref["counts"]


# ---- MoE experts: stacked views under DDP and FSDP2 ------------------------------------------------

# 5 experts (uneven over 2 ranks: FSDP2 gives rank 0 three, rank 1 two), gate/up split in halves, and
# a dense matrix of an expert half's shape, which joins the experts' bucket.
EXPERTS = {"up": (5, 12, 8), "down": (5, 8, 6), "dense": (6, 8)}
EXPERT_VIEWS = {"views": ["stacked", "stacked", "matrix"], "splits": [(6, 6), None, None]}
EXPERT_NAMES = runs("experts-ddp", "experts-ddp-batched")


def _expert_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"hidden": [nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in EXPERTS.values()],
            "vector": [nn.Parameter(torch.randn(8, generator=g))]}


def _expert_groups(params):
    groups = _groups(params)
    groups[0].update(names=list(EXPERTS), **EXPERT_VIEWS)
    return groups


def _expert_grads(step):
    """Gradients of one step; expert 4 gets no tokens (a zero gradient) at every step."""
    g = torch.Generator().manual_seed(2000 + step)
    hidden = [torch.randn(s, generator=g) for s in EXPERTS.values()]
    hidden[0][4] = hidden[1][4] = 0.0
    return {"hidden": hidden, "vector": [torch.randn(8, generator=g)]}


def _expert_single(name, steps=STEPS):
    params = _expert_params()
    opt = _opt(name, _expert_groups(params))
    for step in range(steps):
        for k, gs in _expert_grads(step).items():
            for p, gr in zip(params[k], gs, strict=True):
                p.grad = gr
        opt.step()
    return [p.detach().clone() for ps in params.values() for p in ps], opt


def _experts_ddp_worker(rank, names):
    out = {}
    for name in names:
        params = _expert_params()
        opt = _opt(name, _expert_groups(params))
        assert isinstance(opt._splitter(opt.param_groups[0]), Exchange)
        for step in range(STEPS):
            for k, gs in _expert_grads(step).items():
                for p, gr in zip(params[k], gs, strict=True):
                    p.grad = gr
            opt.step()
        counts = opt.selection_counts() if name.startswith("meqmuon") else None
        out[name] = {"params": [p.detach().clone() for ps in params.values() for p in ps], "counts": counts,
                     "state": opt.state_dict()}
    return out


def test_ddp_experts_are_bit_exact(tmp_path):
    """DDP splits the experts' matrices over ranks (per-tensor and batched); both ranks end bit for bit
    on the single-process result, with complete, equal state."""
    results = _spawn(_experts_ddp_worker, tmp_path, EXPERT_NAMES)
    torch.set_num_threads(1)
    for name in EXPERT_NAMES:
        ref, ref_opt = _expert_single(name)
        for r in range(WORLD):
            assert all(torch.equal(a, b) for a, b in zip(results[r][name]["params"], ref, strict=True)), (name, r)
        _state_equal(results[0][name]["state"], results[1][name]["state"])
        if name.startswith("meqmuon"):
            assert results[0][name]["counts"] == ref_opt.selection_counts()
            assert "up[4]#1" in ref_opt.selection_counts()


def _experts_fsdp_worker(rank, names, ckpt_root):
    """FSDP2 shards the stacks along dim 0 (whole experts per rank). On rank 1 the dense matrix gets
    no gradient at step 0 (as an expert module that got no tokens there): its state must exist anyway."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for name in names:
        params = _expert_params()
        holder = _Holder(params)
        fully_shard(holder, mesh=mesh)
        sharded = {k: [getattr(holder, f"{k}_{i}") for i in range(len(ps))] for k, ps in params.items()}
        opt = _opt(name, _expert_groups(sharded))
        local_experts = sharded["hidden"][0].to_local().shape[0]
        for step in range(STEPS):
            for k, gs in _expert_grads(step).items():
                for p, gr in zip(sharded[k], gs, strict=True):
                    p.grad = distribute_tensor(gr, mesh, [Shard(0)])
            if step == 0 and rank == 1:
                sharded["hidden"][0].grad = None  # rank 1's experts of "up" got no tokens
            opt.step()
        keys = {i: sorted(s) for i, s in enumerate(opt.state.values())}
        counts = opt.selection_counts() if name == "meqmuon" else None  # no collective: this rank's experts
        model_sd, optim_sd = get_state_dict(holder, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(ckpt_root, f"experts_{name}"))
        out[name] = {"params": [p.full_tensor().detach().clone() for ps in sharded.values() for p in ps],
                     "local_experts": local_experts, "keys": keys, "counts": counts}
    return out


def test_fsdp2_experts_are_whole_matrices_per_rank(tmp_path):
    """Under FSDP2 each rank updates its own whole experts with no collective; the result equals the
    unsharded optimizer (rank 1's skipped step aside) and every rank holds the same state keys, so a
    ``torch.distributed.checkpoint`` save works (microsoft/dion#89)."""
    names = runs("experts-fsdp2", "experts-fsdp2-batched")
    results = _spawn(_experts_fsdp_worker, tmp_path, names, str(tmp_path))
    assert [results[r]["meqmuon"]["local_experts"] for r in range(WORLD)] == [3, 2]
    held = [{k.split("#")[0] for k in results[r]["meqmuon"]["counts"] if k.startswith("up[")} for r in range(WORLD)]
    assert held == [{"up[0]", "up[1]", "up[2]"}, {"up[3]", "up[4]"}]  # global expert indices
    for name in names:
        assert results[0][name]["keys"] == results[1][name]["keys"]
        ref, _ = _expert_single(name)
        got = results[0][name]["params"]
        assert torch.allclose(got[0][:3], ref[0][:3], rtol=0, atol=1e-6)  # rank 0's experts stepped 4 times
        for a, b in zip(got[1:], ref[1:], strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-6), name
        assert not torch.allclose(got[0][3:], ref[0][3:], atol=1e-6)  # rank 1 skipped a step there
        assert (tmp_path / f"experts_{name}").is_dir()


# ---- the batched step (foreach=True, test_foreach.py) under DDP and FSDP2 ----------------------------------


def _ddp_foreach_worker(rank, names):
    import torch.distributed as dist

    gathers = [0]
    real = dist.all_to_all_single

    def counting(*a, **k):
        gathers[0] += 1
        return real(*a, **k)

    dist.all_to_all_single = counting
    out = {}
    for name in names:
        gathers[0] = 0
        params = _params(HIDDEN, EMBED, HEAD, VECTORS)
        opt = _opt(name, _groups(params))
        for step in range(STEPS):
            _set_grads(params, step)
            opt.step()
        counts = opt.selection_counts() if name.startswith("meqmuon") else None
        out[name] = {"params": _flat(params), "state": opt.state_dict(), "counts": counts, "gathers": gathers[0]}
    return out


def test_ddp_batched_step_exchanges_once_per_bucket_and_matches_one_process(tmp_path):
    # Exchanges per step of these shapes: hidden (16, 32) with (32, 16) transposed, (24, 24) and the (8, 12)
    # conv view; NorMuon keeps (32, 16) apart; the embedding and head rules run in place on every rank.
    results = _spawn(_ddp_foreach_worker, tmp_path, runs("ddp-batched"))
    for name, gathers in ddp_exchanges().items():
        r0, r1 = results[0][f"{name}+foreach"], results[1][f"{name}+foreach"]
        ref_params, ref_opt = _single_process(f"{name}+f32")
        for a, b in zip(r0["params"], r1["params"], strict=True):
            assert torch.equal(a, b), name  # every rank ends with identical parameters
        _state_equal(r0["state"], r1["state"])
        for p, q in zip(r0["params"], _flat(ref_params), strict=True):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-5), (name, (p - q).abs().max().item())
        assert r0["gathers"] == r1["gathers"] == gathers * STEPS, name
        if name == "meqmuon":
            assert r0["counts"] == ref_opt.selection_counts()


def test_fsdp2_batched_step_equals_unsharded(tmp_path):
    """FSDP2 row shards (odd sizes, an empty shard) with the batched step: every rule equals the
    unsharded per-tensor step to 1e-5 (partial sums of squares reduced across shards round
    differently), MeqMuon's row/column choices exactly."""
    names = runs("fsdp2-batched")
    results = _spawn(_fsdp_worker, tmp_path, names)
    init = _flat(_params(FSDP_HIDDEN, FSDP_EMBED, FSDP_HEAD, FSDP_VECTORS))
    for name in names:
        base = name.partition("+")[0]
        ref_params, ref_opt = _single_process(f"{base}+f32", FSDP_HIDDEN, FSDP_EMBED, FSDP_HEAD,
                                                 FSDP_VECTORS)
        ref = _flat(ref_params)
        assert max((a - b).abs().max().item() for a, b in zip(ref, init, strict=True)) > 1e-3
        for r in range(WORLD):
            for i, (p, q) in enumerate(zip(results[r][name]["params"], ref, strict=True)):
                assert torch.allclose(p, q, rtol=0, atol=1e-5), (name, r, i, (p - q).abs().max().item())
        if base == "meqmuon":
            assert results[0][name]["counts"] == results[1][name]["counts"] == ref_opt.selection_counts()
