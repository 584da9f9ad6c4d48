"""DDP scaling of the optimizer step: 1 rank vs N ranks (gloo, CPU), MeqMuon on a paper model's shapes.

Usage::

    python benchmarks/scaling.py --model llama-60m --cores 2 --ranks 1 2 --repeats 3

Each run gives every rank ``cores // ranks`` torch threads, so 1 rank uses all cores and 2 ranks
one core each: the comparison is at equal hardware. Gradients are identical random tensors on
every rank (as after DDP's all-reduce). The step is timed between barriers; median over repeats.
"""

from __future__ import annotations

import argparse
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
from step_time import groups_of, make_params  # noqa: E402

import meqmuon  # noqa: E402


def _worker(rank, world, port, threads, model, name, warmup, repeats, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    params = make_params(model_shapes(model), torch.device("cpu"))
    opt = meqmuon.build_optimizer(name, groups_of(params), lr=1e-3)
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t)
    if rank == 0:
        Path(out).write_text(str(statistics.median(times)))
    dist.destroy_process_group()
    os._exit(0)


def run(world, cores, model, name, warmup, repeats, threads=None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t")
        args = (world, port, threads or max(1, cores // world), model, name, warmup, repeats, out)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        return float(Path(out).read_text())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-60m", choices=MODELS)
    ap.add_argument("--optimizer", default="meqmuon")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads-per-rank", type=int, default=None, help="fixed threads per rank instead of cores/ranks")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    res = {
        w: run(w, args.cores, args.model, args.optimizer, args.warmup, args.repeats, args.threads_per_rank)
        for w in args.ranks
    }
    base = res[args.ranks[0]]
    print(
        f"### DDP scaling, {args.optimizer} on {args.model} shapes, {args.cores} cores "
        "(threads per rank = cores / ranks)"
    )
    print()
    print("| ranks | threads/rank | median step (ms) | / 1 rank |")
    print("|---:|---:|---:|---:|")
    for w, t in res.items():
        print(f"| {w} | {args.threads_per_rank or max(1, args.cores // w)} | {t * 1e3:.0f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
