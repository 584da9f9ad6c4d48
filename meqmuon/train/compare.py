"""``meqmuon compare`` and ``meqmuon sweep``: several runs that differ only in optimizer, lr and seed.

Every run of a comparison shares the model, the initial weights (same ``seed`` -> same init), the data
order (same ``seed`` -> same permutation of packed rows) and the validation set (cached, identical),
following the modded-nanogpt track-3 rule "fixed data, batch and architecture across optimizers".

Demo defaults (:func:`demo_config`): ``llama-tiny`` on the built-in corpus, 128-token sequences,
global batch 32, 100 updates (0.41M tokens, ~0.8 epoch of the ~0.5M-token corpus), evaluation every
20 updates on the whole held-out split (~30k tokens), precision ``auto`` (bf16 where the CPU runs it
natively, fp32 elsewhere), one CPU thread. 100 rather than the earlier 240 updates so that the
four runs finish in well under 10 minutes on 2 cores of an AVX2-only CPU too, shared or not
(docs/training.md has the timings). Per-optimizer learning rates (``demo_lr`` of
:data:`meqmuon.optim.registry.REGISTRY`) are the best of a pre-check grid at exactly this setting
(docs/training.md lists it).

Over several seeds (``sweep``, ``compare --seeds N``) the tables report, per optimizer at its best lr,
the mean final validation loss, its 95 % Student-t interval and the paired difference against
:data:`REFERENCE` (MeqMuon) on the same seeds (:func:`summarize_seeds`; formulas in
:mod:`meqmuon.train.stats`), so that intervals, not single runs, decide which optimizer is better.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meqmuon.optim.registry import spec
from meqmuon.train.config import (
    TrainConfig,
    check_positive,
    fill_model_defaults,
    resolve_numerics,
    resume_requests,
    run_name,
)
from meqmuon.train.device import device_of
from meqmuon.train.loop import train
from meqmuon.train.metrics import write_json
from meqmuon.train.plot import one_point_note, plot_runs, plot_seed_bands
from meqmuon.train.stats import mean_interval, paired_difference

__all__ = [
    "demo_config",
    "run_compare",
    "format_table",
    "run_sweep",
    "format_sweep_table",
    "REFERENCE",
    "best_lrs",
    "grid_edge_notes",
    "summarize_seeds",
    "format_seed_summary",
    "format_compare_seeds_table",
]

TABLE_COLUMNS = ["optimizer", "lr", "final val loss", "perplexity", "bits/byte", "optimizer state (MiB)", "tokens/s",
                 "precision"]


def demo_config(**overrides: Any) -> TrainConfig:
    """The base config of ``meqmuon compare`` / ``meqmuon sweep`` (CPU-sized), with overrides."""
    # threads=1: on a CPU shared with other jobs, 2 threads on 2 cores stall (OpenMP oversubscription;
    # docs/benchmarks.md), and the demo must finish in 10 minutes there. `--threads 2` is faster when idle.
    base = dict(model="llama-tiny", data="builtin", seq_len=128, global_batch=32, micro_batch=None, steps=100,
                eval_every=20, save_every=50, val_tokens=32768, keep_checkpoints=1, threads=1)
    if overrides.get("tokens") is not None and "steps" not in overrides:
        base["steps"] = None  # a given token budget sets the length (--steps overrides --tokens, as in train)
    base.update(overrides)
    return TrainConfig(**base)


def _row(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "optimizer": summary["optimizer"],
        "lr": summary["lr"],
        "final val loss": summary["val_loss"],
        "perplexity": summary["val_ppl"],
        "bits/byte": summary["val_bpb"],
        "optimizer state (MiB)": summary["optimizer_state_mib"],
        "tokens/s": summary["tokens_per_s"],
        # autocast precision and Newton-Schulz dtype actually used (older runs do not record it: unknown)
        "precision": _precision_cell(summary),
        "cpu_capability": summary.get("cpu_capability"),
        "seed": summary.get("seed"),
        "run_dir": summary["run_dir"],
        # the loop's summary keys too, for programmatic users (e.g. the diagnostics ablation table)
        **{k: summary.get(k) for k in ("val_loss", "val_ppl", "val_bpb", "optimizer_state_mib", "tokens_per_s",
                                       "steps", "tokens")},
    }


def _precision_cell(summary: dict[str, Any]) -> str | None:
    p, ns = summary.get("precision"), summary.get("ns_dtype")
    if p is None:
        return None
    return f"{p}, NS {'bf16' if ns == 'bfloat16' else 'fp32' if ns == 'float32' else ns}" if ns else p


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if key == "lr":
        return f"{v:g}"
    if key == "tokens/s":
        return f"{v:,.0f}"
    if key == "optimizer state (MiB)":
        return f"{v:.2f}"
    if key == "perplexity":
        return f"{v:.2f}"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = TABLE_COLUMNS, *,
                 head: bool = True) -> str:
    """Markdown table of comparison rows, preceded (``head=True``) by a line naming the CPU capability
    (the numbers depend on it through the precision: bf16 where native, fp32 elsewhere)."""
    caps = sorted({str(r["cpu_capability"]) for r in rows if r.get("cpu_capability")})
    first = [f"CPU capability: {', '.join(caps)}", ""] if caps and head else []
    lines = first + ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if c in ("optimizer", "precision") else "---:" for c in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(c, r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _finished_summary(run_dir: Path, cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of an already finished run with the same settings (so re-running compare is cheap)."""
    s, c = run_dir / "summary.json", run_dir / "config.json"
    if not (s.exists() and c.exists()):
        return None
    saved = resume_requests(json.loads(c.read_text()))  # the vocabulary as asked, not as the data built it
    mine = dataclasses.asdict(_resolved(cfg))
    keys = ("model", "optimizer", "lr", "weight_decay", "optimizer_args", "data", "seq_len", "global_batch", "seed",
            "warmup_ratio", "min_lr_ratio", "clip", "precision", "val_tokens", "vocab_size")
    if any(saved.get(k) != mine.get(k) for k in keys) or (cfg.steps is not None and saved.get("steps") != cfg.steps):
        return None
    return json.loads(s.read_text())


