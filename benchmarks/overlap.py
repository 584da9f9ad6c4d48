"""The exchange overlapped or not (the optimizers' ``overlap``): one step each way, alternating round by round.

Usage::

    python benchmarks/overlap.py --model llama-60m --layout fsdp2 --world 2 --repeats 7

``--world`` gloo processes step two optimizers over the same parameters and gradients (a registry model's shapes,
its hidden matrices only: the exchange's part of the step), one with ``overlap=False`` and one with ``overlap=True``,
each step timed on rank 0 between barriers, the two a round apart by seconds, so a slow phase of the (shared, noisy)
host slows both sides of that round's ratio; the median and range of the per-round ratios (overlapped / not) are
the result. ``--layout ddp``: plain tensors, the same on every rank (as after DDP's all-reduce); ``fsdp2``: DTensors
``Shard(0)`` over the ranks (``distribute_tensor``, as ``fully_shard`` shards).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import MODELS, model_shapes  # noqa: E402
from step_time import make_params  # noqa: E402

import meqmuon  # noqa: E402
from meqmuon.precision import detect_cpu_capability  # noqa: E402


def _params(shapes: dict, layout: str) -> list[torch.nn.Parameter]:
    params = make_params({"hidden": shapes["hidden"]}, "cpu")["hidden"]
    if layout == "ddp":
        return params
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = []
    for p in params:
        q = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        q.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
        out.append(q)
    return out


def _timed(opt) -> float:
    dist.barrier()
    t = time.perf_counter()
    opt.step()
    dist.barrier()
    return time.perf_counter() - t


def _worker(rank, world, port, threads, model, name, layout, ns, warmup, repeats, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(threads)
    shapes = model_shapes(model)
    opts = {o: meqmuon.build_optimizer(name, [{"params": _params(shapes, layout), "kind": "hidden"}], lr=1e-3,
                                       ns_dtype=getattr(torch, ns), overlap=o) for o in (False, True)}
    times = {"serial": [], "overlap": []}
    for r in range(warmup + repeats):
        t0, t1 = _timed(opts[False]), _timed(opts[True])
        if r >= warmup:
            times["serial"].append(t0)
            times["overlap"].append(t1)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()
    os._exit(0)  # gloo sometimes aborts at exit after the work is done


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-60m", choices=MODELS)
    ap.add_argument("--optimizer", default="meqmuon")
    ap.add_argument("--layout", default="fsdp2", choices=("ddp", "fsdp2"))
    ap.add_argument("--ns-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t")
        mp.spawn(_worker, args=(args.world, port, args.threads_per_rank, args.model, args.optimizer, args.layout,
                                args.ns_dtype, args.warmup, args.repeats, out), nprocs=args.world, join=True)
        times = json.loads(Path(out).read_text())
    ratios = sorted(b / a for a, b in zip(times["serial"], times["overlap"], strict=True))
    print(f"- `python benchmarks/overlap.py {' '.join(argv if argv is not None else sys.argv[1:])}`: "
          f"{detect_cpu_capability()}, torch {torch.__version__}, gloo, {args.world} ranks x "
          f"{args.threads_per_rank} threads")
    print(f"  - {args.optimizer}, {args.layout}, {args.ns_dtype} Newton-Schulz: median step "
          f"{statistics.median(times['serial']) * 1e3:.0f} ms blocking, {statistics.median(times['overlap']) * 1e3:.0f}"
          f" ms overlapped; overlapped / blocking per round: median {statistics.median(ratios):.2f}, range "
          f"{ratios[0]:.2f}-{ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
