"""Every layout torch's parallel APIs give a transformer: the optimizer's update equals one process's.

Real ``transformers`` models from tiny configs (``zoo.py``), sharded by torch itself: tensor parallelism
with ``parallelize_module`` (the torchtitan plan: colwise q/k/v/gate/up, rowwise o/down, a vocabulary-
parallel embedding and head) on a TP mesh of 2, FSDP2 (``fully_shard``) on the fused and transposed
models (Phi3's ``qkv_proj`` with GQA sizes and ``gate_up_proj``, GPT-2's ``Conv1D`` ``c_attn``) and the
experts of Qwen3-MoE, DBRX (folded) and GPT-OSS (interleaved), and FSDP2 over TP on a 2 x 2 mesh.

Each worker runs the model's real forward and backward under the layout, then feeds the very same
gradients (``full_tensor()``) to an optimizer of the unsharded model, so that the only difference left
is the optimizer's: float32 Newton-Schulz (``ns_dtype`` pinned, whatever the CPU) and every parameter
compared with ``full_tensor()`` after several steps. The owner path (``owners.py``) runs one process's
code on whole tensors, so the bound is 1e-6 and the observed differences are 0 where the owner's step
form is the reference's.

Workers end with ``destroy_process_group`` and ``os._exit`` (gloo may abort at interpreter exit).
"""

from __future__ import annotations

import copy
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zoo

import meqmuon
from meqmuon.optim.distributed import is_dtensor

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

STEPS = 3
#: Optimizers compared under every layout: every rule family (MeqMuon's three rules, Moonlight's Muon
#: with AdamW, NorMuon's per-row state, MuonEq's pre-Newton-Schulz equilibration, SCALE's statistics).
NAMES = ("meqmuon", "muon", "normuon", "muoneq-r", "scale")
NAMES_TP = [*NAMES, *(n + "+foreach" for n in NAMES), "meqmuon+compile", "meqmuon+foreach+compile"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, tmp_path, *args, world=2):
    port = _free_port()
    mp.spawn(_entry, args=(fn, port, str(tmp_path), args, world), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _entry(rank, fn, port, tmp, args, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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


def _optimizer(name: str, model, **kw):
    """``name[+foreach][+compile]``: every Muon-family optimizer with float32 Newton-Schulz."""
    base, *flags = name.split("+")
    if base != "scale":
        kw["ns_dtype"] = torch.float32
    return meqmuon.build_optimizer(base, model, lr=0.02, weight_decay=0.1, foreach="foreach" in flags,
                                   compile="compile" in flags, **kw)


def tp_plan(model, mesh) -> None:
    """torchtitan's Llama TP plan (``torchtitan/models/llama3/infra/parallelize.py``) on a transformers
    Llama: colwise q/k/v/gate/up, rowwise o/down, a vocabulary-parallel embedding (rows) and head."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
        })


def fsdp(model, mesh) -> None:
    """FSDP2 as torchtitan applies it: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None) or getattr(
        getattr(model, "transformer", None), "h", None) or []
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _batch(model_name: str, step: int) -> dict:
    ids = torch.randint(0, zoo.VOCAB, zoo.TOKENS, generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids}


def compare_under_layout(model_name: str, names, shard, steps: int = STEPS) -> dict:
    """Per optimizer: the largest difference of any parameter from the unsharded optimizer fed the same
    gradients, and the parameters' placements."""
    out = {}
    for name in names:
        model, _ = getattr(zoo, model_name)()
        ref = copy.deepcopy(model)
        init = {n: p.detach().clone() for n, p in ref.named_parameters()}
        shard(model)
        opt, ref_opt = _optimizer(name, model), _optimizer(name, ref)
        for step in range(steps):
            model(**_batch(model_name, step)).loss.backward()
            grads = {n: (p.grad.full_tensor() if is_dtensor(p.grad) else p.grad) for n, p in model.named_parameters()}
            for n, p in ref.named_parameters():
                p.grad = grads[n].clone()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        full = dict(model.named_parameters())
        diff = moved = 0.0
        for n, q in ref.named_parameters():
            p = full[n].full_tensor() if is_dtensor(full[n]) else full[n]
            diff = max(diff, (p.detach() - q.detach()).abs().max().item())
            moved = max(moved, (q.detach() - init[n]).abs().max().item())
        out[name] = {"diff": diff, "moved": moved,
                     "placements": {n: str(tuple(p.placements)) for n, p in full.items() if is_dtensor(p)}}
    return out


def _tp_worker(rank, names):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return compare_under_layout("llama", names, lambda m: tp_plan(m, mesh))


def test_tensor_parallel_llama_equals_one_process(tmp_path):
    names = NAMES_TP
    results = _spawn(_tp_worker, tmp_path, names)
    placements = results[0]["meqmuon"]["placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == "(Shard(dim=0),)"  # colwise
    assert placements["model.layers.0.mlp.down_proj.weight"] == "(Shard(dim=1),)"  # rowwise
    assert placements["model.embed_tokens.weight"] == "(Shard(dim=0),)"  # vocabulary rows
    for r in range(2):
        for name in names:
            res = results[r][name]
            assert res["moved"] > 1e-3, name  # the optimizer really stepped
            assert res["diff"] <= 1e-6, (name, r, res["diff"])
