"""Plots a paper could use: titles inside the canvas, token axes as 100k / 1M, log ticks that bracket
the data, and ``meqmuon plot`` naming and titling its output from the runs it was given.

The runs are written by hand (``metrics.jsonl`` + ``config.json``), so the values are known exactly;
the figure is inspected through matplotlib's own renderer (tick values, labels and text extents).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest

from meqmuon.cli import main
from meqmuon.train import plot as plot_mod
from meqmuon.train.plot import default_output, default_title, log_ticks, plot_runs, plot_seed_bands, token_label

matplotlib.use("Agg")


def fake_run(d: Path, optimizer: str, lr: float, ppl: list[float], tokens_per_eval: int = 100_000,
             seed: int = 0) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model": "llama-tiny", "optimizer": optimizer, "lr": lr,
                                               "seed": seed}))
    lines = [json.dumps({"kind": "eval", "step": i + 1, "tokens": (i + 1) * tokens_per_eval, "val_ppl": v,
                         "val_loss": 1.0}) for i, v in enumerate(ppl)]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions close, kept for inspection."""
    import matplotlib.pyplot as plt

    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for f in kept:
        close(f)


@pytest.mark.parametrize(("lo", "hi", "want"), [
    (128.24, 142.0, [120, 130, 140, 150]),  # the demo's final values: a tick below and above
    (128.24, 610.0, [100, 200, 500, 1000]),
    (4.85, 6.08, [4, 5, 6, 8]),
    (1.0, 1e6, [1, 10, 100, 1000, 1e4, 1e5, 1e6]),
    (1.0, 1.0, [0.95, 0.96, 0.97, 0.98, 0.99, 1.0, 1.1]),  # one value: widened 5 % each way first
])
def test_log_ticks_bracket_the_data(lo, hi, want):
    ticks = log_ticks(lo, hi)
    assert ticks == pytest.approx(want)
    assert ticks[0] <= lo and ticks[-1] >= hi and len(ticks) >= 4


def test_token_labels():
    assert [token_label(x) for x in (0, 500, 100_000, 1e6, 2.5e6, 1.16e9)] == ["0", "500", "100k", "1M", "2.5M",
                                                                                 "1.16B"]


def test_axes_and_a_long_title_stay_readable_and_inside_the_canvas(tmp_path, figures):
    a = fake_run(tmp_path / "runs" / "compare" / "muon", "muon", 1e-2, [610.0, 300.0, 141.99])
    b = fake_run(tmp_path / "runs" / "compare" / "meqmuon", "meqmuon", 3e-2, [590.0, 280.0, 128.24])
    title = "llama-tiny: validation perplexity of every optimizer of the demo at its own best learning rate, " * 2
    out = plot_runs([a, b], tmp_path / "p.png", title=title)
    assert out.read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    box, canvas = ax.title.get_window_extent(renderer), fig.bbox
    assert canvas.x0 <= box.x0 and box.x1 <= canvas.x1 and box.y1 <= canvas.y1, (box, canvas)
    lo, hi = ax.get_ylim()
    assert lo <= 128.24 and hi >= 610.0
    ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
    assert ticks[0] <= 128.24 and ticks[-1] >= 610.0
    assert [t.get_text() for t in ax.get_yticklabels()] == ["100", "200", "500", "1,000"]
    assert ax.yaxis.get_minorticklocs().size == 0  # no "2x10^2" minor labels
    fig.canvas.draw()
    xlabels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert "100k" in xlabels and "300k" in xlabels and not any("e" in x or len(x) > 5 for x in xlabels), xlabels
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["muon (lr 0.01)", "meqmuon (lr 0.03)"]


def test_seed_band_plot_brackets_the_band(tmp_path, figures):
    runs = [fake_run(tmp_path / f"s{s}", "meqmuon", 3e-2, [500.0 - 10 * s, 150.0 - 20 * s], seed=s) for s in (0, 1)]
    plot_seed_bands({"meqmuon": runs}, tmp_path / "band.png", title="t")
    ax = figures[0].axes[0]
    lo, hi = ax.get_ylim()
    assert lo <= 130.0 and hi >= 500.0


def test_plot_command_names_and_titles_its_output_from_the_runs(tmp_path, monkeypatch, capsys, figures):
    monkeypatch.chdir(tmp_path)
    for opt in ("adamw", "meqmuon"):
        fake_run(Path("runs") / "compare" / opt, opt, 3e-3, [700.0, 400.0])
    # The README's command after the demo, as the shell expands it; and the directory itself.
    files = sorted(str(p) for p in Path("runs").glob("compare/*/metrics.jsonl"))
    assert main(["plot", *files]) == 0
    want = Path("runs/compare/val_ppl-adamw-meqmuon.png")
    assert capsys.readouterr().out.strip() == str(want) and want.read_bytes()[:4] == b"\x89PNG"
    assert figures[-1].axes[0].get_title() == "llama-tiny: validation perplexity (runs/compare)"
    assert main(["plot", "runs/compare"]) == 0 and capsys.readouterr().out.strip() == str(want)
    assert main(["plot", "runs/compare/meqmuon", "--metric", "val_loss"]) == 0
    assert capsys.readouterr().out.strip() == "runs/compare/meqmuon/val_loss.png"
    assert not Path("plot.png").exists()
    assert default_output(["runs/compare"], "val_ppl") == want
    assert default_title(["runs/compare/adamw"]) == "llama-tiny: validation perplexity (runs/compare/adamw)"
    assert plot_mod.run_label(Path("runs/compare/adamw/metrics.jsonl")) == "adamw (lr 0.003)"


def test_an_optimizer_has_one_colour_in_every_figure(tmp_path, figures):
    """The demo's figure (runs in the demo's order), ``meqmuon plot`` over the shell's alphabetical
    glob, and a seed-band figure draw each optimizer in the same colour; a second lr of one optimizer
    keeps its colour with another line style; an unknown optimizer gets a colour nobody else has."""
    from matplotlib.colors import to_hex

    demo_order = ["adamw", "muon", "normuon", "meqmuon"]
    runs = {o: fake_run(tmp_path / o, o, 1e-2, [600.0, 300.0 + i]) for i, o in enumerate(demo_order)}

    def colours(fig):
        lines = fig.axes[0].get_lines()
        return {line.get_label().split(" ")[0].rstrip(":"): to_hex(line.get_color()) for line in lines}

    plot_runs([runs[o] for o in demo_order], tmp_path / "demo.png")
    plot_runs([runs[o] for o in sorted(demo_order)], tmp_path / "glob.png")
    plot_seed_bands({o: [runs[o]] for o in reversed(demo_order)}, tmp_path / "bands.png")
    demo, glob_order, bands = (colours(f) for f in figures)
    assert demo == glob_order == {o: to_hex(c) for o, c in bands.items()} and len(set(demo.values())) == 4
    assert demo["meqmuon"] == to_hex("C3") and demo["adamw"] == to_hex("C0")

    other = fake_run(tmp_path / "meq2", "meqmuon", 3e-2, [500.0, 250.0])
    odd = fake_run(tmp_path / "odd", "lion", 1e-3, [500.0, 250.0])
    plot_runs([runs["meqmuon"], other, odd, runs["adamw"]], tmp_path / "mixed.png")
    lines = figures[-1].axes[0].get_lines()
    assert to_hex(lines[0].get_color()) == to_hex(lines[1].get_color()) == to_hex("C3")
    assert lines[0].get_linestyle() != lines[1].get_linestyle()
    assert to_hex(lines[2].get_color()) not in {to_hex("C3"), to_hex("C0")}
