"""Plots derived from ``metrics.jsonl`` files (the curves come from the logs; labels and titles from
the runs' ``config.json``).

``plot_runs`` draws one curve per run of an evaluation metric (default validation perplexity) or of the
train loss against training tokens, on a log-scaled y axis, and saves a PNG. ``plot_seed_bands`` draws,
per group of runs that differ only in the seed, the mean curve over the seeds with a shaded min-max
band (the spread, not one seed's curve). matplotlib runs with the non-interactive Agg backend so it
works on headless machines.

Axes meant for a paper: token counts as ``100k``/``1M``/``1.5B``; the log y axis has labelled ticks
from a 1-2-5 (or finer) series chosen so that a tick lies at or below the lowest value and one at or
above the highest (:func:`log_ticks`); titles are wrapped to stay inside the figure.
"""

from __future__ import annotations

import glob
import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meqmuon.optim.registry import DEMO_NAMES, REGISTRY
from meqmuon.train.metrics import read_metrics

__all__ = ["METRICS", "ONE_POINT_NOTE", "OPTIMIZER_COLORS", "one_point_note", "plot_runs", "plot_seed_bands",
           "run_label", "metrics_files", "default_output", "default_title", "log_ticks", "token_label"]

#: metric name -> (record kind, y-axis label)
METRICS = {
    "val_ppl": ("eval", "validation perplexity"),
    "val_loss": ("eval", "validation loss (nats/token)"),
    "val_bpb": ("eval", "validation bits per byte"),
    "loss": ("train", "train loss (nats/token)"),
}


#: One colour per optimizer name, in every figure (the demo's, ``meqmuon plot``'s, a sweep's): the
#: colour used to follow the order of the runs, so ``meqmuon plot runs/compare/*/metrics.jsonl`` (the
#: shell's alphabetical order) drew MeqMuon in Muon's colour of the demo's figure. matplotlib's tab10
#: colours in the registry's order, the demo's optimizers first in the demo's order (the names live in
#: ``meqmuon.optim.registry`` alone).
OPTIMIZER_COLORS = dict(zip([*DEMO_NAMES, *(n for n in REGISTRY if n not in DEMO_NAMES)],
                            [f"C{i}" for i in range(10)] + ["black"], strict=False))
_LINESTYLES = ("-", "--", ":", "-.")


def _styles(optimizers: Sequence[str | None]) -> list[dict[str, Any]]:
    """``plot`` keywords per curve: the optimizer's colour from :data:`OPTIMIZER_COLORS`; a second run
    of the same optimizer (another lr) keeps the colour with another line style; a run of unknown
    optimizer takes a colour no other curve uses."""
    spare = iter([f"C{i}" for i in range(10) if f"C{i}" not in {OPTIMIZER_COLORS.get(o) for o in optimizers}]
                 + ["gray", "olive", "teal", "navy"] * len(optimizers))
    seen: dict[str, int] = {}
    out = []
    for o in optimizers:
        if o in OPTIMIZER_COLORS:
            k = seen[o] = seen.get(o, -1) + 1
            out.append({"color": OPTIMIZER_COLORS[o], "linestyle": _LINESTYLES[k % len(_LINESTYLES)]})
        else:
            out.append({"color": next(spare)})
    return out


def _optimizer(metrics_path: Path) -> str | None:
    name = _config(metrics_path).get("optimizer")
    return name if isinstance(name, str) else None


def _config(metrics_path: Path) -> dict[str, Any]:
    p = metrics_path.parent / "config.json"
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def run_label(metrics_path: Path) -> str:
    """Legend label: ``optimizer (lr X)`` from the run's ``config.json``, else the run directory's name."""
    cfg = _config(metrics_path)
    if cfg.get("optimizer") and isinstance(cfg.get("lr"), int | float):
        return f"{cfg['optimizer']} (lr {cfg['lr']:g})"
    return metrics_path.parent.name or str(metrics_path)


def _labels(files: Sequence[Path]) -> list[str]:
    """:func:`run_label` per run; where two runs would share a label, the directory names tell them apart."""
    labels = [run_label(f) for f in files]
    return [f"{lab}: {f.parent.name}" if labels.count(lab) > 1 else lab for lab, f in zip(labels, files, strict=True)]


