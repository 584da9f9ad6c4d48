"""What an optimizer holds after a step, and what its collectives carry, under torch's parallel layouts.

Usage::

    python benchmarks/optimizer_memory.py                                   # Llama-60M shapes, MeqMuon and AdamW
    python benchmarks/optimizer_memory.py --model llama-tiny --layouts fsdp2,tp

Each layout runs in its own gloo process group on the CPU (``benchmarks/collectives.py``'s models and
sharding; HSDP is ``(Replicate(), Shard(0))`` on a 2 x 2 mesh). After the third step every rank sums the
bytes of every tensor storage reachable from the optimizer (:func:`meqmuon.optim.memory.optimizer_held_bytes`):
its state, and everything else it keeps (workspaces, whole copies, index maps); the same for torch's AdamW
on the same layout. During the third step it counts the bytes of the optimizer's own collectives (what it
sends: the inputs it hands to them) against the floor: each local element of a hidden matrix's piece sent
once as the Newton-Schulz input and its direction sent back once by its owner, in float32
(``ns_dtype=float32``). Rank 0's numbers.
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
import collectives  # noqa: E402

#: Layout -> (processes, mesh shape).
LAYOUTS = {"fsdp2": (2, (2,)), "hsdp": (4, (2, 2)), "tp": (2, (2,)), "fsdp2xtp": (4, (2, 2))}


def _count_bytes(total: list[int], active: list[bool]) -> None:
    """Wrap the collectives an optimizer step makes: bytes of their inputs and outputs on this rank."""
    def nbytes(t):
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else sum(map(nbytes, t))

    for name in collectives.COLLECTIVES:
        orig = getattr(dist, name)

        def wrapped(*args, _orig=orig, _name=name, **kwargs):
            if active[0]:  # what this rank sends: the input (the second argument of the gathers and all_to_all)
                total[0] += nbytes(args[0] if _name in ("all_reduce", "broadcast") else args[1])
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapped)


def _shard(model, layout: str, mesh_shape) -> None:
    if layout != "hsdp":
        return collectives._shard(model, layout, mesh_shape)
    from test_layouts import fsdp
    from torch.distributed.device_mesh import init_device_mesh

    fsdp(model, init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")))


def _floor(opt) -> int:
    """2 x 4 B per local element of the pieces of hidden matrices (float32 Newton-Schulz)."""
    n = 0
    for group in opt.param_groups:
        if group.get("kind") != "hidden":
            continue
        for p in group["params"]:
            n += (p.to_local() if hasattr(p, "to_local") else p).numel()
    return 8 * n


def _worker(rank, world, port, out_dir, layout, mesh_shape, args):
    import meqmuon
    from meqmuon.optim.memory import optimizer_held_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sent, active = [0], [False]
    _count_bytes(sent, active)
    rows = []
    for name in args.optimizers:
        model = collectives._model(args.model, 1)
        _shard(model, layout, mesh_shape)
        kw = {"ns_dtype": torch.float32} if "ns_dtype" in meqmuon.valid_hyperparameters(name) else {}
        opt = meqmuon.build_optimizer(name, model, foreach=args.foreach, **kw)
        ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        for step in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            sent[0] = 0
            active[0] = step == 2
            opt.step()
            active[0] = False
            opt.zero_grad()
        held = optimizer_held_bytes(opt)
        rows.append((layout, world, name, held["state"], held["other"], held["params"], sent[0], _floor(opt)))
    if rank == 0:
        torch.save(rows, os.path.join(out_dir, f"{layout}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure(args: argparse.Namespace) -> list[tuple]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            world, mesh_shape = LAYOUTS[layout]
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_worker, args=(world, port, tmp, layout, mesh_shape, args), nprocs=world, join=True)
            rows += torch.load(os.path.join(tmp, f"{layout}.pt"))
    return rows


def table(rows: list[tuple]) -> str:
    adamw = {(r[0]): r[3] + r[4] for r in rows if r[2] == "adamw"}
    lines = ["| layout | ranks | optimizer | state MB | held beyond state MB | held / state | held / AdamW's "
             "| bytes per step / floor |", "|---|---|---|---|---|---|---|---|"]
    for layout, world, name, state, other, _, sent, floor in rows:
        vs = f"{(state + other) / adamw[layout]:.2f}x" if layout in adamw else "-"
        ratio = f"{sent / floor:.2f}x" if name != "adamw" and floor else "-"
        lines.append(f"| {layout} | {world} | {name} | {state / 2**20:.2f} | {other / 2**20:.2f} | "
                     f"{(state + other) / state:.2f}x | {vs} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-60m")
    parser.add_argument("--layouts", default="fsdp2,hsdp,tp,fsdp2xtp", type=lambda s: s.split(","))
    parser.add_argument("--optimizers", default="meqmuon,adamw", type=lambda s: s.split(","))
    parser.add_argument("--foreach", action="store_true", help="the batched step (default: per-tensor)")
    args = parser.parse_args(argv)
    from meqmuon.precision import detect_cpu_capability

    print(f"# {args.model}, CPU {detect_cpu_capability()}, torch {torch.__version__}, gloo")
    print(table(measure(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
