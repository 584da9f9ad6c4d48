"""Paired A/B of one optimizer's step across versions of the package, in one process, step by step.

Usage (two worktrees of the commits to compare, then)::

    git worktree add /tmp/old 941d234
    python benchmarks/step_ab.py /tmp/old . --model llama-60m --threads 1 --rounds 12

Each argument is a checkout; its ``meqmuon/`` is copied into a temporary folder under a package name of
its own (``v0``, ``v1``, ...; the optimizer core imports itself relatively), one optimizer per version is
built on the same parameter shapes, and the versions step alternately, round-robin (reversed every
other round), so that a shared, noisy machine loads every version alike. Reported: the process's CPU time
per step (``time.process_time``, all threads), median and minimum, which a busy machine disturbs far
less than wall time. Random gradients, fixed for every step (the step's cost does not depend on them).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import MODELS, model_shapes  # noqa: E402
from step_time import groups_of, make_params  # noqa: E402

from meqmuon.precision import detect_cpu_capability  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkouts", nargs="+", help="folders that hold a meqmuon/ package")
    ap.add_argument("--model", default="llama-60m", choices=sorted(MODELS))
    ap.add_argument("--optimizer", default="MeqMuon", help="a class of the package, e.g. MeqMuon, Muon")
    ap.add_argument("--foreach", action="store_true", help="the batched step (default: per-tensor)")
    ap.add_argument("--ns-dtype", default="auto", help="auto (the device's default), float32 or bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="step_ab_"))
    sys.path.insert(0, str(tmp))
    kw = {} if args.ns_dtype == "auto" else {"ns_dtype": getattr(torch, args.ns_dtype)}
    opts = {}
    for i, checkout in enumerate(args.checkouts):
        shutil.copytree(Path(checkout) / "meqmuon", tmp / f"v{i}")
        mod = importlib.import_module(f"v{i}")
        params = make_params(model_shapes(args.model), torch.device("cpu"))
        opt = getattr(mod, args.optimizer)(groups_of(params), lr=1e-3, foreach=args.foreach, **kw)
        opt.step()
        opt.step()
        opts[checkout] = opt
    times: dict[str, list[float]] = {c: [] for c in opts}
    order = list(opts)
    for r in range(args.rounds):
        for c in order if r % 2 == 0 else order[::-1]:
            t = time.process_time()
            opts[c].step()
            times[c].append(time.process_time() - t)
    shutil.rmtree(tmp)
    print(f"# {args.optimizer} step, {args.model}, {'batched' if args.foreach else 'per-tensor'}, NS dtype "
          f"{args.ns_dtype}, {args.threads} thread(s), {args.rounds} rounds, CPU {detect_cpu_capability()}")
    for c, ts in times.items():
        print(f"{c}: median {1000 * statistics.median(ts):.0f} ms, min {1000 * min(ts):.0f} ms (CPU time per step)")


if __name__ == "__main__":
    main()