def _resolved(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the model defaults and this machine's numerics filled in, as the run would store it
    (so that a finished run is reused only if "auto" resolves the same way here)."""
    c = fill_model_defaults(cfg)
    return resolve_numerics(c, device_of(c.device, int(os.environ.get("LOCAL_RANK", "0"))))


def _train_or_reuse(cfg: TrainConfig, reused: list[str]) -> dict[str, Any]:
    """The finished run's summary if ``cfg.out`` holds one with these settings (its name appended to
    ``reused``), else the summary of training it (resuming an interrupted one)."""
    run_dir = Path(cfg.out)
    done = _finished_summary(run_dir, cfg)
    if done is not None:
        reused.append(run_dir.name)
        return done
    if (run_dir / "summary.json").exists():
        raise ValueError(f"{run_dir} holds a finished run with different settings; choose another --out")
    return train(dataclasses.replace(cfg, resume="auto"))  # "auto" starts fresh when there is no checkpoint


def _say_reused(reused: list[str], out_dir: Path) -> None:
    """One line naming the finished runs a rerun took as they were, and how to train them again."""
    if reused:
        print(f"meqmuon: reused {len(reused)} finished run(s) with the same settings in {out_dir}: "
              f"{', '.join(reused)} (to train them again, delete them or choose another --out)", file=sys.stderr)


def run_compare(optimizers: list[str], lrs: dict[str, float], base: TrainConfig, out_dir: Path,
                seeds: Sequence[int] | None = None) -> list[dict]:
    """Train ``base`` once per optimizer (and per seed) and tabulate the results.

    ``lrs`` maps optimizer -> lr; optimizers missing from it use ``base.lr`` if set, else their
    ``demo_lr`` (:data:`meqmuon.optim.registry.REGISTRY`). With ``seeds=None`` (the default, ``meqmuon
    compare`` without ``--seeds``) every optimizer runs once at ``base.seed`` in ``out_dir/<optimizer>`` and
    ``out_dir/table.md`` is the per-run table (:func:`format_table`), ``out_dir/results.json`` the list of rows and
    ``out_dir/val_ppl.png`` one perplexity curve per optimizer. With ``seeds`` (``--seeds N`` gives
    ``0..N-1``) every optimizer runs once per seed in ``out_dir/<optimizer>-s<seed>``; ``table.md``
    then starts with the seed summary (:func:`format_seed_summary`: mean, 95 % interval, paired
    difference against :data:`REFERENCE`) followed by the per-run table with a seed column,
    ``results.json`` is ``{"runs": rows, "summary": summarize_seeds(rows)}``, and the plot shows per
    optimizer the mean curve over seeds with a min-max band (:func:`plot_seed_bands`).
    Finished runs with identical settings are reused, interrupted ones resumed.
    Returns the run rows (dicts keyed by :data:`TABLE_COLUMNS` plus ``seed`` and ``run_dir``).
    """
    if not optimizers:
        raise ValueError("no optimizers to compare")
    unknown = sorted(set(lrs) - set(optimizers))
    if unknown:
        raise ValueError(f"--lr given for optimizer(s) {unknown} that are not compared ({', '.join(optimizers)})")
    if seeds is not None:
        seeds = _check_seeds(seeds)
        _check_distinct("optimizers", optimizers)  # the seed summary keys runs by (optimizer, lr, seed)
    out_dir = Path(out_dir)
    rows: list[dict] = []
    reused: list[str] = []
    for name in optimizers:
        lr = lrs.get(name, base.lr if base.lr is not None else spec(name).demo_lr)
        for seed in ([None] if seeds is None else seeds):
            cfg = dataclasses.replace(base, optimizer=name, lr=lr, out=str(out_dir / run_name(name, seed=seed)),
                                      resume=None, stop_at_step=None)
            if seed is not None:
                cfg = dataclasses.replace(cfg, seed=seed)
            rows.append(_row(_train_or_reuse(cfg, reused)))
    _say_reused(reused, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"{base.model}: validation perplexity"
    if seeds is None:
        (out_dir / "table.md").write_text(format_table(rows) + "\n")
        write_json(out_dir / "results.json", rows)
        plot_runs([Path(r["run_dir"]) / "metrics.jsonl" for r in rows], out_dir / "val_ppl.png",
                  labels=[f"{r['optimizer']} (lr {r['lr']:g})" for r in rows], title=title)
        return rows
    summary = summarize_seeds(rows)
    (out_dir / "table.md").write_text(format_compare_seeds_table(rows, summary) + "\n")
    write_json(out_dir / "results.json", {"runs": rows, "summary": summary})
    _plot_summary(rows, summary, out_dir / "val_ppl.png", title)
    return rows


def format_compare_seeds_table(rows: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]] | None = None) -> str:
    """``table.md`` of ``compare --seeds N``: the seed summary, then every run (with its seed)."""
    summary = summarize_seeds(rows) if summary is None else summary
    cols = list(TABLE_COLUMNS)
    cols.insert(cols.index("lr") + 1, "seed")
    ref = summary[0]["reference"] if summary else REFERENCE
    return "\n".join([_head(rows), SEED_NOTE.format(ref=ref), "", format_seed_summary(summary, lr_label="lr"), "",
                      "Runs:", "",
                      format_table(rows, cols, head=False)]).lstrip("\n")


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    seeds = list(seeds)
    if not seeds:
        raise ValueError("no seeds given")
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be non-negative integers, got {seeds}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct, got {seeds}")
    return seeds


def _check_distinct(what: str, values: Sequence[Any]) -> None:
    if len(set(values)) != len(values):
        raise ValueError(f"{what} must be distinct, got {list(values)}")


def _plot_summary(rows: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]], out: Path, title: str) -> None:
    """Mean validation-perplexity curve over seeds with a min-max band, per optimizer at its (best) lr."""
    groups: dict[str, list[Path]] = {}
    for s in summary:
        runs = [Path(r["run_dir"]) for r in rows if r["optimizer"] == s["optimizer"] and r["lr"] == s["lr"]]
        groups[f"{s['optimizer']} (lr {s['lr']:g})"] = runs
    plot_seed_bands(groups, out, title=title)


def run_sweep(optimizers: list[str], lrs: list[float], seeds: list[int], base: TrainConfig,
              out_dir: Path, *, finished_only: bool = False) -> list[dict]:
    """Grid of optimizer x lr x seed (run dirs ``out_dir/<optimizer>-lr<lr>-s<seed>``).

    Writes ``out_dir/sweep.md`` (:func:`format_sweep_table`: per optimizer at its best lr the mean
    final validation loss, its 95 % interval over seeds and the paired difference against
    :data:`REFERENCE`; then every optimizer x lr cell), ``out_dir/results.json``
    (``{"runs": rows, "summary": summarize_seeds(rows)}``) and ``out_dir/val_ppl.png`` (per
    optimizer at its best lr, the mean validation-perplexity curve over seeds with a min-max band).
    Returns one row per run. Finished runs are reused and interrupted ones resumed, so a sweep can be
    re-launched after a time limit. ``finished_only``: train nothing; tabulate the finished runs of
    the grid and list the others under "Not finished" in ``sweep.md`` (and ``results.json``'s
    ``"missing"``), e.g. to report a grid that is still running or was cut short.
    """
    if not (optimizers and lrs and seeds):
        raise ValueError("sweep needs at least one optimizer, one lr and one seed")
    for lr in lrs:
        check_positive("lr", lr)
    seeds = _check_seeds(seeds)
    _check_distinct("optimizers", optimizers)
    _check_distinct("lrs", lrs)
    out_dir = Path(out_dir)
    rows, missing, reused = [], [], []
    for name in optimizers:
        for lr in lrs:
            for seed in seeds:
                cfg = dataclasses.replace(base, optimizer=name, lr=lr, seed=seed, resume=None, stop_at_step=None,
                                          out=str(out_dir / run_name(name, lr=lr, seed=seed)))
                done = _finished_summary(Path(cfg.out), cfg) if finished_only else _train_or_reuse(cfg, reused)
                if done is None:
                    missing.append(Path(cfg.out).name)
                else:
                    rows.append(_row(done))
    if not rows:
        raise ValueError(f"no finished run of this grid in {out_dir}")
    _say_reused(reused, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize_seeds(rows)
    notes = grid_edge_notes(rows, summary)
    best = {(s["optimizer"], s["lr"]) for s in summary}
    if note := one_point_note([Path(r["run_dir"]) for r in rows if (r["optimizer"], r["lr"]) in best]):
        notes.append(f"val_ppl.png: {note} (one dot per optimizer).")
    notes_md = "\n\n" + "\n".join(f"- {n}" for n in notes) if notes else ""
    gone = f"\n\nNot finished ({len(missing)}): {', '.join(missing)}\n" if missing else "\n"
    (out_dir / "sweep.md").write_text(format_sweep_table(rows, summary) + notes_md + gone)
    extra = {"missing": missing} if missing else {}
    write_json(out_dir / "results.json", {"runs": rows, "summary": summary, **extra})
    _plot_summary(rows, summary, out_dir / "val_ppl.png", f"{base.model}: validation perplexity at the best lr")
    return rows


def grid_edge_notes(rows: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]]) -> list[str]:
    """One sentence per optimizer whose best lr is the smallest or largest of its (2+ lr) grid: the
    optimum may lie outside the grid, so the sentence names the next lr to try, one grid step further
    (the ratio between the edge and its neighbour, so 1e-3,2e-3,4e-3 -> 8e-3)."""
    notes = []
    for s in summary:
        grid = sorted({r["lr"] for r in rows if r["optimizer"] == s["optimizer"]})
        if len(grid) < 2 or s["lr"] not in (grid[0], grid[-1]):
            continue
        low = s["lr"] == grid[0]
        step = grid[1] / grid[0] if low else grid[-1] / grid[-2]
        nxt = float(f"{(s['lr'] / step if low else s['lr'] * step):.2g}")
        notes.append(f"{s['optimizer']}: the best lr {s['lr']:g} is the {'smallest' if low else 'largest'} of the "
                     f"grid ({', '.join(f'{x:g}' for x in grid)}); the optimum may lie "
                     f"{'below' if low else 'above'} it: try {nxt:g} next.")
    return notes


#: The optimizer every other one is compared against, seed by seed.
REFERENCE = "meqmuon"


def _cells(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, float], dict[int, float]]:
    """(optimizer, lr) -> {seed: final val loss}, in the order of ``rows``; a seed twice is an error."""
    cells: dict[tuple[str, float], dict[int, float]] = {}
    for r in rows:
        cell = cells.setdefault((r["optimizer"], r["lr"]), {})
        seed = r.get("seed")
        if seed in cell:
            raise ValueError(f"{r['optimizer']} lr {r['lr']:g} has seed {seed} twice ({r.get('run_dir')})")
        cell[seed] = float(r["final val loss"])
    return cells


def best_lrs(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per optimizer, the lr with the lowest mean final validation loss over the seeds run at it.

    Rule: the mean over all seeds of that (optimizer, lr) cell decides; lrs whose mean is not finite
    only win when no lr of that optimizer has a finite mean; ties go to the lr met first in ``rows``
    (the order given on the command line). The choice uses the same seeds that the intervals are then
    computed on, so the best lr's mean is slightly optimistic (selection); with few lrs this is small
    next to the seed spread, and a held-out seed set would remove it.
    """
    best: dict[str, tuple[bool, float, float]] = {}
    for (opt, lr), losses in _cells(rows).items():
        m = statistics.fmean(losses.values())
        key = (not math.isfinite(m), m if math.isfinite(m) else 0.0, lr)
        if opt not in best or key[:2] < best[opt][:2]:
            best[opt] = key
    return {opt: key[2] for opt, key in best.items()}


