"""``meqmuon compare`` and ``meqmuon sweep``: several runs that differ only in optimizer, lr and seed.

Every run of a comparison shares the model, the initial weights (same ``seed`` -> same init), the data
order (same ``seed`` -> same permutation of packed rows) and the validation set (cached, identical),
following the modded-nanogpt track-3 rule "fixed data, batch and architecture across optimizers".

Demo defaults (:func:`demo_config`): ``llama-tiny`` on the built-in corpus, 128-token sequences,
global batch 32, 100 updates (0.41M tokens, ~0.8 epoch of the ~0.5M-token corpus), evaluation every
20 updates on the whole held-out split (~30k tokens), precision ``auto`` (bf16 where the CPU runs it
natively, fp32 elsewhere), one CPU thread. 100 rather than the earlier 240 updates so that the
four runs finish in well under 10 minutes on 2 cores of an AVX2-only CPU too, shared or not
(issue #16; docs/training.md has the timings). Per-optimizer learning rates (:data:`DEMO_LRS`)
are the best of a pre-check grid at exactly this setting (docs/training.md lists it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meqmuon.train.config import TrainConfig, fill_model_defaults, resolve_numerics
from meqmuon.train.loop import train, write_json
from meqmuon.train.plot import plot_runs

__all__ = [
    "DEMO_OPTIMIZERS",
    "DEMO_LRS",
    "demo_config",
    "run_compare",
    "format_table",
    "run_sweep",
    "format_sweep_table",
]

DEMO_OPTIMIZERS = ["adamw", "muon", "normuon", "meqmuon"]

#: Learning rates of the demo: the best of a pre-check grid (100 updates, the demo's setting; AdamW
#: 1e-3/3e-3/1e-2, the others 1e-2/3e-2; docs/training.md has the numbers). SCALE and the ablations
#: were not pre-checked and use 1e-2.
DEMO_LRS: dict[str, float] = {
    "adamw": 3e-3,
    "muon": 1e-2,
    "normuon": 3e-2,
    "scale": 1e-2,
    "meqmuon": 3e-2,
    "meqmuon-only-hidden": 1e-2,
    "meqmuon-only-embedding": 1e-2,
    "meqmuon-only-vector": 1e-2,
}

TABLE_COLUMNS = ["optimizer", "lr", "final val loss", "perplexity", "bits/byte", "optimizer state (MiB)", "tokens/s",
                 "precision"]


def demo_config(**overrides: Any) -> TrainConfig:
    """The base config of ``meqmuon compare`` / ``meqmuon sweep`` (CPU-sized), with overrides."""
    # threads=1: on a CPU shared with other jobs, 2 threads on 2 cores stalled (OpenMP oversubscription:
    # 760-3,000 tokens/s against ~4,900 at 1 thread; 8,900 against 5,000 when idle), and the demo
    # must finish in 10 minutes on a shared 2-core machine. `--threads 2` is faster on an idle one.
    base = dict(model="llama-tiny", data="builtin", seq_len=128, global_batch=32, micro_batch=None, steps=100,
                eval_every=20, save_every=50, val_tokens=32768, keep_checkpoints=1, threads=1)
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
        # autocast precision and Newton-Schulz dtype actually used (runs from before issue #16: unknown)
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


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = TABLE_COLUMNS) -> str:
    """Markdown table of comparison rows, preceded by a line naming the CPU capability (the numbers
    depend on it through the precision: bf16 where native, fp32 elsewhere)."""
    caps = sorted({str(r["cpu_capability"]) for r in rows if r.get("cpu_capability")})
    head = [f"CPU capability: {', '.join(caps)}", ""] if caps else []
    lines = head + ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if c in ("optimizer", "precision") else "---:" for c in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(c, r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _finished_summary(run_dir: Path, cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of an already finished run with the same settings (so re-running compare is cheap)."""
    s, c = run_dir / "summary.json", run_dir / "config.json"
    if not (s.exists() and c.exists()):
        return None
    saved = json.loads(c.read_text())
    mine = dataclasses.asdict(_resolved(cfg))
    keys = ("model", "optimizer", "lr", "weight_decay", "optimizer_args", "data", "seq_len", "global_batch", "seed",
            "warmup_ratio", "min_lr_ratio", "clip", "precision", "val_tokens", "vocab_size")
    if any(saved.get(k) != mine.get(k) for k in keys) or (cfg.steps is not None and saved.get("steps") != cfg.steps):
        return None
    return json.loads(s.read_text())


