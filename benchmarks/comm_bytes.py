"""Bytes of the optimizer's collectives per step against the floor, and what it holds after a step against
AdamW, under torch's parallel layouts on real gloo process groups (issue 47's table).

Usage::

    python benchmarks/comm_bytes.py                          # DDP, FSDP2, HSDP 2x2, TP, FSDP2 x TP 2x2, EP
    python benchmarks/comm_bytes.py --layouts fsdp2 --layers 1 --optimizers muon   # seconds
    python benchmarks/comm_bytes.py --layouts ddp --vocab 32000 --optimizers meqmuon,muon,normuon

A Llama with Llama-60M's layer shapes (hidden 512, MLP 1376, ``--layers`` decoder layers, 4 by default),
sharded by torch itself as ``benchmarks/collectives.py`` shards it (FSDP2 per decoder layer and the root;
HSDP the same on a 2 x 2 ``(replicate, shard)`` mesh; torchtitan's TP plan; FSDP2 over TP on 2 x 2), or
replicated whole on every rank (DDP: the same batch on each, so every rank holds the gradients DDP's all-reduce
leaves; that all-reduce is not the optimizer's and is left out), a real forward and backward, then the
optimizer's steps with float32 Newton-Schulz (``--ns-dtype``). Under DDP the floor is each hidden direction once
to every other rank (``step_accounting.floor_bytes``), counted as a broadcast's: a rank that sends only the
directions it owns, once to each other rank, sends about ``(ranks - 1) / ranks`` of it. EP: a Qwen3-MoE of the
same widths (4 experts of MLP 688), its stacked experts ``Shard(0)`` over a 2-rank EP mesh and every other
parameter a ``Replicate()`` DTensor on it (issue 47 item 4), with random gradients of the parameters' placements
(transformers' experts do not run forward on an EP shard).

Per rank, on the third step (the first plans and creates state), :class:`step_accounting.StepMeter` counts
the bytes of the collectives the step issues; :func:`step_accounting.floor_bytes` gives the floor;
:func:`step_accounting.held_bytes` the optimizer's state and all else it holds after the step, set against
``torch.optim.AdamW``'s on the same model and layout. The table shows the worst rank.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from step_accounting import StepMeter, floor_bytes, held_bytes  # noqa: E402

#: Layout -> (processes, mesh shape, mesh dimension names).
LAYOUTS = {
    "ddp": (2, (2,), ("dp",)),
    "fsdp2": (2, (2,), ("dp",)),
    "hsdp": (4, (2, 2), ("replicate", "shard")),
    "tp": (2, (2,), ("tp",)),
    "fsdp2xtp": (4, (2, 2), ("dp", "tp")),
    "ep": (2, (2,), ("ep",)),
}


def llama(layers: int, moe: bool = False, vocab: int | None = None):
    """Llama-60M's layer shapes with ``layers`` decoder layers and a vocabulary of ``vocab`` (its own 32000 for
    ``None``), or a Qwen3-MoE of the same widths."""
    from transformers import LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from meqmuon.train.models import build_config

    cfg = build_config("llama-60m")
    cfg.num_hidden_layers = layers
    cfg.vocab_size = vocab or cfg.vocab_size
    torch.manual_seed(0)
    if not moe:
        return LlamaForCausalLM(cfg)
    heads, width = cfg.num_attention_heads, cfg.hidden_size
    moe_cfg = Qwen3MoeConfig(vocab_size=cfg.vocab_size, hidden_size=width, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=cfg.num_key_value_heads,
                             head_dim=width // heads, intermediate_size=cfg.intermediate_size,
                             moe_intermediate_size=cfg.intermediate_size // 2, num_experts=4, num_experts_per_tok=2,
                             tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(moe_cfg)


def expert_parallel(model, mesh) -> None:
    """Stacked experts (3-D parameters) ``Shard(0)`` over ``mesh``, every other parameter ``Replicate()``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if p.ndim == 3 else Replicate()
            setattr(module, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placement])))