def summarize_seeds(rows: Sequence[dict[str, Any]], reference: str = REFERENCE) -> list[dict[str, Any]]:
    """Per optimizer (order of first appearance), at its best lr (:func:`best_lrs`): the mean and 95 %
    t interval of the final validation loss over seeds, and the paired difference against
    ``reference`` at *its* best lr on the seeds both have (:mod:`meqmuon.train.stats` has the formulas).

    Each entry: ``{"optimizer", "lr", "seeds", "val_loss": {mean, n, sd, half_width, low, high,
    confidence}, "reference", "vs_reference": {seeds, differences, mean, ..., low, high} or None}``.
    ``vs_reference`` is None for the reference itself, when the reference is not among ``rows``, or
    when the two share no seed.
    """
    cells = _cells(rows)
    best = best_lrs(rows)
    ref = cells.get((reference, best[reference])) if reference in best else None
    out = []
    for opt, lr in best.items():
        losses = cells[(opt, lr)]
        paired = None
        if ref is not None and opt != reference and set(losses) & set(ref):
            paired = paired_difference(losses, ref).as_dict()
        out.append({"optimizer": opt, "lr": lr, "seeds": sorted(losses), "val_loss": mean_interval(
            list(losses.values())).as_dict(), "reference": reference, "vs_reference": paired})
    return out


