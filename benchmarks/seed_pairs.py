"""Paired seed comparisons across and within two ``meqmuon sweep`` results: what changes when one
setting changes (Polar Express against the default quintic, say), and every pair of optimizers.

Usage::

    python benchmarks/seed_pairs.py runs/default/results.json runs/pe/results.json \
        --labels default,polar_express
    python benchmarks/seed_pairs.py runs/sweep/results.json   # the pairs within one sweep

For each optimizer present in both sweeps, at its best lr in each (``meqmuon.train.compare.best_lrs``:
lowest mean final validation loss over seeds), the paired difference ``B - A`` of the final validation
loss over the seeds both have, with its 95 % Student-t interval (``meqmuon.train.stats``). Then, within
each sweep, the paired difference of every pair of optimizers at their best lrs. The sign convention is
the sweep table's: a positive difference means the second named (the reference) reached the lower
loss, and only an interval that excludes 0 resolves the order. The same seeds serve for choosing the
lr and for the interval, so each best-lr mean is slightly optimistic (``best_lrs`` explains why).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from meqmuon.train.compare import _cells, best_lrs
from meqmuon.train.stats import paired_difference


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The run rows of a sweep's ``results.json`` (``{"runs": [...], "summary": [...]}``)."""
    data = json.loads(Path(path).read_text())
    return data["runs"] if isinstance(data, dict) else data


def best_cells(rows: list[dict[str, Any]]) -> dict[str, tuple[float, dict[int, float]]]:
    """Per optimizer: its best lr and ``{seed: final val loss}`` there."""
    cells, best = _cells(rows), best_lrs(rows)
    return {opt: (lr, cells[(opt, lr)]) for opt, lr in best.items()}


def _row(label: str, lr_a: float, lr_b: float, diff) -> str:
    iv = diff.interval
    resolved = "yes" if iv.low is not None and (iv.low > 0 or iv.high < 0) else "no"
    interval = "-" if iv.low is None else f"[{iv.low:+.4f}, {iv.high:+.4f}]"
    return f"| {label} | {lr_a:g} | {lr_b:g} | {iv.mean:+.4f} | {interval} | {len(diff.seeds)} | {resolved} |"


def report(a: list[dict[str, Any]], b: list[dict[str, Any]] | None, labels: tuple[str, ...]) -> str:
    """Markdown: ``B - A`` per optimizer, then every optimizer pair within each sweep (with ``b`` None:
    the pairs within ``a`` only)."""
    head = "| {} | lr ({}) | lr ({}) | mean Δ | 95 % interval of Δ | paired seeds | resolved |"
    rule = "|---|---:|---:|---:|---:|---:|---|"
    bests = [best_cells(a)] if b is None else [best_cells(a), best_cells(b)]
    lines: list[str] = []
    if b is not None:
        best_a, best_b = bests
        lines = [f"Δ = {labels[1]} minus {labels[0]}, per seed, each at its own best lr:", "",
                 head.format("optimizer", labels[0], labels[1]), rule]
        for opt in best_a:
            if opt in best_b:
                (lr_a, la), (lr_b, lb) = best_a[opt], best_b[opt]
                lines.append(_row(opt, lr_a, lr_b, paired_difference(lb, la)))
        lines.append("")
    for label, best in zip(labels, bests, strict=True):
        lines += [f"{label}: Δ = first minus second optimizer, per seed, each at its own best lr:", "",
                  head.format("pair", "first", "second"), rule]
        for x, y in itertools.combinations(best, 2):
            (lr_x, lx), (lr_y, ly) = best[x], best[y]
            lines.append(_row(f"{x} - {y}", lr_x, lr_y, paired_difference(lx, ly)))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="results.json of the first sweep")
    ap.add_argument("b", type=Path, nargs="?", default=None,
                    help="results.json of the second sweep (left out: the pairs within the first only)")
    ap.add_argument("--labels", default=None, help="names of the sweeps, comma-separated (A,B)")
    args = ap.parse_args(argv)
    n = 1 if args.b is None else 2
    labels = tuple(args.labels.split(",")) if args.labels else ("A", "B")[:n]
    if len(labels) != n:
        raise SystemExit(f"--labels needs {n} name(s), got {args.labels!r}")
    print(report(load_rows(args.a), None if args.b is None else load_rows(args.b), labels))


if __name__ == "__main__":
    main()
