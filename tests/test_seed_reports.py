"""Seed-aware reports of ``sweep`` / ``compare --seeds N`` from hand-made rows (no training, fast).

What is checked: the best lr is the one with the lowest *mean* over seeds (not the best single run),
ties go to the lr given first; one seed shows "-" for every interval; the paired difference against
MeqMuon uses only the seeds both have, at each optimizer's own best lr, and equals the numbers worked
out by hand; "-" where MeqMuon is absent or for MeqMuon itself; the min-max band plot is written and
refuses runs evaluated at different token counts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meqmuon.train.compare import (
    best_lrs,
    format_compare_seeds_table,
    format_sweep_table,
    grid_edge_notes,
    summarize_seeds,
)
from meqmuon.train.plot import plot_seed_bands

T2 = 4.302652729749464  # t_{0.975, 2} = sqrt(2 * 0.95^2 / (1 - 0.95^2))


def row(opt: str, lr: float, seed: int, loss: float) -> dict:
    return {"optimizer": opt, "lr": lr, "seed": seed, "final val loss": loss, "perplexity": math.exp(loss),
            "cpu_capability": "AVX2", "precision": "fp32", "run_dir": f"/x/{opt}-lr{lr:g}-s{seed}"}


def grid() -> list[dict]:
    rows = []
    # muon: lr 1e-2 has the best single run (4.70) but the worse mean (5.0); 3e-2 has mean 4.9.
    for seed, loss in enumerate([4.70, 5.15, 5.15]):
        rows.append(row("muon", 1e-2, seed, loss))
    for seed, loss in enumerate([4.80, 4.90, 5.00]):
        rows.append(row("muon", 3e-2, seed, loss))
    # meqmuon: best lr 3e-2 with seeds 0, 1, 2 and an extra seed 3 that muon does not have.
    for seed, loss in enumerate([4.70, 4.70, 4.95, 3.00]):
        rows.append(row("meqmuon", 3e-2, seed, loss))
    for seed, loss in enumerate([6.0, 6.0, 6.0]):
        rows.append(row("meqmuon", 1e-2, seed, loss))
    return rows


def test_best_lr_is_the_lowest_mean_over_seeds_and_ties_go_to_the_first():
    rows = grid()
    assert best_lrs(rows) == {"muon": 3e-2, "meqmuon": 3e-2}
    tie = [row("adamw", 3e-3, 0, 5.0), row("adamw", 1e-3, 0, 5.0)]
    assert best_lrs(tie) == {"adamw": 3e-3}
    # A non-finite mean never beats a finite one.
    assert best_lrs([row("adamw", 1e-2, 0, float("nan")), row("adamw", 1e-3, 0, 7.0)]) == {"adamw": 1e-3}


def test_summary_pairs_on_shared_seeds_at_each_best_lr():
    summary = {s["optimizer"]: s for s in summarize_seeds(grid())}
    muon, ref = summary["muon"], summary["meqmuon"]
    assert muon["lr"] == 3e-2 and muon["seeds"] == [0, 1, 2]
    # muon at 3e-2: 4.80, 4.90, 5.00 -> mean 4.9, s = 0.1, half = t2 * 0.1 / sqrt(3) = 0.248414.
    assert muon["val_loss"]["mean"] == pytest.approx(4.9) and muon["val_loss"]["half_width"] == pytest.approx(
        T2 * 0.1 / math.sqrt(3))
    # meqmuon at 3e-2 over its four seeds: mean (4.70 + 4.70 + 4.95 + 3.00) / 4 = 4.3375.
    assert ref["val_loss"]["n"] == 4 and ref["val_loss"]["mean"] == pytest.approx(4.3375)
    assert ref["vs_reference"] is None  # the reference against itself: "-"
    # Paired on seeds 0, 1, 2 only: d = 0.10, 0.20, 0.05 -> mean 0.116667, half 0.189729.
    d = muon["vs_reference"]
    assert d["seeds"] == [0, 1, 2] and d["n"] == 3
    assert d["differences"] == pytest.approx([0.10, 0.20, 0.05])
    assert d["mean"] == pytest.approx(0.116667, abs=1e-6) and d["half_width"] == pytest.approx(0.189729, abs=1e-6)
    assert d["low"] == pytest.approx(0.116667 - 0.189729, abs=1e-6)


def test_sweep_table_shows_summary_intervals_and_all_cells():
    text = format_sweep_table(grid())
    lines = text.splitlines()
    assert lines[0] == "CPU capability: AVX2; precision: fp32"
    assert "| muon | 0.03 | 3 | 4.9000 | [4.6516, 5.1484] | +0.1167 | [-0.0731, +0.3064] | 3 |" in lines
    assert "| meqmuon | 0.03 | 4 | 4.3375 |" in text and any(
        ln.startswith("| meqmuon | 0.03 | 4 |") and ln.endswith("| - | - | - |") for ln in lines)
    # Every optimizer x lr cell is kept, the best lr bold (muon 3e-2 and meqmuon 3e-2, not muon 1e-2).
    assert "| muon | **0.03** | 3 | **4.9000** | 0.1000 | [4.6516, 5.1484] | 134.29 |" in lines
    assert "| muon | 0.01 | 3 | 5.0000 |" in text and "| meqmuon | 0.01 | 3 | 6.0000 | 0.0000 |" in text


def test_one_seed_has_no_interval_and_no_reference_means_no_difference():
    text = format_sweep_table([row("adamw", 3e-3, 0, 6.08), row("meqmuon", 3e-2, 0, 4.85)])
    assert "| adamw | 0.003 | 1 | 6.0800 | - | +1.2300 | - | 1 |" in text
    assert "| meqmuon | 0.03 | 1 | 4.8500 | - | - | - | - |" in text
    assert "| adamw | **0.003** | 1 | **6.0800** | - | - | 437.03 |" in text  # std and interval: "-"
    without = format_sweep_table([row("adamw", 3e-3, 0, 6.0), row("adamw", 3e-3, 1, 6.2)])
    assert "| adamw | 0.003 | 2 | 6.1000 | [4.8294, 7.3706] | - | - | - |" in without
    with pytest.raises(ValueError, match="seed 0 twice"):
        format_sweep_table([row("adamw", 3e-3, 0, 6.0), row("adamw", 3e-3, 0, 6.2)])


def test_compare_seeds_table_lists_summary_then_runs():
    rows = [row("adamw", 3e-3, 0, 6.0), row("adamw", 3e-3, 1, 6.2), row("meqmuon", 3e-2, 0, 4.8),
            row("meqmuon", 3e-2, 1, 4.9)]
    text = format_compare_seeds_table(rows)
    # adamw - meqmuon per seed: 1.2, 1.3 -> mean 1.25, s = 0.070711, half = 12.706205 * 0.05 = 0.635310.
    assert "| adamw | 0.003 | 2 | 6.1000 | [4.8294, 7.3706] | +1.2500 | [+0.6147, +1.8853] | 2 |" in text
    assert text.index("| optimizer | lr | seeds |") < text.index("Runs:") < text.index("| optimizer | lr | seed |")
    assert "| meqmuon | 0.03 | 1 | 4.9000 |" in text  # the per-run row of seed 1


def _metrics(path: Path, tokens: list[int], ppl: list[float]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "eval", "step": i + 1, "tokens": t, "val_ppl": p}) + "\n"
        for i, (t, p) in enumerate(zip(tokens, ppl, strict=True))))
    return path


def test_seed_band_plot_is_written_and_refuses_mismatched_evaluations(tmp_path):
    a0 = _metrics(tmp_path / "a0", [100, 200], [50.0, 30.0])
    a1 = _metrics(tmp_path / "a1", [100, 200], [60.0, 35.0])
    b0 = _metrics(tmp_path / "b0", [100, 200], [40.0, 25.0])
    out = plot_seed_bands({"a (lr 0.01)": [a0, a1], "b (lr 0.03)": [b0]}, tmp_path / "p.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    odd = _metrics(tmp_path / "odd", [100, 300], [60.0, 35.0])
    with pytest.raises(ValueError, match="different token counts"):
        plot_seed_bands({"a": [a0, odd]}, tmp_path / "q.png")
    with pytest.raises(ValueError, match="at least one run"):
        plot_seed_bands({"a": []}, tmp_path / "q.png")


def test_a_best_lr_at_the_grid_edge_is_named_with_the_next_lr_to_try():
    """Both optimizers of ``grid()`` are best at 3e-2, the larger of {1e-2, 3e-2}: the note names the
    next lr one grid step further (x3). Best in the middle of a 3-lr grid: no note; best at the
    smallest: the step below (1e-3, 2e-3, 4e-3 -> 5e-4); one lr is no grid: no note."""
    rows = grid()
    assert grid_edge_notes(rows, summarize_seeds(rows)) == [
        f"{o}: the best lr 0.03 is the largest of the grid (0.01, 0.03); the optimum may lie above it: try 0.09 next."
        for o in ("muon", "meqmuon")]
    middle = [row("adamw", 1e-3, 0, 6.0), row("adamw", 2e-3, 0, 5.0), row("adamw", 4e-3, 0, 5.5)]
    assert grid_edge_notes(middle, summarize_seeds(middle)) == []
    low = [row("adamw", 4e-3, 0, 6.0), row("adamw", 2e-3, 0, 5.5), row("adamw", 1e-3, 0, 5.0)]
    assert grid_edge_notes(low, summarize_seeds(low)) == [
        "adamw: the best lr 0.001 is the smallest of the grid (0.001, 0.002, 0.004); the optimum may lie below it: "
        "try 0.0005 next."]
    one = [row("adamw", 1e-3, 0, 5.0)]
    assert grid_edge_notes(one, summarize_seeds(one)) == []