def _f(v: float | None, sign: bool = False) -> str:
    return "-" if v is None else (f"{v:+.4f}" if sign else f"{v:.4f}")


def _iv(d: dict[str, Any] | None, sign: bool = False) -> str:
    if d is None or d["low"] is None:
        return "-"
    return f"[{_f(d['low'], sign)}, {_f(d['high'], sign)}]"


def format_seed_summary(summary: Sequence[dict[str, Any]], *, lr_label: str = "best lr") -> str:
    """Markdown of :func:`summarize_seeds`: one row per optimizer with mean, 95 % interval, and the
    paired difference against the reference (Δ = optimizer - reference, per seed; Δ > 0: the
    reference's loss is lower). "-" where there is no interval (one seed) or no paired difference."""
    ref = summary[0]["reference"] if summary else REFERENCE
    lines = [f"| optimizer | {lr_label} | seeds | mean final val loss | 95 % interval | Δ vs {ref} (paired) | "
             "95 % interval of Δ | paired seeds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        v, d = s["val_loss"], s["vs_reference"]
        lines.append(f"| {s['optimizer']} | {s['lr']:g} | {v['n']} | {_f(v['mean'])} | {_iv(v)} | "
                     f"{_f(d['mean'], True) if d else '-'} | {_iv(d, True)} | {d['n'] if d else '-'} |")
    return "\n".join(lines)


def _head(rows: Sequence[dict[str, Any]]) -> str:
    caps = sorted({str(r["cpu_capability"]) for r in rows if r.get("cpu_capability")})
    precs = sorted({str(r["precision"]) for r in rows if r.get("precision")})
    # precision cells contain commas ("fp32, NS fp32"), so several are separated by " / "
    return f"CPU capability: {', '.join(caps)}; precision: {' / '.join(precs)}\n" if caps or precs else ""


BEST_LR_NOTE = "Best lr: the lowest mean final validation loss over seeds. "
SEED_NOTE = ("95 % interval: Student-t over seeds (n - 1 degrees of freedom), '-' for one seed. Δ: optimizer "
             "minus {ref} per seed, each at its own lr, on the seeds both have; Δ > 0 means {ref} reached the "
             "lower loss, and only an interval of Δ that excludes 0 resolves the order.")


def format_sweep_table(rows: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]] | None = None) -> str:
    """Markdown of a sweep: the seed summary per optimizer at its best lr (:func:`format_seed_summary`),
    then every (optimizer, lr) cell: seeds, mean / std / 95 % interval of the final val loss and
    ``exp(mean loss)`` ("mean perplexity"), the best lr of each optimizer in bold."""
    summary = summarize_seeds(rows) if summary is None else summary
    cells = _cells(rows)
    best = {s["optimizer"]: s["lr"] for s in summary}
    ref = summary[0]["reference"] if summary else REFERENCE
    lines = [_head(rows), BEST_LR_NOTE + SEED_NOTE.format(ref=ref), "", format_seed_summary(summary), "",
             "All runs (optimizer x lr), best lr in bold:", "",
             "| optimizer | lr | seeds | mean val loss | std | 95 % interval | mean perplexity |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for (opt, lr), losses in cells.items():
        iv = mean_interval(list(losses.values())).as_dict()
        mark = "**" if best.get(opt) == lr else ""
        sd = _f(iv["sd"]) if iv["sd"] is not None else "-"
        lines.append(f"| {opt} | {mark}{lr:g}{mark} | {iv['n']} | {mark}{iv['mean']:.4f}{mark} | {sd} | {_iv(iv)} | "
                     f"{math.exp(min(iv['mean'], 700)):.2f} |")
    return "\n".join(lines).lstrip("\n")
