"""Every finished run of this directory's queue, kept in git (``runs.json``), and the README's "Every run" table.

Usage::

    python docs/results/field-2026/runs_table.py /work/runs58   # add the new finished runs, print the table
    python docs/results/field-2026/runs_table.py                # the table from the kept runs only

A run directory (checkpoints included) lives outside git and may not outlive the machine; what the comparisons
need of it is kept in ``runs.json`` beside this script, one row per finished run: ``setting`` (queue.sh's: p600,
1x, 4x, r1x, w24, w48, w96), ``optimizer``, ``lr``, ``seed``, ``final val loss`` (the rows ``pairs.py`` and
``meqmuon.train.compare.best_lrs`` read), ``val_bpb``, ``tokens_per_s``, ``wall_s``, ``started``, ``commit``,
``weight_decay``, ``cpu_capability``, ``starts``; from queue.sh's ``jobs.log`` and each run's ``summary.json`` and
``config.json``. A row already kept is never replaced. A run that was interrupted and resumed from its last
checkpoint has ``starts`` > 1: ``started`` is its first start, ``wall_s`` the last start's time only (the queue logs
no end for an interrupted start).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEPT = HERE / "runs.json"
#: queue.sh's settings: their length in updates.
STEPS = {"p600": 600, "1x": 1143, "4x": 4572, "r1x": 1143, "w24": 572, "w48": 572, "w96": 572}


def collect(root: Path) -> list[dict]:
    """The finished runs under queue.sh's run root ``root``."""
    starts: dict[tuple, list[str]] = {}
    ends: dict[tuple, tuple[int, str]] = {}
    for line in (root / "jobs.log").read_text().splitlines():
        if m := re.match(r"start (\S+) (\S+) (\S+) (\S+) (\d+)$", line):
            starts.setdefault((m[2], m[3], float(m[4]), int(m[5])), []).append(m[1])
        elif m := re.match(r"end \S+ (\S+) (\S+) (\S+) (\d+) rc=0 wall_s=(\d+) git=(\S+)", line):
            ends[(m[1], m[2], float(m[3]), int(m[4]))] = (int(m[5]), m[6])
    rows = []
    for (setting, opt, lr, seed), (wall, commit) in ends.items():
        run = root / setting / f"{opt}-lr{lr:g}-s{seed}"
        s = json.loads((run / "summary.json").read_text())
        cfg = json.loads((run / "config.json").read_text())
        if not (s["finished"] and s["steps"] == STEPS[setting]):
            raise ValueError(f"{run}: not a finished {setting} run ({s['steps']} updates)")
        rows.append({"setting": setting, "optimizer": opt, "lr": lr, "seed": seed, "final val loss": s["val_loss"],
                     "val_bpb": s["val_bpb"], "tokens_per_s": s["tokens_per_s"], "wall_s": wall,
                     "started": starts[(setting, opt, lr, seed)][0], "starts": len(starts[(setting, opt, lr, seed)]),
                     "commit": commit,
                     "weight_decay": cfg.get("weight_decay"), "model": cfg.get("model"),
                     "cpu_capability": s.get("cpu_capability")})
    return rows


def key(r: dict) -> tuple:
    return (list(STEPS).index(r["setting"]), r["optimizer"], r["lr"], r["seed"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", type=Path, help="queue.sh's run root (omit: print the kept runs)")
    args = ap.parse_args()
    rows = json.loads(KEPT.read_text())["runs"] if KEPT.exists() else []
    if args.root is not None:
        have = {(r["setting"], r["optimizer"], r["lr"], r["seed"]) for r in rows}
        rows += [r for r in collect(args.root) if (r["setting"], r["optimizer"], r["lr"], r["seed"]) not in have]
        rows.sort(key=key)
        KEPT.write_text(json.dumps({"runs": rows}, indent=1) + "\n")
    print("| setting | optimizer | lr | seed | final val loss | started (UTC) | wall time | tokens/s | commit |")
    print("|---|---|---:|---:|---:|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['optimizer']} | {r['lr']:g} | {r['seed']} | {r['final val loss']:.4f} | "
              f"{(r['started'] or '')[5:16].replace('T', ' ')} | {r['wall_s'] / 60:.1f} min"
              + (f" (last of {r['starts']} starts)" if r.get("starts", 1) > 1 else "") + " | "
              f"{r['tokens_per_s']:,.0f} | {r['commit']} |")


if __name__ == "__main__":
    main()
