"""Plots derived from ``metrics.jsonl`` files (the logs are the source of truth; nothing else is read).

``plot_runs`` draws one curve per run of an evaluation metric (default validation perplexity) or of the
train loss against training tokens, on a log-scaled y axis, and saves a PNG. ``plot_seed_bands`` draws,
per group of runs that differ only in the seed, the mean curve over the seeds with a shaded min-max
band (the spread, not one seed's curve). matplotlib runs with the non-interactive Agg backend so it
works on headless machines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meqmuon.train.metrics import read_metrics

__all__ = ["METRICS", "plot_runs", "plot_seed_bands", "run_label"]

#: metric name -> (record kind, y-axis label)
METRICS = {
    "val_ppl": ("eval", "validation perplexity"),
    "val_loss": ("eval", "validation loss (nats/token)"),
    "val_bpb": ("eval", "validation bits per byte"),
    "loss": ("train", "train loss (nats/token)"),
}


def run_label(metrics_path: Path) -> str:
    """Legend label: the run directory's name (e.g. ``meqmuon`` in ``runs/compare/meqmuon``)."""
    return metrics_path.parent.name or str(metrics_path)


def plot_runs(paths: Sequence[str | Path], out: str | Path, *, metric: str = "val_ppl",
              labels: Sequence[str] | None = None, title: str | None = None) -> Path:
    """Plot ``metric`` against tokens for every ``metrics.jsonl`` in ``paths``; returns the PNG path.

    A path may also be a run directory (its ``metrics.jsonl`` is used). Raises ``ValueError`` for an
    unknown metric, a missing file, or a file without any record of that metric.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind, ylabel = METRICS[metric]
    files = [_metrics_file(p) for p in paths]
    if not files:
        raise ValueError("no metrics files given")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, f in enumerate(files):
        xs, ys = _series(f, metric)
        label = labels[i] if labels is not None else run_label(f)
        ax.plot(xs, ys, marker="o" if kind == "eval" else None, markersize=3, label=label)
    return _finish(fig, ax, plt, ylabel, title, out)


def _metrics_file(p: str | Path) -> Path:
    return Path(p) / "metrics.jsonl" if Path(p).is_dir() else Path(p)


def _series(f: Path, metric: str) -> tuple[list[float], list[float]]:
    kind = METRICS[metric][0]
    recs = [r for r in read_metrics(f) if r.get("kind") == kind and isinstance(r.get(metric), int | float)]
    if not recs:
        raise ValueError(f"{f} has no {kind} records with {metric!r}")
    return [r["tokens"] for r in recs], [float(r[metric]) for r in recs]


def plot_seed_bands(groups: Mapping[str, Sequence[str | Path]], out: str | Path, *, metric: str = "val_ppl",
                    title: str | None = None) -> Path:
    """Per group (label -> the runs of one optimizer and lr over several seeds): the mean of ``metric``
    over the seeds at every evaluation, drawn as a line, and the min-max over the seeds as a shaded band.

    Min-max rather than a 95 % t interval: with 2-3 seeds the t interval of the mean is up to 12.7
    standard errors wide and says little about the curve's shape, while min-max shows exactly where
    the seeds' curves lie. A group of one run is drawn as its curve without a band. The legend gives
    the number of seeds and the title says what the band is. The runs of a group must have been
    evaluated at the same token counts (they are, for runs that differ only in the seed); otherwise
    this is an error, not an interpolation. Returns the PNG path.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")
    if not groups or any(not runs for runs in groups.values()):
        raise ValueError("every group needs at least one run")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind, ylabel = METRICS[metric]
    series = {}
    for label, runs in groups.items():
        curves = [_series(_metrics_file(p), metric) for p in runs]
        xs = curves[0][0]
        for (other, _), p in zip(curves, runs, strict=True):
            if other != xs:
                raise ValueError(f"{label}: runs were evaluated at different token counts ({p}); "
                                 "plot them with plot_runs instead")
        series[label] = (xs, [[c[1][i] for c in curves] for i in range(len(xs))])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    most = max(len(runs) for runs in groups.values())
    for label, (xs, per_x) in series.items():
        n = len(per_x[0])
        mean = [sum(v) / n for v in per_x]
        (line,) = ax.plot(xs, mean, marker="o" if kind == "eval" else None, markersize=3,
                          label=f"{label}: mean of {n} seed{'s' if n > 1 else ''}")
        if n > 1:
            ax.fill_between(xs, [min(v) for v in per_x], [max(v) for v in per_x], color=line.get_color(), alpha=0.2,
                            linewidth=0)
    parts = [t for t in (title, "band: min-max over seeds" if most > 1 else None) if t]
    return _finish(fig, ax, plt, ylabel, "; ".join(parts) or None, out)


def _finish(fig: Any, ax: Any, plt: Any, ylabel: str, title: str | None, out: str | Path) -> Path:
    ax.set_xlabel("training tokens")
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
