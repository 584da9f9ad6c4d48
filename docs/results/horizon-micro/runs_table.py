"""The README's "Runs so far" table from queue.sh's ``jobs.log`` and each run's ``summary.json``.

Usage: ``python docs/results/horizon-micro/runs_table.py /work/runs39`` (the run root of queue.sh).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

STEPS = 2248  # the 1x horizon of llama-micro (README, Setting)


def main(root: Path) -> None:
    starts: dict[tuple[str, float, int], str] = {}
    ends: dict[tuple[str, float, int], tuple[int, str]] = {}
    for line in (root / "jobs.log").read_text().splitlines():
        if m := re.match(r"start (\S+) (\S+) (\S+) (\d+)$", line):
            starts[(m[2], float(m[3]), int(m[4]))] = m[1]
        elif m := re.match(r"end \S+ (\S+) (\S+) (\d+) rc=0 wall_s=(\d+) git=(\S+)", line):
            ends[(m[1], float(m[2]), int(m[3]))] = (int(m[4]), m[5])
    print("| optimizer | lr | seed | final val loss | bits per byte | started (UTC) | wall time | tokens/s | commit |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---|")
    for (opt, lr, seed), t0 in starts.items():
        summary = root / ("1x-adamw" if opt == "adamw" else "1x") / f"{opt}-lr{lr:g}-s{seed}" / "summary.json"
        if (opt, lr, seed) in ends and summary.exists():
            s, (wall, commit) = json.loads(summary.read_text()), ends[(opt, lr, seed)]
            assert s["finished"] and s["steps"] == STEPS, summary
            print(f"| {opt} | {lr:g} | {seed} | {s['val_loss']:.4f} | {s['val_bpb']:.4f} | {t0[11:16]} | "
                  f"{wall / 60:.1f} min | {s['tokens_per_s']:,.0f} | {commit} |")
        else:
            print(f"| {opt} | {lr:g} | {seed} | not finished | | {t0[11:16]} | | | |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
