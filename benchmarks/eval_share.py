"""Share of a short run's wall time spent in evaluation: ``meqmuon train --model llama-tiny --steps 20``.

Runs the command in this process (``meqmuon.cli.main``, every other flag at its default, a fresh
``--out``; the data cache is warmed by a first untimed run so that the BPE training does not count)
and times each call of the loop's ``evaluate`` by wrapping it. Reports the number of evaluations,
the seconds in them, the wall time of ``main`` (data, model, training, evaluation, checkpoints) and
the share. Extra flags after ``--`` are passed to ``meqmuon train`` (e.g. ``-- --eval-every 1``
reproduces the old default of a 20-step run).

    PYTHONPATH=. python benchmarks/eval_share.py --steps 20 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path

from meqmuon import cli
from meqmuon.precision import detect_cpu_capability
from meqmuon.train import loop as loop_mod


def one_run(steps: int, extra: list[str], out: Path) -> tuple[int, float, float]:
    """``(evaluations, seconds in evaluate, wall seconds of meqmuon train)`` for one fresh run."""
    spent: list[float] = []
    inner = loop_mod.evaluate

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    loop_mod.evaluate = timed
    try:
        t0 = time.perf_counter()
        code = cli.main(["train", "--model", "llama-tiny", "--steps", str(steps), "--out", str(out), "--quiet",
                         *extra])
        wall = time.perf_counter() - t0
    finally:
        loop_mod.evaluate = inner
    if code != 0:
        raise SystemExit(f"meqmuon train exited with {code}")
    return len(spent), sum(spent), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("extra", nargs="*", help="flags for meqmuon train (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one_run(2, args.extra, Path(tmp) / "warm")  # builds the data cache, untimed
        runs = [one_run(args.steps, args.extra, Path(tmp) / f"r{i}") for i in range(args.repeats)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"CPU {detect_cpu_capability()}, {date.today()}, commit {commit}, flags {args.extra or '(defaults)'}")
    for n, e, w in runs:
        print(f"  {n} evaluations, {e:.2f} s of {w:.2f} s wall: {100 * e / w:.1f} %")
    share = statistics.median(e / w for _, e, w in runs)
    print(f"median evaluation share: {100 * share:.1f} %  (median wall {statistics.median(w for *_, w in runs):.2f} s)")


if __name__ == "__main__":
    main()
