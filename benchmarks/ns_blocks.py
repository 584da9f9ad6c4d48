"""One Newton-Schulz iteration with the symmetric products block-wise against plain, per hidden shape.

Usage::

    PYTHONPATH=. python benchmarks/ns_blocks.py --threads 2

For every distinct hidden-matrix shape of the paper's six models (plus the tiny CPU preset's), times
``meqmuon.orthogonalization.ns_step`` in the NS dtype (``--dtype``, default ``auto``: bf16 where the CPU
runs it natively, float32 elsewhere; the table in docs/benchmarks.md is bf16) with
``SYMMETRIC_MIN`` set so that the block path is taken and so that it is not, interleaved, best of
several rounds, and checks whether the two outputs are equal bit for bit. ``SYMMETRIC_MIN`` is chosen from this table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import MODELS, model_shapes  # noqa: E402

from meqmuon import orthogonalization as F  # noqa: E402  (SYMMETRIC_MIN is read there)
from meqmuon.precision import detect_cpu_capability, resolve_ns_dtype  # noqa: E402


def time_step(Y: torch.Tensor, symmetric: bool, repeats: int) -> tuple[float, torch.Tensor]:
    saved = F.SYMMETRIC_MIN
    F.SYMMETRIC_MIN = 1 if symmetric else 10**9
    try:
        k = min(Y.shape)
        scratch = (torch.empty(k, k, dtype=Y.dtype), torch.empty(k, k, dtype=Y.dtype))
        out = torch.empty_like(Y)
        F.ns_step(Y, out=out, scratch=scratch)  # warm-up
        t = time.perf_counter()
        for _ in range(repeats):
            F.ns_step(Y, out=out, scratch=scratch)
        return (time.perf_counter() - t) / repeats, out.clone()
    finally:
        F.SYMMETRIC_MIN = saved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="NS dtype (auto: bf16 where the CPU runs it natively, else float32)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_ns_dtype(None if args.dtype == "auto" else getattr(torch, args.dtype), "cpu")
    shapes = sorted({s for m in MODELS for s in model_shapes(m)["hidden"]}, key=lambda s: min(s))
    print(f"- date {date.today()}, machine: {platform.processor() or platform.machine()}, "
          f"CPU capability {detect_cpu_capability()}, {torch.get_num_threads()} thread"
          f"{'s' * (torch.get_num_threads() != 1)}, torch {torch.__version__}; "
          f"{str(dtype).removeprefix('torch.')}; SYMMETRIC_MIN = {F.SYMMETRIC_MIN}")
    print("\n| shape | k | plain (ms) | blocks (ms) | blocks / plain | bit-equal |\n|---|---:|---:|---:|---:|---|")
    g = torch.Generator().manual_seed(0)
    for m, n in shapes:
        Y = (torch.randn(m, n, generator=g) / max(m, n) ** 0.5).to(dtype)
        repeats = max(3, int(2e8 / (m * n * min(m, n))))
        best = {True: float("inf"), False: float("inf")}
        outs = {}
        for _ in range(args.rounds):
            for sym in (False, True):
                t, outs[sym] = time_step(Y, sym, repeats)
                best[sym] = min(best[sym], t)
        ratio = best[True] / best[False]
        print(f"| {m} x {n} | {min(m, n)} | {best[False] * 1e3:.3f} | {best[True] * 1e3:.3f} | {ratio:.3f} | "
              f"{torch.equal(outs[True], outs[False])} |")


if __name__ == "__main__":
    main()