def _resolved(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the model defaults and this machine's numerics filled in, as the run would store it
    (so that a finished run is reused only if "auto" resolves the same way here)."""
    from meqmuon.train.loop import _device

    c = fill_model_defaults(cfg)
    return resolve_numerics(c, _device(c, int(os.environ.get("LOCAL_RANK", "0"))))


def _train_or_reuse(cfg: TrainConfig) -> dict[str, Any]:
    run_dir = Path(cfg.out)
    done = _finished_summary(run_dir, cfg)
    if done is not None:
        return done
    if (run_dir / "summary.json").exists():
        raise ValueError(f"{run_dir} holds a finished run with different settings; choose another --out")
    return train(dataclasses.replace(cfg, resume="auto"))  # "auto" starts fresh when there is no checkpoint


def run_compare(optimizers: list[str], lrs: dict[str, float], base: TrainConfig, out_dir: Path) -> list[dict]:
    """Train ``base`` once per optimizer (run dirs ``out_dir/<optimizer>``) and tabulate the results.

    ``lrs`` maps optimizer -> lr; optimizers missing from it use ``base.lr`` if set, else
    :data:`DEMO_LRS`. Writes ``out_dir/table.md``, ``out_dir/results.json`` and
    ``out_dir/val_ppl.png`` (validation perplexity against tokens, one curve per optimizer).
    Finished runs with identical settings are reused, interrupted ones resumed.
    Returns the table rows (dicts keyed by :data:`TABLE_COLUMNS` plus ``seed`` and ``run_dir``).
    """
    if not optimizers:
        raise ValueError("no optimizers to compare")
    unknown = sorted(set(lrs) - set(optimizers))
    if unknown:
        raise ValueError(f"--lr given for optimizer(s) {unknown} that are not compared ({', '.join(optimizers)})")
    out_dir = Path(out_dir)
    rows = []
    for name in optimizers:
        lr = lrs.get(name, base.lr if base.lr is not None else DEMO_LRS.get(name))
        cfg = dataclasses.replace(base, optimizer=name, lr=lr, out=str(out_dir / name), resume=None,
                                  stop_at_step=None)
        rows.append(_row(_train_or_reuse(cfg)))
    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_table(rows)
    (out_dir / "table.md").write_text(table + "\n")
    write_json(out_dir / "results.json", rows)
    plot_runs([Path(r["run_dir"]) / "metrics.jsonl" for r in rows], out_dir / "val_ppl.png",
              labels=[f"{r['optimizer']} (lr {r['lr']:g})" for r in rows],
              title=f"{base.model}: validation perplexity")
    return rows


def run_sweep(optimizers: list[str], lrs: list[float], seeds: list[int], base: TrainConfig,
              out_dir: Path) -> list[dict]:
    """Grid of optimizer x lr x seed (run dirs ``out_dir/<optimizer>-lr<lr>-s<seed>``).

    Writes ``out_dir/sweep.md`` (mean and standard deviation over seeds of the final validation loss,
    best lr per optimizer marked) and ``out_dir/results.json``; returns one row per run. Finished
    runs are reused and interrupted ones resumed, so a sweep can be re-launched after a time limit.
    """
    if not (optimizers and lrs and seeds):
        raise ValueError("sweep needs at least one optimizer, one lr and one seed")
    for lr in lrs:
        if not lr > 0 or not math.isfinite(lr):
            raise ValueError(f"lr must be a positive number, got {lr!r}")
    out_dir = Path(out_dir)
    rows = []
    for name in optimizers:
        for lr in lrs:
            for seed in seeds:
                cfg = dataclasses.replace(base, optimizer=name, lr=lr, seed=seed, resume=None, stop_at_step=None,
                                          out=str(out_dir / f"{name}-lr{lr:g}-s{seed}"))
                rows.append(_row(_train_or_reuse(cfg)))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.md").write_text(format_sweep_table(rows) + "\n")
    write_json(out_dir / "results.json", rows)
    return rows


def format_sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: optimizer, lr, seeds, mean/std final val loss, mean perplexity; best lr per optimizer in bold."""
    cells: dict[tuple[str, float], list[float]] = {}
    for r in rows:
        cells.setdefault((r["optimizer"], r["lr"]), []).append(r["final val loss"])
    best: dict[str, float] = {}
    for (opt, lr), losses in cells.items():
        m = statistics.fmean(losses)
        if math.isfinite(m) and (opt not in best or m < statistics.fmean(cells[(opt, best[opt])])):
            best[opt] = lr
    caps = sorted({str(r["cpu_capability"]) for r in rows if r.get("cpu_capability")})
    precs = sorted({str(r["precision"]) for r in rows if r.get("precision")})
    head = [f"CPU capability: {', '.join(caps)}; precision: {'; '.join(precs)}", ""] if caps or precs else []
    lines = head + ["| optimizer | lr | seeds | mean val loss | std | mean perplexity |",
                    "|---|---:|---:|---:|---:|---:|"]
    for (opt, lr), losses in cells.items():
        m = statistics.fmean(losses)
        sd = statistics.stdev(losses) if len(losses) > 1 else 0.0
        mark = "**" if best.get(opt) == lr else ""
        lines.append(f"| {opt} | {mark}{lr:g}{mark} | {len(losses)} | {mark}{m:.4f}{mark} | {sd:.4f} | "
                     f"{math.exp(min(m, 700)):.2f} |")
    return "\n".join(lines)