def metrics_files(paths: Sequence[str | Path]) -> list[Path]:
    """The ``metrics.jsonl`` files ``paths`` name: files, run directories, or directories of run
    directories (``runs/compare`` after the demo), in the order given. A path that does not exist is a
    ``ValueError``; one with ``*`` or ``?`` says that the shell found nothing to expand it to."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif (p / "metrics.jsonl").is_file():
            files.append(p / "metrics.jsonl")
        elif p.is_dir() and (found := sorted(p.glob("*/metrics.jsonl"))):
            files += found
        elif glob.has_magic(str(p)):
            raise ValueError(f"no metrics file matches {p} (the pattern matched nothing; `meqmuon compare` "
                             "writes runs/compare/<optimizer>/metrics.jsonl)")
        elif p.is_dir():
            raise ValueError(f"{p} holds no metrics.jsonl, nor run directories with one")
        else:
            raise ValueError(f"metrics file does not exist: {p}")
    if not files:
        raise ValueError("no metrics files given")
    return files


def default_output(paths: Sequence[str | Path], metric: str = "val_ppl") -> Path:
    """Where ``meqmuon plot`` writes without ``--out``: ``<run>/<metric>.png`` for one run, else
    ``<their common directory>/<metric>-<run names>.png`` (``<metric>-<N>-runs.png`` when long)."""
    runs = [f.parent for f in metrics_files(paths)]
    if len(runs) == 1:
        return runs[0] / f"{metric}.png"
    common = Path(os.path.commonpath([str(r.resolve()) for r in runs]))
    if all(not r.is_absolute() for r in runs):
        common = Path(os.path.relpath(common))
    names = "-".join(r.name for r in runs)
    return common / (f"{metric}-{names}.png" if len(names) <= 80 else f"{metric}-{len(runs)}-runs.png")


def default_title(paths: Sequence[str | Path], metric: str = "val_ppl") -> str:
    """``<model(s)>: <what is plotted> (<common directory>)`` from the runs' ``config.json``."""
    files = metrics_files(paths)
    models = sorted({str(m) for f in files if (m := _config(f).get("model"))})
    where = os.path.commonpath([str(f.parent) for f in files]) if len(files) > 1 else str(files[0].parent)
    head = f"{', '.join(models)}: " if models else ""
    return f"{head}{METRICS[metric][1]} ({where})"


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
    files = metrics_files(paths)
    if labels is not None and len(labels) != len(files):
        raise ValueError(f"{len(labels)} labels for {len(files)} runs")
    labels = list(labels) if labels is not None else _labels(files)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f, label, style in zip(files, labels, _styles([_optimizer(f) for f in files]), strict=True):
        xs, ys = _series(f, metric)
        ax.plot(xs, ys, marker="o" if kind == "eval" else None, markersize=3, label=label, **style)
    parts = [t for t in (title, one_point_note(files, metric)) if t]
    return _finish(fig, ax, plt, ylabel, "; ".join(parts) or None, out)


#: What a figure of runs with one evaluation each says (a 20-update run evaluates only at the end).
ONE_POINT_NOTE = "one evaluation per run (at the end): --eval-every N draws curves"


def one_point_note(paths: Sequence[str | Path], metric: str = "val_ppl") -> str | None:
    """:data:`ONE_POINT_NOTE` when every run has at most one value of ``metric``, else None: such a
    figure is one dot per run, which reads as a broken plot unless it says why."""
    if METRICS.get(metric, ("eval",))[0] != "eval":
        return None
    counts = [sum(1 for r in read_metrics(_metrics_file(p)) if r.get("kind") == "eval"
                  and isinstance(r.get(metric), int | float)) for p in paths]
    return ONE_POINT_NOTE if counts and max(counts) <= 1 else None


def _metrics_file(p: str | Path) -> Path:
    (f,) = metrics_files([p])
    return f


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
    styles = _styles([_optimizer(_metrics_file(runs[0])) for runs in groups.values()])
    for (label, (xs, per_x)), style in zip(series.items(), styles, strict=True):
        n = len(per_x[0])
        mean = [sum(v) / n for v in per_x]
        (line,) = ax.plot(xs, mean, marker="o" if kind == "eval" else None, markersize=3,
                          label=f"{label}: mean of {n} seed{'s' if n > 1 else ''}", **style)
        if n > 1:
            ax.fill_between(xs, [min(v) for v in per_x], [max(v) for v in per_x], color=line.get_color(), alpha=0.2,
                            linewidth=0)
    note = one_point_note([runs[0] for runs in groups.values()], metric)
    parts = [t for t in (title, "band: min-max over seeds" if most > 1 and not note else None, note) if t]
    return _finish(fig, ax, plt, ylabel, "; ".join(parts) or None, out)


def token_label(x: float, _pos: Any = None) -> str:
    """Token counts for an axis: ``0``, ``500``, ``100k``, ``1M``, ``2.5M``, ``1.2B``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


#: Tick mantissas of a log axis, coarsest first (:func:`log_ticks` takes the first that gives enough ticks).
_MANTISSAS = ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8),
              tuple(round(1 + 0.1 * i, 1) for i in range(90)))


def log_ticks(lo: float, hi: float, at_least: int = 4) -> list[float]:
    """Ticks of a log axis over positive data in ``[lo, hi]``: the first series of :data:`_MANTISSAS`
    x powers of ten that has ``at_least`` values from the largest one ``<= lo`` to the smallest ``>= hi``
    (those two included, so the ticks bracket the data), e.g. 128..142 -> 120, 130, 140, 150. A single
    value (``lo == hi``) is widened by 5 % each way first."""
    if not 0 < lo <= hi or not math.isfinite(hi):
        raise ValueError(f"log ticks need 0 < lo <= hi < inf, got {lo}, {hi}")
    if lo == hi:
        lo, hi = lo / 1.05, hi * 1.05
    e0, e1 = math.floor(math.log10(lo)) - 1, math.floor(math.log10(hi)) + 1
    ticks: list[float] = []
    for mantissas in _MANTISSAS:
        values = sorted({float(f"{m}e{e}") for e in range(e0, e1 + 1) for m in mantissas})
        below = max(v for v in values if v <= lo)
        above = min(v for v in values if v >= hi)
        ticks = [v for v in values if below <= v <= above]
        if len(ticks) >= at_least:
            break
    return ticks


def _finish(fig: Any, ax: Any, plt: Any, ylabel: str, title: str | None, out: str | Path) -> Path:
    from matplotlib.ticker import FuncFormatter, NullLocator

    ax.set_xlabel("training tokens")
    ax.xaxis.set_major_formatter(FuncFormatter(token_label))
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    lo, hi = ax.dataLim.intervaly
    if lo > 0 and math.isfinite(hi):
        ticks = log_ticks(lo, hi)
        ax.set_ylim(ticks[0], ticks[-1])
        ax.set_yticks(ticks, [f"{t:,g}" for t in ticks])
        ax.yaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(textwrap.fill(title, width=64))  # ~64 characters fit the 7-inch figure at 12 pt
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
