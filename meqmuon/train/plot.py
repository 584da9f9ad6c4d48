"""Plots derived from ``metrics.jsonl`` files (the logs are the source of truth; nothing else is read).

``plot_runs`` draws one curve per run of an evaluation metric (default validation perplexity) or of the
train loss against training tokens, on a log-scaled y axis, and saves a PNG. matplotlib runs with the
non-interactive Agg backend so it works on headless machines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from meqmuon.train.metrics import read_metrics

__all__ = ["METRICS", "plot_runs", "run_label"]

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
    files = [Path(p) / "metrics.jsonl" if Path(p).is_dir() else Path(p) for p in paths]
    if not files:
        raise ValueError("no metrics files given")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, f in enumerate(files):
        recs = [r for r in read_metrics(f) if r.get("kind") == kind and isinstance(r.get(metric), int | float)]
        if not recs:
            raise ValueError(f"{f} has no {kind} records with {metric!r}")
        label = labels[i] if labels is not None else run_label(f)
        ax.plot([r["tokens"] for r in recs], [r[metric] for r in recs], marker="o" if kind == "eval" else None,
                markersize=3, label=label)
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