def deepseek_tp_plan(model, tp) -> None:
    """torchtitan's tensor parallelism for DeepSeek-V3 without expert parallelism, on transformers' module names
    (``torchtitan/models/deepseek_v3/infra/parallelize.py`` ``apply_non_moe_tp`` at 018740b, ``apply_moe_ep_tp``
    and ``distributed/expert_parallel.py``'s ``TensorParallel``): ``q_b_proj``, ``kv_b_proj`` and the dense and
    shared MLPs' gate and up colwise, ``o_proj`` and the down projections rowwise; each stack of routed experts
    sharded on its intermediate dimension (``gate_up_proj (E, 2I, H)`` on 1, ``down_proj (E, H, I)`` on 2); the
    embedding rowwise and the head colwise over the vocabulary (as ``tp_plan``); every other parameter (``q_a_proj``,
    ``kv_a_proj_with_mqa``, the router, the norms: ``NoParallel`` and ``SequenceParallel``) ``Replicate()``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meqmuon.train.parallel import vocab_plan

    vocab_plan(model, tp)
    for layer in model.model.layers:
        mlp = "mlp.shared_experts" if hasattr(layer.mlp, "experts") else "mlp"
        parallelize_module(layer, tp, {"self_attn.q_b_proj": ColwiseParallel(),
                                       "self_attn.kv_b_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                                       f"{mlp}.gate_proj": ColwiseParallel(), f"{mlp}.up_proj": ColwiseParallel(),
                                       f"{mlp}.down_proj": RowwiseParallel()})
        experts = getattr(layer.mlp, "experts", None)
        for name, dim in (("gate_up_proj", 1), ("down_proj", 2)) if experts is not None else ():
            stack = getattr(experts, name).detach()
            setattr(experts, name, torch.nn.Parameter(distribute_tensor(stack, tp, [Shard(dim)])))
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                setattr(module, name, torch.nn.Parameter(distribute_tensor(p.detach(), tp, [Replicate()])))


def shard(model, layout: str, mesh) -> None:
    """``layout`` applied by torch's own APIs (``tests/test_layouts.py``'s FSDP2, ``meqmuon``'s TP plan, or for
    DeepSeek-V3 torchtitan's, :func:`deepseek_tp_plan`); DDP leaves the model whole (replicated: every rank built it
    from the same seed). ``fsdp2-rows``: FSDP2 with stacked experts on dimension 0 however many ranks (torch's default;
    ``fsdp2`` is torchtitan's choice). ``fsdp2xtp-dense``: FSDP2 over the Llama TP plan whatever the model (a MoE's
    experts outside it, repeated over ``tp``)."""
    from test_layouts import fsdp

    from meqmuon.train.parallel import tp_plan

    if layout == "ddp":
        return
    if layout.startswith("fsdp2xtp"):  # "fsdp2xtp-dense": the Llama plan, which leaves a MoE's experts repeated
        dense = layout == "fsdp2xtp-dense" or model.config.model_type != "deepseek_v3"
        (tp_plan if dense else deepseek_tp_plan)(model, mesh["tp"])
        fsdp(model, mesh["dp"])
    elif layout == "tp":
        tp_plan(model, mesh)
    elif layout == "ep":
        expert_parallel(model, mesh)
    else:
        fsdp(model, mesh, experts="rows" if layout == "fsdp2-rows" else "torchtitan")


def _grads(model, layout: str, step: int) -> None:
    if layout != "ep":
        ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        return
    torch.manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn_like(p)


def _measure(model, opt, layout: str, steps: int = 3) -> dict:
    meter = StepMeter()
    for step in range(steps):
        _grads(model, layout, step)
        if step == steps - 1:
            with meter:
                opt.step()
        else:
            opt.step()
        if step < steps - 1:
            opt.zero_grad()
    held = held_bytes(opt)
    opt.zero_grad()
    return {**meter.summary(), "held": held}


def _worker(rank, world, port, out_dir, layout, args):
    from torch.distributed.device_mesh import init_device_mesh

    import meqmuon

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _, shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dtype = getattr(torch, args.ns_dtype)
    rows = []
    adam_model = llama(args.layers, moe=layout == "ep", vocab=args.vocab)
    shard(adam_model, layout, mesh)
    adam = _measure(adam_model, torch.optim.AdamW(adam_model.parameters(), lr=1e-3), layout)
    for name in args.optimizers:
        for foreach in args.forms:
            model = llama(args.layers, moe=layout == "ep", vocab=args.vocab)
            shard(model, layout, mesh)
            opt = meqmuon.build_optimizer(name, model, foreach=foreach, ns_dtype=dtype)
            row = _measure(model, opt, layout)
            row.update(layout=layout, world=world, optimizer=name, form="batched" if foreach else "per-tensor",
                       floor=floor_bytes(opt, dtype.itemsize), adamw=adam["held"], rank=rank)
            rows.append(row)
    torch.save(rows, os.path.join(out_dir, f"{layout}-{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure(args: argparse.Namespace) -> list[list[dict]]:
    """Per layout of ``args.layouts`` and optimizer/form: the rows of every rank."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            world = LAYOUTS[layout][0]
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_worker, args=(world, port, tmp, layout, args), nprocs=world, join=True)
            per_rank = [torch.load(os.path.join(tmp, f"{layout}-{r}.pt")) for r in range(world)]
            out += [list(rows) for rows in zip(*per_rank, strict=True)]
    return out


