"""Every finished run of queue.sh, kept in git, and the README's "Runs" table from it.

Usage::

    python docs/results/horizon-micro/runs_table.py /work/runs39 --phase 1x   # add the new runs, print the table
    python docs/results/horizon-micro/runs_table.py --phase 1x                # the table from the kept runs only
    python docs/results/horizon-micro/runs_table.py /work/runs48 --kept runs48-1x.json   # issue 48's runs, kept apart

A run's directory (checkpoints included) lives outside git and may not outlive the machine; what the
comparison needs of it is kept in ``runs-<phase>.json`` beside this script, one row per finished run
(``{"runs": [...]}``, the rows ``benchmarks/seed_pairs.py`` and ``meqmuon.train.compare.best_lrs`` read:
``optimizer``, ``lr``, ``seed``, ``final val loss``), read from queue.sh's ``jobs.log`` and each run's
``summary.json`` (with ``cpu_capability`` where the summary names it). A row already kept is never replaced.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = {"1x": 1143, "4x": 4572}  # llama-micro's 20 and 80 tokens per parameter (README, Setting)


def collect(root: Path, phase: str) -> list[dict]:
    """The finished runs of ``phase`` under queue.sh's run root ``root``."""
    starts: dict[tuple[str, float, int], str] = {}
    ends: dict[tuple[str, float, int], tuple[int, str]] = {}
    for line in (root / "jobs.log").read_text().splitlines():
        if m := re.match(rf"start (\S+) {phase} (\S+) (\S+) (\d+)$", line):
            starts[(m[2], float(m[3]), int(m[4]))] = m[1]
        elif m := re.match(rf"end \S+ {phase} (\S+) (\S+) (\d+) rc=0 wall_s=(\d+) git=(\S+)", line):
            ends[(m[1], float(m[2]), int(m[3]))] = (int(m[4]), m[5])
    rows = []
    for (opt, lr, seed), (wall, commit) in ends.items():
        out = root / (f"{phase}-adamw" if opt == "adamw" else phase) / f"{opt}-lr{lr:g}-s{seed}" / "summary.json"
        s = json.loads(out.read_text())
        if not (s["finished"] and s["steps"] == STEPS[phase]):
            raise ValueError(f"{out}: not a finished {phase} run ({s['steps']} updates)")
        rows.append({"optimizer": opt, "lr": lr, "seed": seed, "final val loss": s["val_loss"],
                     "val_bpb": s["val_bpb"], "tokens_per_s": s["tokens_per_s"], "wall_s": wall,
                     "started": starts.get((opt, lr, seed)), "commit": commit}
                    | ({"cpu_capability": s["cpu_capability"]} if s.get("cpu_capability") else {}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", type=Path, help="queue.sh's run root (omit: print the kept runs)")
    ap.add_argument("--phase", choices=sorted(STEPS), default="1x")
    ap.add_argument("--kept", help="the kept file, beside this script (default runs-<phase>.json)")
    args = ap.parse_args()
    kept = HERE / (args.kept or f"runs-{args.phase}.json")
    rows = json.loads(kept.read_text())["runs"] if kept.exists() else []
    if args.root is not None:
        have = {(r["optimizer"], r["lr"], r["seed"]) for r in rows}
        rows += [r for r in collect(args.root, args.phase) if (r["optimizer"], r["lr"], r["seed"]) not in have]
        rows.sort(key=lambda r: (r["optimizer"], r["lr"], r["seed"]))
        kept.write_text(json.dumps({"runs": rows}, indent=1) + "\n")
    print("| optimizer | lr | seed | final val loss | bits per byte | started (UTC) | wall time | tokens/s | commit |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['lr']:g} | {r['seed']} | {r['final val loss']:.4f} | {r['val_bpb']:.4f} | "
              f"{(r['started'] or '')[5:16].replace('T', ' ')} | {r['wall_s'] / 60:.1f} min | "
              f"{r['tokens_per_s']:,.0f} | {r['commit']} |")


if __name__ == "__main__":
    main()
