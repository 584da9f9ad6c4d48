"""This directory's comparisons from the kept runs (``runs.json``) and the kept records they pair with.

* ``choice``: item 3. ``meqmuon-shape`` minus ``meqmuon`` at pysrc-600 (1e-2, seeds 0-4; ``meqmuon``'s kept records,
  ``../pysrc-600/results.json``, and its re-runs here where they exist) and at horizon-micro's 4x (2e-2, the 1x-chosen
  lr of both; ``meqmuon``'s kept 4x records, ``../horizon-micro/runs-4x.json``, and its re-run here), paired by seed,
  with, for scale, each against ``muoneq-r``'s kept pysrc-600 records,
  95 % Student-t intervals (``meqmuon.train.stats.paired_difference``); the side lrs where they ran.
* ``recipes``: item 2. Each recipe's 1x lr grid (chosen on seeds 0 and 1, as horizon-micro), then at the chosen lr
  its pairs against ``meqmuon`` and ``muoneq-r`` (horizon-micro's kept 1x runs, 2e-2, seeds 0-4) and against its
  issue-48 preset (``../horizon-micro/runs48-1x.json``, named there without "-shared"), on seeds 0-4 and 2-4.
* ``width``: item 4. Per optimizer and width, the mean final loss at each lr over seeds 0 and 1 and the best lr
  (by the mean of seeds 0 and 1 once every lr has both; until then by seed 0, marked "seed 0 only"); ``--figure PATH``
  draws each width's loss less its lowest against lr, one panel per optimizer, one line per width.

Usage: ``python docs/results/field-2026/pairs.py {choice,recipes,width} [--figure PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from meqmuon.train.compare import best_lrs
from meqmuon.train.stats import paired_difference

HERE = Path(__file__).resolve().parent
HORIZON = HERE.parent / "horizon-micro"
RECIPES = ("muon-plus", "muon-vs", "muonh", "aurora")
WIDTHS = {"w24": 24, "w48": 48, "w96": 96}
WIDTH_OPTIMIZERS = ("meqmuon", "muon", "muoneq-r", "meqmuon-shape")


def kept(setting: str | None = None) -> list[dict]:
    rows = json.loads((HERE / "runs.json").read_text())["runs"]
    return [r for r in rows if setting is None or r["setting"] == setting]


def cells(rows: list[dict]) -> dict[tuple[str, float], dict[int, float]]:
    out: dict[tuple[str, float], dict[int, float]] = defaultdict(dict)
    for r in rows:
        out[(r["optimizer"], r["lr"])][r["seed"]] = r["final val loss"]
    return out


def pair_line(label: str, a: dict[int, float], b: dict[int, float], seeds: tuple[int, ...] | None = None) -> str:
    """One table row: ``a - b`` paired on the seeds both have (within ``seeds``)."""
    common = sorted(s for s in set(a) & set(b) if seeds is None or s in seeds)
    if len(common) < 2:
        return f"| {label} | - | fewer than 2 paired seeds | {len(common)} | - | - |"
    iv = paired_difference({s: a[s] for s in common}, {s: b[s] for s in common}).interval
    per = ", ".join(f"{a[s] - b[s]:+.4f}" for s in common)
    resolved = "yes" if iv.low > 0 or iv.high < 0 else "no"
    return f"| {label} | {iv.mean:+.4f} | [{iv.low:+.4f}, {iv.high:+.4f}] | {len(common)} | {resolved} | {per} |"


HEADER = "| pair | mean Δ | 95 % interval | paired seeds | resolved | per seed |\n|---|---:|---|---:|---|---|"


def choice() -> None:
    p600 = cells(kept("p600"))
    old = cells(json.loads((HERE.parent / "pysrc-600" / "results.json").read_text())["runs"])
    shape, meq_kept, meq_here = p600.get(("meqmuon-shape", 0.01), {}), old[("meqmuon", 0.01)], p600.get(
        ("meqmuon", 0.01), {})
    print("pysrc-600 (llama-tiny, 600 updates, 0.33 tokens/parameter), lr 1e-2. Δ = meqmuon-shape minus meqmuon:\n")
    print(HEADER)
    print(pair_line("against meqmuon's kept records (pysrc-600, AVX2)", shape, meq_kept))
    print(pair_line("against meqmuon's kept records, seeds 2-4", shape, meq_kept, (2, 3, 4)))
    if len(meq_here) >= 2:
        print(pair_line("against meqmuon re-run here", shape, meq_here))
    # context: what the shape rule alone gains over MuonEq-R (rows always), whose kept records are those of the
    # same AVX2 machine as meqmuon's (reproduced here to 1e-5, far below these differences)
    print("\nFor scale, against MuonEq-R (rows always; its kept pysrc-600 records, 1e-2). Δ = the first minus "
          "muoneq-r:\n")
    print(HEADER)
    print(pair_line("meqmuon-shape minus muoneq-r's kept records", shape, old[("muoneq-r", 0.01)]))
    print(pair_line("meqmuon (re-run here) minus muoneq-r's kept records", meq_here, old[("muoneq-r", 0.01)]))
    print("\nmeqmuon re-run here minus its kept record: " + ", ".join(
        f"seed {s} {meq_here[s] - meq_kept[s]:+.1e}" for s in sorted(meq_here)))
    grid = {lr: c for (o, lr), c in p600.items() if o == "meqmuon-shape"}
    if len(grid) > 1:
        print("\nmeqmuon-shape's pysrc-600 lrs (mean over the seeds shown): " + "; ".join(
            f"{lr:g}: {statistics.fmean(c[s] for s in (0, 1) if s in c):.4f} (seeds "
            f"{', '.join(str(s) for s in sorted(c) if s in (0, 1))})" for lr, c in sorted(grid.items())))
    four = cells(kept("4x"))
    kept4 = cells(json.loads((HORIZON / "runs-4x.json").read_text())["runs"])
    shape4, meq4_kept, meq4_here = four.get(("meqmuon-shape", 0.02), {}), kept4[("meqmuon", 0.02)], four.get(
        ("meqmuon", 0.02), {})
    print("\n4x horizon-micro (llama-micro, 4,572 updates, 80 tokens/parameter), lr 2e-2. Δ = meqmuon-shape minus "
          "meqmuon:\n")
    print(HEADER)
    print(pair_line("against meqmuon's kept 4x records (AVX512+AMX)", shape4, meq4_kept))
    if meq4_here:
        print(pair_line("against meqmuon's re-runs here where they exist, else its kept records", shape4,
                        meq4_kept | meq4_here))
    print("\nmeqmuon 4x re-run here minus its kept record: " + ", ".join(
        f"seed {s} {meq4_here[s] - meq4_kept[s]:+.1e}" for s in sorted(meq4_here)))


def recipes() -> None:
    rows = kept("r1x")
    c = cells(rows)
    chosen = best_lrs([r for r in rows if r["seed"] in (0, 1)])
    base = cells(json.loads((HORIZON / "runs-1x.json").read_text())["runs"])
    shared = cells(json.loads((HORIZON / "runs48-1x.json").read_text())["runs"])
    shared_best = best_lrs([r for r in json.loads((HORIZON / "runs48-1x.json").read_text())["runs"]
                            if r["seed"] in (0, 1)])
    print("| recipe | lr grid (mean over seeds 0, 1) | chosen lr | interior | seeds at it | mean, all its seeds |")
    print("|---|---|---:|---|---:|---:|")
    for o in RECIPES:
        grid = sorted((lr, v) for (opt, lr), v in c.items() if opt == o)
        if not grid:
            continue
        means = [(lr, statistics.fmean(v[s] for s in (0, 1))) for lr, v in grid if 0 in v and 1 in v]
        lr = chosen[o]
        interior = bool(means) and means[0][0] < lr < means[-1][0]
        at = c[(o, lr)]
        print(f"| {o} | " + ", ".join(f"{g:g}: {m:.4f}" for g, m in means) +
              f" | {lr:g} | {'yes' if interior else 'no: extend'} | {len(at)} | {statistics.fmean(at.values()):.4f} |")
    for seeds, label in ((None, "seeds 0-4"), ((2, 3, 4), "seeds 2-4 (chose nothing)")):
        print(f"\nΔ = recipe minus the other at its chosen lr, {label}:\n")
        print(HEADER)
        for o in RECIPES:
            if o not in chosen:
                continue
            mine = c[(o, chosen[o])]
            print(pair_line(f"{o} - meqmuon", mine, base[("meqmuon", 0.02)], seeds))
            print(pair_line(f"{o} - muoneq-r", mine, base[("muoneq-r", 0.02)], seeds))
            print(pair_line(f"{o} - {o}-shared (issue 48's preset at its lr {shared_best[o]:g})", mine,
                            shared[(o, shared_best[o])], seeds))


def width(figure: Path | None) -> None:
    table: dict[str, dict[int, dict[float, dict[int, float]]]] = defaultdict(lambda: defaultdict(dict))
    for setting, w in WIDTHS.items():
        for (o, lr), v in cells(kept(setting)).items():
            table[o][w][lr] = v
    print("| optimizer | width | lr: mean final loss over seeds 0, 1 (or the one seed run) | best lr | interior |")
    print("|---|---:|---|---:|---|")
    best: dict[str, dict[int, float]] = defaultdict(dict)
    for o in WIDTH_OPTIMIZERS:
        for w in sorted(table[o]):
            means = sorted((lr, statistics.fmean(v.values()), len(v)) for lr, v in table[o][w].items())
            # the best by the mean of seeds 0 and 1 once every lr has both; until then by seed 0 alone, and said so
            one = any(n < 2 for _, _, n in means)
            full = [(lr, table[o][w][lr][0] if one else m) for lr, m, n in means if not one or 0 in table[o][w][lr]]
            if len(full) < 2:
                continue
            lr = min(full, key=lambda t: t[1])[0]
            best[o][w] = lr
            interior = full[0][0] < lr < full[-1][0]
            print(f"| {o} | {w} | " + ", ".join(f"{g:g}: {m:.4f}" + ("" if n >= 2 else f" ({n} seed)")
                                                for g, m, n in means) +
                  f" | {lr:g}{' (seed 0 only)' if one else ''} | {'yes' if interior else 'no: at an edge'} |")
    if figure is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # each width's curve less its lowest mean: the widths' losses are 0.3-0.6 apart, which would flatten the
        # curves on one axis, and the question is where each minimum lies, not how low it is
        fig, axes = plt.subplots(1, len(WIDTH_OPTIMIZERS), figsize=(4 * len(WIDTH_OPTIMIZERS), 3.4), sharex=True,
                                 sharey=True)
        colours = {24: "tab:blue", 48: "tab:orange", 96: "tab:green"}
        grid = sorted({lr for o in table for w in table[o] for lr in table[o][w]})
        for ax, o in zip(axes, WIDTH_OPTIMIZERS, strict=True):
            for w in sorted(table[o]):
                pts = sorted(table[o][w].items())
                low = min(statistics.fmean(v.values()) for _, v in pts)
                ax.plot([lr for lr, _ in pts], [statistics.fmean(v.values()) - low for _, v in pts], "o-",
                        color=colours[w], label=f"width {w}")
                for lr, v in pts:
                    ax.plot([lr] * len(v), [x - low for x in v.values()], ".", color=colours[w], alpha=0.4)
                if w in best[o]:
                    ax.axvline(best[o][w], color=colours[w], ls=":", lw=1)
            if not table[o]:
                ax.text(0.5, 0.5, "not run", transform=ax.transAxes, ha="center", va="center", color="grey")
            ax.set_xscale("log", base=2)
            ax.set_xticks(grid, [f"{lr:g}" for lr in grid])
            ax.minorticks_off()
            ax.set_title(o)
            ax.set_xlabel("learning rate")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("final val loss minus the width's lowest")
        axes[0].legend(fontsize=8)
        fig.suptitle("llama-micro widths 24 / 48 / 96, 572 updates, pysrc 1,280-id BPE (mean of the seeds run, "
                     "0 and 1 where both; dots: seeds; dotted: best lr)", fontsize=9)
        fig.tight_layout()
        fig.savefig(figure, dpi=120)
        print(f"\nwrote {figure}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["choice", "recipes", "width"])
    ap.add_argument("--figure", type=Path, help="width: the figure's path (PNG)")
    args = ap.parse_args()
    {"choice": choice, "recipes": recipes}.get(args.what, lambda: width(args.figure))()


if __name__ == "__main__":
    main()
