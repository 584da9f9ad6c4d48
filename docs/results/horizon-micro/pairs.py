"""The comparison from the kept runs (``runs-<phase>.json``), as the README fixes it for each phase.

* ``--phase 1x``: each optimizer's lr chosen on seeds 0 and 1 (lowest mean final validation loss), then
  every pair's paired 95 % interval at those lrs, on seeds 0-4 and on seeds 2-4 alone (the seeds that
  chose nothing).
* ``--phase 4x``: the pairs at each optimizer's **1x-chosen lr** (the rule above on ``runs-1x.json``) on the
  4x seeds, which chose nothing; then each optimizer's 4x lr grid (means over the seeds every lr of it
  has) and the pairs at the 4x best lrs, chosen on the same seeds that report them (marked so).

``--against meqmuon,muoneq-r`` keeps only the pairs with one of those optimizers (issue 48: every new optimizer
against MeqMuon and MuonEq-R, not all 45 pairs of ten). ``--kept runs48-1x.json`` adds the rows of further kept
files to the 1x phase's (issue 48's runs are kept apart from issue 39's; same model, data, schedule and seeds).

Usage: ``python docs/results/horizon-micro/pairs.py [--phase 1x|4x] [--against NAME,NAME] [--kept FILE,FILE]``.
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


def load(phase: str, kept: tuple[str, ...] = ()) -> tuple[list[dict], dict[tuple[str, float], dict[int, float]]]:
    """The kept rows of ``phase`` (and of the further kept files ``kept``, beside this script) and their cells
    ``(optimizer, lr) -> {seed: final val loss}``."""
    rows = json.loads((HERE / f"runs-{phase}.json").read_text())["runs"]
    for name in kept:
        rows += json.loads((HERE / name).read_text())["runs"]
    cells: dict[tuple[str, float], dict[int, float]] = defaultdict(dict)
    for r in rows:
        cells[(r["optimizer"], r["lr"])][r["seed"]] = r["final val loss"]
    return rows, cells


def common_seeds(cells: dict[tuple[str, float], dict[int, float]], opt: str) -> tuple[int, ...]:
    """The seeds that every lr of ``opt`` has (a grid compared on unequal seeds would favour luck)."""
    return tuple(sorted(set.intersection(*(set(c) for (o, _), c in cells.items() if o == opt))))


def grid_table(cells: dict[tuple[str, float], dict[int, float]], chosen: dict[str, float],
               seeds: tuple[int, ...] | None, edge: str = "no: extend") -> dict[str, dict[int, float]]:
    """Print each optimizer's lr grid (means over ``seeds``, or over the seeds all its lrs have) with the
    chosen lr; return the cells at the chosen lrs."""
    print("| optimizer | lr grid (mean over the seeds shown) | seeds | chosen lr | interior | seeds at it | "
          "mean, all its seeds |\n|---|---|---|---:|---|---:|---:|")
    best: dict[str, dict[int, float]] = {}
    for opt in sorted(chosen):
        mine = {lr: c for (o, lr), c in cells.items() if o == opt}
        use = seeds if seeds is not None else common_seeds(cells, opt)
        grid = sorted((lr, statistics.fmean(c[k] for k in use)) for lr, c in mine.items()
                      if use and all(k in c for k in use))
        lr = chosen[opt]
        interior = bool(grid) and grid[0][0] < lr < grid[-1][0]
        best[opt] = cells[(opt, lr)]
        shown = ", ".join(f"{g:g}: {m:.4f}" for g, m in grid)
        print(f"| {opt} | {shown} | {', '.join(map(str, use))} | {lr:g} | {'yes' if interior else edge} | "
              f"{len(best[opt])} | {statistics.fmean(best[opt].values()):.4f} |")
    return best


#: ``--against``: the optimizers every printed pair must contain (empty: every pair).
AGAINST: set[str] = set()


def pair_table(best: dict[str, dict[int, float]], label: str, seeds: tuple[int, ...] | None = None) -> None:
    """Every pair's paired 95 % interval (first minus second) on the seeds both have (within ``seeds``);
    with :data:`AGAINST`, only the pairs that contain one of its optimizers."""
    print(f"\nΔ = first minus second at their {label}, paired by seed:\n")
    print("| pair | mean Δ | 95 % interval | paired seeds | resolved |")
    print("|---|---:|---|---:|---|")
    for a, b in itertools.combinations(sorted(best, key=lambda o: statistics.fmean(best[o].values())), 2):
        if AGAINST and not AGAINST & {a, b}:
            continue
        va = {s: v for s, v in best[a].items() if seeds is None or s in seeds}
        vb = {s: v for s, v in best[b].items() if seeds is None or s in seeds}
        common = sorted(set(va) & set(vb))
        if len(common) < 2:
            print(f"| {a} - {b} | - | fewer than 2 paired seeds | {len(common)} | - |")
            continue
        iv = paired_difference({s: va[s] for s in common}, {s: vb[s] for s in common}).interval
        resolved = "yes" if iv.low > 0 or iv.high < 0 else "no"
        print(f"| {a} - {b} | {iv.mean:+.4f} | [{iv.low:+.4f}, {iv.high:+.4f}] | {len(common)} | {resolved} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", default="1x", choices=["1x", "4x"])
    ap.add_argument("--against", default="", help="comma-separated: print only the pairs with one of these")
    ap.add_argument("--kept", default="", help="comma-separated further kept files of 1x rows (runs48-1x.json)")
    args = ap.parse_args()
    AGAINST.update(n for n in args.against.split(",") if n)
    rows1, cells1 = load("1x", tuple(n for n in args.kept.split(",") if n))
    chosen1 = best_lrs([r for r in rows1 if r["seed"] in CHOOSE])  # the rule of every sweep table
    if args.phase == "1x":
        best = grid_table(cells1, chosen1, CHOOSE)
        pair_table(best, "chosen lrs, seeds 0-4")
        pair_table(best, "chosen lrs, seeds 2-4 (chose nothing)", (2, 3, 4))
        return
    rows, cells = load("4x")
    optimizers = sorted({o for o, _ in cells})
    at_1x = {o: cells.get((o, chosen1[o]), {}) for o in optimizers}
    print("At each optimizer's 1x-chosen lr (" + ", ".join(f"{o} {chosen1[o]:g}" for o in optimizers) +
          "), the comparison that reports:\n")
    print("| optimizer | lr | seeds | mean |\n|---|---:|---|---:|")
    for o in optimizers:
        v = at_1x[o]
        print(f"| {o} | {chosen1[o]:g} | {', '.join(map(str, sorted(v)))} | "
              f"{statistics.fmean(v.values()) if v else float('nan'):.4f} |")
    pair_table(at_1x, "1x-chosen lrs (nothing tuned on these seeds)")
    print("\nThe 4x lr grids (lowest mean over the seeds every lr of the optimizer has):\n")
    chosen4 = best_lrs([r for r in rows if r["seed"] in common_seeds(cells, r["optimizer"])])
    best = grid_table(cells, chosen4, None, edge="no: at the grid's edge (the 4x grid is not extended)")
    pair_table(best, "4x best lrs (chosen on the same seeds: optimistic for each optimizer)")


if __name__ == "__main__":
    main()
