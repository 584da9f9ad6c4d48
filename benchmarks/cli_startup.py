"""Wall time of the ``meqmuon`` command where it does no work: ``--help``, a command's ``--help``, an argument error.

Each command is a fresh ``python -m meqmuon ...`` process (what a user waits for), ``--repeats`` times, the rows
interleaved so that a change in the machine's load touches every row alike; ``python -c pass`` and
``python -c "import torch"`` are the floor and the cost the command avoids. ``--root DIR`` times another
checkout (e.g. ``git archive <commit> | tar -x -C DIR``), imported through ``PYTHONPATH``.

    python benchmarks/cli_startup.py [--repeats 7] [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (label, arguments of ``python``)
ROWS: list[tuple[str, list[str]]] = [
    ("python -c pass", ["-c", "pass"]),
    ('python -c "import torch"', ["-c", "import torch"]),
    ("meqmuon --help", ["-m", "meqmuon", "--help"]),
    ("meqmuon train --help", ["-m", "meqmuon", "train", "--help"]),
    ("meqmuon diagnose imbalance --help", ["-m", "meqmuon", "diagnose", "imbalance", "--help"]),
    ("meqmuon train --lr abc", ["-m", "meqmuon", "train", "--lr", "abc"]),
]


def time_rows(repeats: int, root: Path) -> dict[str, list[float]]:
    """Seconds of each row's process, ``repeats`` times, rows interleaved."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    times: dict[str, list[float]] = {label: [] for label, _ in ROWS}
    for _ in range(repeats):
        for label, args in ROWS:
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, *args], env=env, cwd=root, capture_output=True)
            times[label].append(time.perf_counter() - t0)
            if done.returncode not in (0, 2):  # 2: the argument error
                raise RuntimeError(f"{label}: exit status {done.returncode}: {done.stderr.decode()[-2000:]}")
    return times


def table(times: dict[str, list[float]]) -> str:
    lines = ["| command | median s (min-max) |", "|---|---|"]
    for label, t in times.items():
        lines.append(f"| `{label}` | {statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="launches per row (7)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to time (default: this one)")
    args = ap.parse_args(argv)
    print(table(time_rows(args.repeats, args.root.resolve())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