def ratio(x: float, floor: float) -> str:
    """``x / floor`` as ``1.00x``; ``0 B`` or ``x B (floor 0)`` where the floor is 0."""
    if floor:
        return f"{x / floor:.2f}x"
    return "0 B (floor 0)" if not x else f"{x:.0f} B (floor 0)"


def table(results: list[list[dict]]) -> str:
    lines = ["| layout | ranks | optimizer | form | sent / floor | received / floor | collectives | held: state | "
             "held: other / params | held / AdamW's |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rows in results:
        r0 = rows[0]
        sent = max(rows, key=lambda r: r["sent"] / max(r["floor"], 1))
        recv = max(rows, key=lambda r: r["received"] / max(r["floor"], 1))
        mem = max(rows, key=lambda r: r["held"]["total"] / r["adamw"]["total"])
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r0["calls"].items())) or "none"
        groups = sorted({g for r in rows for g in r["bytes_by_group_size"]}, key=str)
        calls += f" (groups of {', '.join(map(str, groups))})" if groups else ""
        held, adamw = mem["held"], mem["adamw"]
        lines.append(
            f"| {r0['layout']} | {r0['world']} | {r0['optimizer']} | {r0['form']} | "
            f"{ratio(sent['sent'], sent['floor'])} | {ratio(recv['received'], recv['floor'])} | {calls} | "
            f"{held['state'] / 2**20:.2f} MiB | {held['other'] / held['params']:.2f}x | "
            f"{held['total'] / adamw['total']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), type=lambda s: s.split(","))
    parser.add_argument("--optimizers", default="meqmuon", type=lambda s: s.split(","))
    parser.add_argument("--layers", default=4, type=int)
    parser.add_argument("--vocab", default=None, type=int, help="vocabulary size (default: Llama-60M's 32000)")
    parser.add_argument("--ns-dtype", default="float32")
    parser.add_argument("--forms", default="per-tensor", type=lambda s: [f == "batched" for f in s.split(",")])
    args = parser.parse_args(argv)
    for layout in args.layouts:
        if layout not in LAYOUTS:
            parser.error(f"--layouts: unknown layout {layout!r} (expected some of {', '.join(LAYOUTS)})")
    from meqmuon.precision import detect_cpu_capability

    print(f"# Llama-60M shapes x {args.layers} layers, CPU {detect_cpu_capability()}, torch {torch.__version__}, gloo, "
          f"ns_dtype {args.ns_dtype}; worst rank")
    print(table(measure(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
