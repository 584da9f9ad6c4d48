"""Collectives per optimizer step under torch's parallel layouts: flat in depth, as op counts are.

Usage::

    python benchmarks/collectives.py                                  # Llama-60M: FSDP2, TP, FSDP2 x TP, DDP
    python benchmarks/collectives.py --model llama-tiny --depths 1,2  # seconds; what tests/test_benchmarks.py runs

The layouts run in gloo process groups on the CPU (2 processes; FSDP2 over TP 4; layouts of one world
size share one launch, each with its own device mesh): the paper's
model from the registry (``--depths 2`` doubles its decoder layers), sharded by torch itself
(``fully_shard`` per decoder layer and the root; torchtitan's TP plan, ``tests/test_layouts.py``), a
real forward and backward on a small batch, then the optimizer's steps. Every ``torch.distributed``
collective a step calls is counted (by name), on the third step (the first plans the step and creates
state). The owner path (``owners.py``, ``exchange.py``: Newton-Schulz inputs to owner ranks, directions
back) issues one pair of ``all_to_all_single`` per shape bucket; FSDP2's row shards two per shape bucket
of hidden matrices plus the elementwise rules' sums; DDP one ``all_gather_into_tensor`` per bucket
(batched) or one ``broadcast`` per owned tensor (per-tensor). Counts are per rank and identical on every
rank.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

#: The collectives counted: every ``torch.distributed`` call an optimizer step can make.
COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
               "reduce_scatter_tensor")
#: Layout -> (processes, mesh shape).
LAYOUTS = {"ddp": (2, (2,)), "fsdp2": (2, (2,)), "tp": (2, (2,)), "fsdp2xtp": (4, (2, 2))}


def _count_collectives(counter: Counter, active: list[bool]) -> None:
    for name in COLLECTIVES:
        orig = getattr(dist, name)

        def wrapped(*args, _orig=orig, _name=name, **kwargs):
            if active[0]:
                counter[_name] += 1
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapped)


def _model(name: str, depth: int):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    from meqmuon.train.models import build_config

    cfg = build_config(name)
    cfg.num_hidden_layers *= depth
    torch.manual_seed(0)
    cls = Qwen2ForCausalLM if cfg.model_type == "qwen2" else LlamaForCausalLM
    return cls(cfg)


def _shard(model, layout: str, mesh_shape) -> None:
    from test_layouts import fsdp
    from torch.distributed.device_mesh import init_device_mesh

    from meqmuon.train.parallel import tp_plan

    if layout == "ddp":
        return
    if layout == "fsdp2xtp":
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        tp_plan(model, mesh["tp"])
        fsdp(model, mesh["dp"])
    elif layout == "tp":
        tp_plan(model, init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",)))
    else:
        fsdp(model, init_device_mesh("cpu", mesh_shape))


def _worker(rank, world, port, out_dir, layouts, args):
    import meqmuon

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counter: Counter = Counter()
    active = [False]
    _count_collectives(counter, active)
    rows = []
    for layout in layouts:
        for depth in args.depths:
            for name in args.optimizers:
                for foreach in args.forms:
                    model = _model(args.model, depth)
                    _shard(model, layout, LAYOUTS[layout][1])
                    opt = meqmuon.build_optimizer(name, model, foreach=foreach)
                    ids = torch.randint(0, model.config.vocab_size, (1, 8),
                                        generator=torch.Generator().manual_seed(0))
                    for step in range(3):
                        model(input_ids=ids, labels=ids).loss.backward()
                        counter.clear()
                        active[0] = step == 2
                        opt.step()
                        active[0] = False
                        opt.zero_grad()
                    rows.append((layout, world, name, "batched" if foreach else "per-tensor", depth,
                                 model.config.num_hidden_layers, dict(counter)))
    if rank == 0:
        torch.save(rows, os.path.join(out_dir, f"world{world}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure(args: argparse.Namespace) -> list[tuple]:
    """Run every layout of ``args.layouts`` (one launch per world size, in the order given); returns one row
    per (layout, optimizer, form, depth)."""
    by_world: dict[int, list[str]] = {}
    for layout in args.layouts:
        by_world.setdefault(LAYOUTS[layout][0], []).append(layout)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, layouts in by_world.items():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_worker, args=(world, port, tmp, layouts, args), nprocs=world, join=True)
            rows += torch.load(os.path.join(tmp, f"world{world}.pt"))
    order = {layout: i for i, layout in enumerate(args.layouts)}
    return sorted(rows, key=lambda row: order[row[0]])  # stable: each layout's rows as they were measured


def table(rows: list[tuple]) -> str:
    lines = ["| layout | ranks | optimizer | form | layers | collectives per step (per rank) | total |",
             "|---|---|---|---|---|---|---|"]
    for layout, world, name, form, _, layers, counts in rows:
        what = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        lines.append(f"| {layout} | {world} | {name} | {form} | {layers} | {what} | {sum(counts.values())} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-60m")
    parser.add_argument("--layouts", default="fsdp2,tp,fsdp2xtp,ddp", type=lambda s: s.split(","))
    parser.add_argument("--optimizers", default="meqmuon,muon", type=lambda s: s.split(","))
    parser.add_argument("--depths", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--forms", default="per-tensor,batched",
                        type=lambda s: [f == "batched" for f in s.split(",")])
    args = parser.parse_args(argv)
    for layout in args.layouts:
        if layout not in LAYOUTS:
            parser.error(f"--layouts: unknown layout {layout!r} (expected some of {', '.join(LAYOUTS)})")
    from meqmuon.precision import detect_cpu_capability

    print(f"# {args.model}, CPU {detect_cpu_capability()}, torch {torch.__version__}, gloo")
    print(table(measure(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
