"""DDP scaling of the optimizer step: 1 rank vs N ranks (gloo, CPU), on a registry model's shapes.

Usage::

    python benchmarks/scaling.py --model llama-60m --world 2 --threads-per-rank 1 --repeats 7

One group of ``--world`` processes times both steps, alternating round by round: rank 0 steps an
optimizer over a group of its own (one process, as without DDP) while the other ranks wait at a
barrier, then all ranks step the same optimizer over the whole group. The two times of a round
are taken seconds apart, so a slow phase of the (shared, noisy) host slows both sides of that
round's ratio; the median and range of the per-round ratios are the result. Gradients are
identical random tensors on every rank (as after DDP's all-reduce); each step is timed between
barriers.

Threads: ``--threads-per-rank T`` gives every process T threads in both steps (the same hardware
per rank: the N-rank step uses N times the cores). Without it the 1-rank step gets ``--cores``
threads and each rank of the N-rank step ``cores // world`` (equal total hardware).
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
from step_time import groups_of, make_params  # noqa: E402

import meqmuon  # noqa: E402


def _timed_step(opt, report: bool) -> float:
    """One step of ``opt`` (``None``: only the barriers) between barriers; its time if ``report``, else 0."""
    dist.barrier()
    t = time.perf_counter()
    if opt is not None:
        opt.step()
    dist.barrier()
    return time.perf_counter() - t if report else 0.0


def _worker(rank, world, port, threads_solo, threads_dist, model, name, warmup, repeats, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    solo_group = dist.new_group([0])  # every rank must call new_group; only rank 0 is in it
    shapes = model_shapes(model)
    solo = None
    if rank == 0:
        solo = meqmuon.build_optimizer(name, groups_of(make_params(shapes, "cpu")), lr=1e-3, process_group=solo_group)
    spread = meqmuon.build_optimizer(name, groups_of(make_params(shapes, "cpu")), lr=1e-3)
    times = {"1": [], str(world): []}
    for r in range(warmup + repeats):
        torch.set_num_threads(threads_solo)
        t1 = _timed_step(solo, rank == 0)
        torch.set_num_threads(threads_dist)
        tn = _timed_step(spread, rank == 0)
        if r >= warmup:
            times["1"].append(t1)
            times[str(world)].append(tn)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()
    os._exit(0)  # gloo sometimes aborts at exit after the work is done


def run(world, cores, model, name, warmup, repeats, threads_per_rank=None):
    """Per-round step times ``{"1": [...], str(world): [...]}`` in seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads_solo = threads_per_rank or cores
    threads_dist = threads_per_rank or max(1, cores // world)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t")
        args = (world, port, threads_solo, threads_dist, model, name, warmup, repeats, out)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        return json.loads(Path(out).read_text()), threads_solo, threads_dist


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-60m", choices=MODELS)
    ap.add_argument("--optimizer", default="meqmuon")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--world", type=int, default=2, help="ranks of the distributed step")
    ap.add_argument("--threads-per-rank", type=int, default=None, help="threads of every process in both steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    times, t_solo, t_dist = run(
        args.world, args.cores, args.model, args.optimizer, args.warmup, args.repeats, args.threads_per_rank
    )
    one, many = times["1"], times[str(args.world)]
    ratios = sorted(b / a for a, b in zip(one, many, strict=True))
    print(f"### DDP scaling, {args.optimizer} on {args.model} shapes ({args.repeats} paired rounds)")
    print()
    print(f"- command: `python benchmarks/scaling.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(f"- torch {torch.__version__}, {args.cores} cores")
    print()
    print("| ranks | threads/rank | median step (ms) |")
    print("|---:|---:|---:|")
    print(f"| 1 | {t_solo} | {statistics.median(one) * 1e3:.0f} |")
    print(f"| {args.world} | {t_dist} | {statistics.median(many) * 1e3:.0f} |")
    print()
    print(
        f"{args.world} ranks / 1 rank, per round: median {statistics.median(ratios):.2f}, "
        f"range {ratios[0]:.2f}-{ratios[-1]:.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
