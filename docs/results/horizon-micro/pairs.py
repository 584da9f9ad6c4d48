"""The 1x comparison from the kept runs (``runs-1x.json``): each optimizer's lr chosen on seeds 0 and 1
(lowest mean final validation loss), then every pair's paired 95 % interval at those lrs, on seeds 0-4 and
on seeds 2-4 alone (the seeds that chose nothing).

Usage: ``python docs/results/horizon-micro/pairs.py [--phase 1x]`` (reads ``runs-<phase>.json`` beside it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import defaultdict
from pathlib import Path

from meqmuon.train.compare import best_lrs
from meqmuon.train.stats import paired_difference

HERE = Path(__file__).resolve().parent
CHOOSE = (0, 1)  # the seeds that choose the lr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", default="1x")
    args = ap.parse_args()
    rows = json.loads((HERE / f"runs-{args.phase}.json").read_text())["runs"]
    cells: dict[tuple[str, float], dict[int, float]] = defaultdict(dict)
    for r in rows:
        cells[(r["optimizer"], r["lr"])][r["seed"]] = r["final val loss"]
    chosen = best_lrs([r for r in rows if r["seed"] in CHOOSE])  # the rule of every sweep table
    print("| optimizer | lr grid (mean of seeds 0, 1) | chosen lr | interior | seeds at it | mean, all its seeds |")
    print("|---|---|---:|---|---:|---:|")
    best: dict[str, dict[int, float]] = {}
    for opt in sorted({o for o, _ in cells}):
        grid = sorted((lr, statistics.fmean(s[k] for k in CHOOSE)) for (o, lr), s in cells.items()
                      if o == opt and all(k in s for k in CHOOSE))
        lr = chosen[opt]
        interior = grid[0][0] < lr < grid[-1][0]
        best[opt] = cells[(opt, lr)]
        shown = ", ".join(f"{g:g}: {m:.4f}" for g, m in grid)
        print(f"| {opt} | {shown} | {lr:g} | {'yes' if interior else 'no: extend'} | {len(best[opt])} | "
              f"{statistics.fmean(best[opt].values()):.4f} |")
    for label, seeds in (("seeds 0-4", None), ("seeds 2-4 (chose nothing)", (2, 3, 4))):
        print(f"\nΔ = first minus second at their chosen lrs, paired by seed, {label}:\n")
        print("| pair | mean Δ | 95 % interval | paired seeds | resolved |")
        print("|---|---:|---|---:|---|")
        for a, b in itertools.combinations(sorted(best, key=lambda o: statistics.fmean(best[o].values())), 2):
            va = {s: v for s, v in best[a].items() if seeds is None or s in seeds}
            vb = {s: v for s, v in best[b].items() if seeds is None or s in seeds}
            common = sorted(set(va) & set(vb))
            if len(common) < 2:
                continue
            d = paired_difference({s: va[s] for s in common}, {s: vb[s] for s in common})
            iv = d.interval
            resolved = "yes" if iv.low > 0 or iv.high < 0 else "no"
            print(f"| {a} - {b} | {iv.mean:+.4f} | [{iv.low:+.4f}, {iv.high:+.4f}] | {len(common)} | {resolved} |")


if __name__ == "__main__":
    main()
