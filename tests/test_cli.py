"""The ``meqmuon`` command: bad input gives one clear line and a non-zero exit, and loses nothing.

Each error case checks three things: the exit status is non-zero, stderr is exactly one line starting
with ``meqmuon: error:`` that names the problem, and files already in the run directory are untouched.
Also covered: ``--stop-at-step`` + a bare ``--resume auto`` (config read back from the run), ``plot``,
``sweep`` and ``python -m meqmuon``; and a table of bad inputs to every command (train, compare, sweep,
prepare, plot, diagnose, memory, ablation), argparse's syntax errors included, each of which must
print exactly one ``meqmuon: error:`` line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meqmuon.cli import main, parse_count
from meqmuon.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def small(cache: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "llama-tiny", "--vocab-size", "512", "--seq-len", "32", "--global-batch", "8",
            "--steps", "4", "--eval-every", "2", "--val-tokens", "256", "--cache-dir", cache, "--out", str(out),
            "--quiet", *extra]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("meqmuon: error: ")
    return err[0]


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} if d.exists() else {}


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--model", "llama-huge"], "unknown model 'llama-huge'; valid models: llama-60m"),
        (["--optimizer", "sgd"], "unknown optimizer 'sgd'; valid optimizers: adamw, muon"),
        (["--lr", "0"], "lr must be a positive number"),
        (["--lr=-1e-3"], "lr must be a positive number"),
        (["--tokens", "0"], "tokens must be a positive number"),
        (["--global-batch", "-8"], "global_batch must be a positive number"),
        (["--micro-batch", "3"], "global batch 8 is not divisible by world size 1 x micro batch 3"),
        (["--optimizer-arg", "betaz=0.9"], "unknown optimizer argument(s) ['betaz']"),
        (["--data", "/nonexistent/corpus.jsonl"], "data path does not exist"),
        (["--model", "llama-tiny-tied", "--optimizer", "scale"], "tied"),
    ],
)
def test_bad_input_is_one_line_error(cache, tmp_path, capsys, extra, needle):
    assert main(small(cache, tmp_path / "run", *extra)) == 1
    assert needle in one_error_line(capsys)
    assert not (tmp_path / "run").exists()  # nothing was created


def test_data_file_without_text(cache, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(small(cache, tmp_path / "run", "--data", str(empty))) == 1
    assert "holds no text" in one_error_line(capsys)


def test_unknown_config_key(cache, tmp_path, capsys):
    cfg = tmp_path / "exp.json"
    cfg.write_text(json.dumps({"model": "llama-tiny", "learning_rate": 1e-3}))
    assert main(small(cache, tmp_path / "run", "--config", str(cfg))) == 1
    line = one_error_line(capsys)
    assert "unknown config key(s) ['learning_rate']" in line and "valid keys: model, optimizer" in line


def test_unknown_compare_optimizer(capsys, tmp_path):
    assert main(["compare", "--optimizers", "adamw,lion", "--out", str(tmp_path / "c")]) == 1
    assert "unknown optimizer(s) ['lion']" in one_error_line(capsys)
    assert main(["compare", "--lr", "adamw=-1", "--out", str(tmp_path / "c")]) == 1
    assert "positive, finite VALUE" in one_error_line(capsys)


def test_stop_then_bare_resume_auto_and_protection_of_existing_runs(cache, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(small(cache, run, "--optimizer", "meqmuon", "--lr", "1e-2", "--stop-at-step", "2")) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_0000002.pt"
    before = snapshot(run)

    # Starting again without --resume must refuse and keep everything.
    assert main(small(cache, run)) == 1
    assert "already holds a run; pass --resume auto" in one_error_line(capsys)
    assert snapshot(run) == before

    # Resuming with a different trajectory-defining setting is refused too.
    assert main(["train", "--out", str(run), "--resume", "auto", "--lr", "5e-3", "--quiet"]) == 1
    assert "does not match this run: it has lr=0.01" in one_error_line(capsys)
    assert snapshot(run) == before

    # A bare `--resume auto --out DIR` continues with the run's own config.
    assert main(["train", "--out", str(run), "--resume", "auto", "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["optimizer"] == "meqmuon" and summary["lr"] == 1e-2
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]
    config = json.loads((run / "config.json").read_text())
    assert config["micro_batch"] == 8 and config["tokens"] == 4 * 8 * 32 and config["stop_at_step"] is None


def test_corrupt_checkpoint_is_reported_and_kept(cache, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(small(cache, run, "--stop-at-step", "2", "--save-every", "100")) == 0
    (ckpt,) = (run / "checkpoints").iterdir()
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated, as after a disk-full copy
    before = snapshot(run)
    assert main(["train", "--out", str(run), "--resume", "auto", "--quiet"]) == 1
    assert f"cannot read checkpoint {ckpt}: truncated or damaged" in one_error_line(capsys)
    assert snapshot(run) == before

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    assert main(small(cache, tmp_path / "other", "--resume", str(garbage))) == 1
    line = one_error_line(capsys)
    assert f"cannot read checkpoint {garbage}:" in line and len(line) < 120 + len(str(garbage)), line

    assert main(small(cache, tmp_path / "other", "--resume", str(tmp_path / "missing.pt"))) == 1
    assert "--resume path does not exist" in one_error_line(capsys)


def test_resume_auto_skips_a_corrupt_newest_checkpoint(cache, tmp_path, capsys):
    """The newest checkpoint truncated (as a full disk or a bad copy leaves it): ``--resume auto`` warns
    once, naming it, and continues from the older kept one, bit for bit (the final validation loss and
    every logged loss equal an uninterrupted run's). With no readable checkpoint left the error is one
    short line naming the file, not torch's ~400 characters of zip-reader advice."""
    straight = tmp_path / "straight"
    assert main(small(cache, straight)) == 0
    run = tmp_path / "run"
    assert main(small(cache, run, "--save-every", "1", "--stop-at-step", "3")) == 0
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_0000002.pt", "step_0000003.pt"]
    newest = run / "checkpoints" / "step_0000003.pt"
    newest.write_bytes(newest.read_bytes()[:2000])
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "auto", "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meqmuon: warning: skipping unreadable checkpoint "), err
    assert str(newest) in err[0] and "truncated or damaged" in err[0] and "step_0000002.pt" in err[0]
    assert err[0].endswith("; resuming from step_0000002.pt") and len(err[0]) < 150 + len(str(newest)), err[0]
    got, want = (json.loads((d / "summary.json").read_text()) for d in (run, straight))
    assert got["val_loss"] == want["val_loss"]
    losses = [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert losses == [(r["step"], r["loss"]) for r in read_metrics(straight / "metrics.jsonl") if r["kind"] == "train"]

    # Nothing readable: one short line naming the newest file; nothing touched.
    only = tmp_path / "only"
    assert main(small(cache, only, "--save-every", "100", "--stop-at-step", "2")) == 0
    (ckpt,) = (only / "checkpoints").iterdir()
    ckpt.write_bytes(ckpt.read_bytes()[:2000])
    before = snapshot(only)
    capsys.readouterr()
    assert main(["train", "--out", str(only), "--resume", "auto", "--quiet"]) == 1
    line = one_error_line(capsys)
    assert line == (f"meqmuon: error: cannot read checkpoint {ckpt}: "
                    "truncated or damaged (not a complete torch zip file)")
    assert snapshot(only) == before


def test_resume_auto_without_a_run_says_so_and_starts_one(cache, tmp_path, capsys):
    """``--resume auto`` with the run's settings where there is no checkpoint (the first launch of a job script
    that always passes it) starts a new run, with one line saying that none was found there."""
    run = tmp_path / "typo"
    assert main(small(cache, run, "--steps", "2", "--resume", "auto")) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"meqmuon: note: --resume auto found no checkpoint in {run}; starting a new run there"]
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def test_resume_auto_on_a_mistyped_out_names_the_nearest_run_and_starts_nothing(cache, tmp_path, capsys,
                                                                                monkeypatch):
    """``--resume auto --out DIR`` alone (the line a stopped run prints) where DIR holds no run: one line naming
    the nearest run directory and how to start a new run there; nothing created, nothing trained. Also on the
    directory of the runs, and on a directory whose parent does not exist. (Before: a new run of all defaults,
    8,986 updates of llama-tiny, after a note line; here ``_train`` fails the test if it is reached.)"""
    from meqmuon.train import loop as loop_mod

    run = tmp_path / "exp1"
    assert main(small(cache, run, "--stop-at-step", "2")) == 0

    def started(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(loop_mod, "_train", started)
    capsys.readouterr()
    typo, missing = tmp_path / "epx1", tmp_path / "nope" / "exp1"
    for out, line in (
        (typo, f"--resume auto: {typo} does not exist; nearest run directory: {run}; to start a new run there, give "
               "its settings (--model, --optimizer, ... or --config)"),
        (tmp_path, f"--resume auto: {tmp_path} is not a run but holds run directories ({run}); give one of them "
                   "to --out"),
        (missing, f"--resume auto: {missing} does not exist (nor does {missing.parent}); to start a new run there, "
                  "give its settings (--model, --optimizer, ... or --config)"),
    ):
        assert main(["train", "--out", str(out), "--resume", "auto", "--quiet", "--threads", "1"]) == 1
        assert one_error_line(capsys) == f"meqmuon: error: {line}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp1"]


def test_resume_auto_restarts_a_run_that_stopped_before_its_first_checkpoint(cache, tmp_path, capsys):
    """A run killed before it saved anything holds its ``config.json`` (and a log) but no checkpoint: a bare
    ``--resume auto`` starts it again from step 0 with its own settings, and says so in one line."""
    import shutil

    run = tmp_path / "run"
    assert main(small(cache, run, "--optimizer", "adamw", "--stop-at-step", "2")) == 0
    shutil.rmtree(run / "checkpoints")  # as SIGKILL before the first save leaves it
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "auto", "--quiet"]) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"meqmuon: note: --resume auto found no checkpoint in {run} (the run stopped before its first one); "
        "starting it again from step 0"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["optimizer"] == "adamw" and summary["steps"] == 4
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]


def test_stop_at_a_step_the_run_has_passed_is_one_line(cache, tmp_path, capsys):
    """``--resume auto --stop-at-step K`` where the checkpoint is at step K or later: one line, nothing touched
    (before: it trained one more update and stopped there)."""
    run = tmp_path / "run"
    assert main(small(cache, run, "--save-every", "1", "--stop-at-step", "3")) == 0
    before = snapshot(run)
    capsys.readouterr()
    for k in (2, 3):
        assert main(["train", "--out", str(run), "--resume", "auto", "--stop-at-step", str(k), "--quiet"]) == 1
        assert one_error_line(capsys) == (
            f"meqmuon: error: --stop-at-step {k}: the run is already at step 3 (checkpoint "
            f"{run / 'checkpoints' / 'step_0000003.pt'}); give a later step, or leave it out to train to the end")
        assert snapshot(run) == before


@pytest.mark.parametrize("argv", [
    ["train", "--steps", "2"], ["compare", "--steps", "2"], ["sweep", "--optimizers", "adamw", "--lrs", "1e-3"],
    ["prepare", "--data", "pysrc"], ["memory"], ["diagnose", "selection", "--run", "{run}"],
    ["ablation", "--steps", "1"],
], ids=lambda argv: argv[0])
def test_out_that_is_a_file_is_one_line(captured, tmp_path, capsys, argv):
    """``--out README.md`` (an existing file), or a directory below one: one line naming the file, nothing
    written (before: ``[Errno 17] File exists: 'README.md'`` or ``[Errno 20] Not a directory``, after the run's
    data was built)."""
    readme = tmp_path / "README.md"
    readme.write_text("keep me\n")
    argv = [str(captured) if a == "{run}" else a for a in argv]
    for out, what in ((readme, f"{readme} is a file"), (readme / "run", f"{readme} (in {readme / 'run'}) is a file")):
        assert main([*argv, "--out", str(out)]) == 1
        assert one_error_line(capsys) == f"meqmuon: error: --out {what}, not a directory; choose a directory for --out"
    assert readme.read_text() == "keep me\n" and [p.name for p in tmp_path.iterdir()] == ["README.md"]


def test_first_run_says_it_trains_the_bpe_and_its_first_line_names_the_layout(tmp_path, capsys):
    """On a fresh data cache the built-in BPE is trained first (silently, before): one line says so and
    roughly how long, then the run's first log line, which names the layout (``1 process``; "world 1"
    before); with ``--quiet`` neither."""
    argv = [a for a in small(str(tmp_path / "cache"), tmp_path / "run", "--steps", "1") if a != "--quiet"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"meqmuon: training the built-in BPE tokenizer \(512 ids\) on 1\.\d MB of text, once: roughly "
                        r"a second \(~3 MB/s on 2 cores\); cached in .*", err[0]), err
    assert err[1].startswith("[meqmuon] llama-tiny (") and " | 1 process, micro-batch 8, accum 1 | " in err[1], err
    assert main(small(str(tmp_path / "cache2"), tmp_path / "run2", "--steps", "1")) == 0
    assert capsys.readouterr().err == ""


def test_checkpoint_of_another_model_is_rejected(cache, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(small(cache, run, "--stop-at-step", "2")) == 0
    ckpt = str(run / "checkpoints" / "step_0000002.pt")
    assert main(small(cache, tmp_path / "x", "--model", "qwen2-tiny", "--resume", ckpt)) == 1
    assert "does not match this run: it has model='llama-tiny'" in one_error_line(capsys)


def test_nan_loss_exits_nonzero_and_names_the_step(cache, tmp_path, capsys):
    run = tmp_path / "nan"
    assert main(small(cache, run, "--optimizer", "adamw", "--lr", "1e30", "--steps", "20", "--save-every", "1")) == 1
    line = one_error_line(capsys)
    assert "at step" in line and ("nan" in line or "inf" in line) and "last good checkpoint" in line
    assert not (run / "summary.json").exists()


def test_plot_and_sweep(cache, tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["sweep", "--optimizers", "adamw", "--lrs", "1e-3,3e-3", "--seeds", "0", "--vocab-size", "512",
            "--seq-len", "32", "--global-batch", "8", "--steps", "3", "--eval-every", "3", "--val-tokens", "256",
            "--cache-dir", cache, "--out", str(out), "--quiet"]
    assert main(args) == 0
    table = (out / "sweep.md").read_text()
    assert "| adamw | " in table and table.count("**") == 4  # exactly one best lr, bold in two cells
    results = json.loads((out / "results.json").read_text())
    losses = {r["lr"]: r["final val loss"] for r in results["runs"]}
    (best,) = results["summary"]
    assert best["lr"] == min(losses, key=losses.get) and best["val_loss"]["n"] == 1
    # One seed: no interval ("-"), and no MeqMuon in the sweep: no paired difference ("-").
    assert f"| adamw | {best['lr']:g} | 1 | {losses[best['lr']]:.4f} | - | - | - | - |" in table
    assert (out / "val_ppl.png").read_bytes()[:4] == b"\x89PNG"
    # The best lr is at an edge of this 2-lr grid, and each run evaluated once: sweep.md (which the
    # command prints) says both.
    edge = ("adamw: the best lr 0.001 is the smallest of the grid (0.001, 0.003); the optimum may lie below it: "
            "try 0.00033 next." if best["lr"] == 1e-3 else
            "adamw: the best lr 0.003 is the largest of the grid (0.001, 0.003); the optimum may lie above it: "
            "try 0.009 next.")
    printed, err = capsys.readouterr()
    assert f"- {edge}" in table and edge in printed and "reused" not in err
    # the same command again trains nothing, and says so in one line
    assert main(args) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"meqmuon: reused 2 finished run(s) with the same settings in {out}: adamw-lr0.001-s0, adamw-lr0.003-s0 "
        "(to train them again, delete them or choose another --out)"]
    assert "- val_ppl.png: one evaluation per run (at the end): --eval-every N draws curves" in table
    assert main(["plot", str(out / "adamw-lr0.001-s0" / "metrics.jsonl"), str(out / "adamw-lr0.003-s0"),
                 "--out", str(tmp_path / "p.png"), "--metric", "loss"]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "q.png")]) == 1
    assert "metrics file does not exist" in one_error_line(capsys)


def test_compare_seeds_end_to_end(cache, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cmp"
    args = ["compare", "--optimizers", "adamw,meqmuon", "--seeds", "2", "--vocab-size", "512", "--seq-len", "32",
            "--global-batch", "8", "--steps", "3", "--eval-every", "3", "--val-tokens", "256", "--cache-dir", cache,
            "--out", str(out), "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["adamw-s0", "adamw-s1", "meqmuon-s0",
                                                                    "meqmuon-s1"]
    results = json.loads((out / "results.json").read_text())
    loss = {(r["optimizer"], r["seed"]): r["final val loss"] for r in results["runs"]}
    assert len(loss) == 4 and loss[("adamw", 0)] != loss[("adamw", 1)]  # the seeds really differ
    adamw, meq = results["summary"]
    assert (adamw["optimizer"], adamw["seeds"], meq["optimizer"]) == ("adamw", [0, 1], "meqmuon")
    # The paired difference is adamw - meqmuon seed by seed, recomputed here from the runs' own losses.
    d = [loss[("adamw", s)] - loss[("meqmuon", s)] for s in (0, 1)]
    half = 12.706204736 * abs(d[0] - d[1]) / 2  # n = 2: s = |d0 - d1| / sqrt(2), half = t1 * s / sqrt(2)
    got = adamw["vs_reference"]
    assert got["differences"] == pytest.approx(d) and got["mean"] == pytest.approx(sum(d) / 2)
    assert got["half_width"] == pytest.approx(half, rel=1e-8) and meq["vs_reference"] is None
    table = (out / "table.md").read_text()
    assert table in printed
    assert f"| adamw | 0.003 | 2 | {(loss[('adamw', 0)] + loss[('adamw', 1)]) / 2:.4f} | [" in table
    assert f"| {sum(d) / 2:+.4f} | [{sum(d) / 2 - half:+.4f}, {sum(d) / 2 + half:+.4f}] | 2 |" in table
    png = out / "val_ppl.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # Finished runs are reused: no training the second time, same table.
    from meqmuon.train import loop as loop_mod

    monkeypatch.setattr(loop_mod, "_train", None)
    assert main(args) == 0 and (out / "table.md").read_text() == table


def test_bad_seeds_are_clear_errors(tmp_path, capsys):
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as e:
            main(["compare", "--seeds", bad, "--out", str(tmp_path / "c")])
        assert e.value.code == 2
        assert "argument --seeds: expected a number of seeds >= 1" in capsys.readouterr().err
    assert main(["compare", "--seeds", "2", "--seed", "3", "--out", str(tmp_path / "c")]) == 1
    assert "--seed 3 and --seeds 2 together" in one_error_line(capsys)
    assert main(["sweep", "--optimizers", "adamw", "--lrs", "1e-3", "--seeds", "0,0", "--out",
                 str(tmp_path / "s")]) == 1
    assert "seeds must be distinct" in one_error_line(capsys)
    assert main(["sweep", "--optimizers", "adamw", "--lrs", "1e-3,0.001", "--out", str(tmp_path / "s")]) == 1
    assert "lrs must be distinct" in one_error_line(capsys)
    assert main(["compare", "--optimizers", "adamw,adamw", "--seeds", "2", "--out", str(tmp_path / "c")]) == 1
    assert "optimizers must be distinct" in one_error_line(capsys)
    assert not (tmp_path / "c").exists() and not (tmp_path / "s").exists()


def test_parse_count():
    assert parse_count("1.16B") == 1_160_000_000 and parse_count("500k") == 500_000 and parse_count("2e6") == 2_000_000


def test_python_dash_m_and_argparse_errors(capsys):
    """``python -m meqmuon`` runs (one launch: ``--help``); an argparse error exits 2 with one line, and the
    commands' help has no literal ``%%`` (those through ``main``, in this process)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    help_ = subprocess.run([sys.executable, "-m", "meqmuon", "--help"], env=env, capture_output=True, text=True)
    assert help_.returncode == 0
    for cmd in ("train", "compare", "sweep", "plot"):
        assert cmd in help_.stdout
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        main(["train", "--lr", "abc"])
    assert bad.value.code == 2 and capsys.readouterr().err == (
        "meqmuon: error: argument --lr: invalid float value: 'abc' (see `meqmuon train --help`)\n")
    for cmd in ("compare", "sweep"):  # no literal "95%%" from a description argparse does not %-format
        with pytest.raises(SystemExit) as done:
            main([cmd, "--help"])
        text = capsys.readouterr().out
        assert done.value.code == 0 and "%%" not in text and "95 %" in text, cmd


#: What ``--help`` and argparse's errors must answer without: torch (~2 s to import; ``meqmuon --help`` took
#: 2.6-10.9 s with it, issue 56) and the packages the commands import when they need them.
HEAVY = ("torch", "transformers", "matplotlib", "tensorboard", "datasets", "tokenizers", "scipy")


def test_help_and_argument_errors_import_no_torch():
    """``meqmuon --help``, every command's ``--help`` and argparse's errors (exit status 0 or 2) leave torch
    and every heavy optional package unimported, in a fresh interpreter, one command after the other."""
    from meqmuon.cli import build_parser

    commands = [name for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
                for name in a.choices]  # argparse has no public accessor for the subcommands
    assert {"train", "compare", "sweep", "plot", "prepare", "memory", "diagnose", "ablation"} <= set(commands)
    argvs = [["--help"], *([c, "--help"] for c in commands), ["diagnose", "imbalance", "--help"], [],
             ["train", "--lr", "abc"], ["train", "--bogus"], ["compare", "--seeds", "0"], ["sweep", "--optimizers",
             "muon"], ["memory", "--state-dtype", "fp8"], ["diagnose", "selection"], ["prepare", "--out", "x"]]
    code = f"""
import contextlib, io, json, sys
from meqmuon.cli import main
loaded = {{}}
for argv in {argvs!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
            status = None
        except SystemExit as e:
            status = e.code
    loaded[" ".join(argv)] = [status, [m for m in {HEAVY!r} if m in sys.modules]]
print(json.dumps(loaded))
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert len(got) == len(argvs)
    for argv, (status, loaded) in got.items():
        assert status == (0 if argv.endswith("--help") else 2) and loaded == [], (argv, status, loaded)


def test_registry_names_read_without_torch_are_the_registry(tmp_path):
    """The help texts' optimizer lists come from :func:`meqmuon.registry_names.registry_names`, which reads the
    registry's source: equal to the imported registry's lists; a spec added to the source is read, by keyword
    or positionally; a table written in a form it cannot read is an error, not a wrong list."""
    from meqmuon.optim.registry import ABLATION_NAMES, DEMO_NAMES, MEMORY_NAMES, REGISTRY
    from meqmuon.registry_names import REGISTRY_SOURCE, registry_names

    assert registry_names() == (tuple(REGISTRY), DEMO_NAMES, MEMORY_NAMES, ABLATION_NAMES)
    source = REGISTRY_SOURCE.read_text()
    assert source.count("_SPECS = (\n") == 1
    changed = tmp_path / "registry.py"
    changed.write_text(source.replace("_SPECS = (\n", '_SPECS = (\n    OptimizerSpec("new-a", Muon, 1e-3, 1e-2, "A", '
                                      'True, 99),\n    OptimizerSpec(name="new-b", cls=Muon, default_lr=1e-3, '
                                      'demo_lr=1e-2, ablation_row=-1),\n'))
    names = registry_names(changed)
    assert names.names == ("new-a", "new-b", *REGISTRY) and names.demo == ("new-a", *DEMO_NAMES)
    assert names.memory == (*MEMORY_NAMES, "new-a") and names.ablation == ("new-b", *ABLATION_NAMES)
    for i, (table, needle) in enumerate((
        ("_SPECS = tuple(OptimizerSpec(n, None) for n in 'ab')", "no _SPECS = (OptimizerSpec"),
        ("_SPECS = (OptimizerSpec(NAME, None),)", "name or table rows are not literals"),
    )):
        unread = tmp_path / f"unread{i}.py"  # a new path each time: registry_names caches per path
        unread.write_text(f"class OptimizerSpec:\n    name: str\n    cls: type\n\n\n{table}\n")
        with pytest.raises(RuntimeError, match=re.escape(needle)):
            registry_names(unread)


def test_every_flag_of_every_command_has_help():
    import argparse

    from meqmuon.cli import build_parser

    def walk(parser: argparse.ArgumentParser, name: str):
        for action in parser._actions:  # argparse has no public accessor for these
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    yield from walk(p, f"{name} {sub}")
            elif action.option_strings and action.dest != "help":
                yield name, action

    missing = [f"{name} {a.option_strings[0]}" for name, a in walk(build_parser(), "meqmuon") if not a.help]
    assert missing == []


@pytest.fixture(scope="module")
def captured(cache, tmp_path_factory) -> Path:
    """A 2-update MeqMuon run with captures of layer 0 at update 1 (for the diagnose error paths)."""
    run = tmp_path_factory.mktemp("captured") / "run"
    assert main(small(cache, run, "--steps", "2", "--capture-steps", "1", "--capture-layers", "0")) == 0
    return run


# Every command's bad inputs: exit status 1 (or 2 for command-line syntax) and exactly one line on
# stderr, `meqmuon: error: ...`, naming the problem. {run}: a captured run, {adamw}: a run without
# selection counts, {tmp}: an empty directory, {data}: a one-document .jsonl file.
ERROR_PATHS = [
    (["train", "--lr", "-1e-3"], 1, "lr must be a positive number, got -0.001"),
    (["train", "--weight-decay", "-1e-1"], 1, "weight_decay must be >= 0, got -0.1"),
    (["train", "--lr", "abc"], 2, "argument --lr: invalid float value: 'abc' (see `meqmuon train --help`)"),
    (["train", "--lr"], 2, "argument --lr: expected one argument"),
    (["train", "--steps", "2", "--capture-steps", "5"], 1, "--capture-steps 5 beyond the run's 2 steps"),
    (["train", "--steps", "2", "--stop-at-step", "5"], 1, "--stop-at-step 5 is beyond the run's 2 steps"),
    (["train", "--tokens", "8192", "--stop-at-step", "5"], 1, "--stop-at-step 5 is beyond the run's 2 steps"),
    (["train", "--model", "llama-60m", "--seq-len", "4096"], 1,
     "--seq-len 4096 is beyond the 2,048 positions of llama-60m (max_position_embeddings); use --seq-len 2048"),
    (["train", "--lr", "inf"], 1, "lr must be a positive, finite number, got inf"),
    (["train", "--steps", "2", "--capture-steps", "1", "--capture-layers", "0,4,7"], 1,
     "--capture-layers 4,7 not in the model: llama-tiny has layers 0-3"),
    (["train", "--resume", "auto", "--steps", "2", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["train", "--device", "cuda:99"], 1, "--device cuda:99: "),  # CPU-only torch, or too few GPUs
    (["train", "--device", "cdua"], 1, "--device 'cdua' is not a device name"),
    (["compare", "--device", "cuda:99"], 1, "--device cuda:99: "),
    (["compare", "--optimizers", "lion"], 1, "unknown optimizer(s) ['lion']"),
    (["compare", "--steps", "0"], 1, "steps must be a positive number, got 0"),
    (["compare", "--lr", "adamw=inf"], 1, "--lr expects NAME=VALUE with a positive, finite VALUE, got 'adamw=inf'"),
    (["compare", "--seeds", "0"], 2, "argument --seeds: expected a number of seeds >= 1"),
    (["sweep", "--optimizers", "muon", "--lrs", "-1e-3"], 1, "lr must be a positive number, got -0.001"),
    (["sweep", "--optimizers", "muon", "--lrs", "inf"], 1, "lr must be a positive, finite number, got inf"),
    (["sweep", "--optimizers", "muon"], 2, "the following arguments are required: --lrs"),
    (["sweep", "--optimizers", "muon", "--lrs", "1e-3,abc"], 1,
     "--lrs: 'abc' is not a number (in '1e-3,abc'; comma-separated, e.g. 1e-3,2e-3)"),
    (["sweep", "--optimizers", "muon", "--lrs", "1e-3", "--seeds", "0,1.5"], 1, "--seeds: '1.5' is not a whole number"),
    (["prepare", "--data", "{data}", "--tokenizer", "builtin", "--out", "{tmp}/p", "--cache-dir", "{tmp}/cache",
      "--quiet"], 1,
     "no validation documents: every document went to the train split"),
    (["prepare", "--data", "{data}", "--out", "{tmp}/p"], 1,
     "prepare --data PATH... needs --tokenizer: a hub id, a save_pretrained directory, or builtin"),
    (["prepare", "--data", "{data}", "--tokenizer", "{tmp}/tok", "--out", "{tmp}/p"], 1,
     "tokenizer directory does not exist"),
    (["prepare", "--data", "{tmp}/none.jsonl", "--tokenizer", "gpt2", "--out", "{tmp}/p"], 1,
     "data path does not exist"),
    (["plot", "{tmp}/*/metrics.jsonl"], 1, "the pattern matched nothing"),
    (["plot", "{tmp}/nope.jsonl"], 1, "metrics file does not exist"),
    (["plot", "{run}", "--metric", "foo"], 1, "unknown metric 'foo'; valid: val_ppl"),
    (["diagnose", "imbalance", "--run", "/nonexistent"], 1, "run directory does not exist: /nonexistent"),
    (["diagnose", "imbalance", "--run", "{run}", "--layers", "3"], 1, "no captured matrix matches --layers 3"),
    (["diagnose", "imbalance", "--run", "{adamw}"], 1, "/adamw/captures: train with --capture-steps to record"),
    (["diagnose", "ns-trajectory", "--run", "{run}", "--layer", "9"], 1,
     "no hidden matrix of layer 9 captured at step 1"),
    (["diagnose", "selection", "--run", "{adamw}"], 1, "only MeqMuon-type runs"),
    (["diagnose", "selection", "--run", "/nonexistent"], 1, "run directory does not exist"),
    (["diagnose"], 2, "the following arguments are required"),
    (["memory", "--optimizers", "foo"], 1, "unknown optimizer 'foo'"),
    (["memory", "--models", "foo"], 1, "unknown model 'foo'"),
    (["memory", "--state-dtype", "fp8"], 2, "argument --state-dtype: invalid choice: 'fp8'"),
    (["ablation", "--optimizers", "foo", "--steps", "2"], 1, "unknown optimizer 'foo'"),
    (["ablation", "--set", "foo=1", "--steps", "2"], 1, "unknown TrainConfig field(s) ['foo']"),
    (["ablation", "--steps", "-1"], 1, "steps must be a positive number, got -1"),
]


@pytest.mark.parametrize(("argv", "status", "needle"), ERROR_PATHS, ids=[" ".join(a[:3]) for a, *_ in ERROR_PATHS])
def test_every_command_error_path_is_one_line(cache, captured, tmp_path, capsys, argv, status, needle):
    adamw = captured.parent / "adamw"
    if not adamw.exists():
        assert main(small(cache, adamw, "--optimizer", "adamw", "--steps", "1")) == 0
    capsys.readouterr()
    data = tmp_path / "data" / "a.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"text": "one document"}) + "\n")
    fill = {"{run}": str(captured), "{adamw}": str(adamw), "{tmp}": str(tmp_path), "{data}": str(data)}
    argv = [next((a.replace(k, v) for k, v in fill.items() if k in a), a) for a in argv]
    if argv[0] in ("train", "compare", "sweep"):
        argv += ["--cache-dir", cache, "--vocab-size", "512", "--out", str(tmp_path / "out")]
    before = snapshot(captured)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: command-line syntax
        code = e.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == status, (code, err)
    assert len(lines) == 1 and lines[0].startswith("meqmuon: error: "), err
    assert needle in lines[0], lines[0]
    assert out == "" and not (tmp_path / "out").exists() and snapshot(captured) == before


def test_cuda_on_a_cpu_only_torch_names_the_build(cache, tmp_path, capsys, monkeypatch):
    """``--device cuda`` where torch has no CUDA: one line saying so (not torch's 37-line assertion), no run
    directory. Here the CPU-only build is simulated on whatever machine runs the suite."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert main(small(cache, tmp_path / "run", "--device", "cuda")) == 1
    assert one_error_line(capsys) == (f"meqmuon: error: --device cuda: this torch ({torch.__version__}) is built "
                                      "without CUDA; use --device cpu (or auto, which picks the GPU when there is one)")
    assert not (tmp_path / "run").exists()


def test_tensorboard_missing_is_one_line_and_writes_nothing(cache, tmp_path, capsys, monkeypatch):
    """``--tensorboard`` without the package: one line, before anything is written (it used to leave a
    config.json behind a 25-line traceback). The package's absence is simulated where it is installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    for argv in (small(cache, tmp_path / "run", "--tensorboard"),
                 ["compare", "--steps", "2", "--tensorboard", "--out", str(tmp_path / "run")]):
        assert main(argv) == 1
        assert "--tensorboard needs the tensorboard package, which is not installed" in one_error_line(capsys)
        assert not (tmp_path / "run").exists()


def test_error_lines_under_torchrun_come_from_rank_0_alone():
    """Input errors are the same on every rank: rank 0 prints them. An error out of ``torch.distributed`` on
    another rank echoes a peer that stopped: silent. Anything else is printed with the rank that had it."""
    from torch.distributed.checkpoint import FileSystemReader

    from meqmuon.cli import _error_line

    assert _error_line(ValueError("bad lr"), 0) == "meqmuon: error: bad lr"
    assert _error_line(ValueError("bad lr"), 1) is None
    assert _error_line(OSError("disk full"), 1) == "meqmuon: error: rank 1: disk full"
    try:
        FileSystemReader("/nonexistent/ckpt").read_metadata()  # raised inside torch.distributed
    except OSError as e:
        assert _error_line(e, 1) is None and _error_line(e, 0).startswith("meqmuon: error: ")


@pytest.mark.parametrize(("extra", "needle"), [
    (["--global-batch", "7"], "global batch 7 is not divisible by the world size 2"),  # after the group forms
    (["--data", "/nonexistent/corpus.jsonl"], "data path does not exist"),  # before it: rank 0 builds the data
])
def test_bad_input_under_two_ranks_is_one_line_from_rank_0(cache, tmp_path, extra, needle):
    """Two processes with torchrun's environment (set by hand, as tests/test_preempt.py does, to see each
    rank's exit status and stderr): both exit 1 before training, rank 0 prints one line, rank 1 nothing."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port}
    procs = [subprocess.Popen([sys.executable, "-m", "meqmuon", *small(cache, tmp_path / "run", *extra)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], errs
    lines = errs[0].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meqmuon: error: ") and needle in lines[0], errs
    assert errs[1] == "" and not (tmp_path / "run").exists()


def test_model_built_with_the_data_vocabulary_says_so_and_records_it(cache, tmp_path, capsys):
    """``llama-micro`` (1,280 ids by default) on a prepared directory whose tokenizer has 512: one note line,
    config.json's ``vocab_size`` is the model's (512; the request kept as ``requested_vocab_size``), and a
    rerun of the same sweep reuses the finished run (the request is what it compares)."""
    from meqmuon.train.corpus import builtin_documents

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in builtin_documents()[:300]))
    data = tmp_path / "p512"
    assert main(["prepare", "--data", str(corpus), "--tokenizer", "builtin", "--vocab-size", "512", "--out", str(data),
                 "--cache-dir", cache, "--quiet"]) == 0
    out = tmp_path / "sweep"
    argv = ["sweep", "--optimizers", "adamw", "--lrs", "1e-3", "--model", "llama-micro", "--data", str(data),
            "--seq-len", "32", "--global-batch", "8", "--steps", "2", "--val-tokens", "256", "--out", str(out),
            "--quiet"]
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        "meqmuon: note: llama-micro is built with the data's vocabulary, 512 ids (builtin-bpe), not the 1,280 of "
        "its preset or --vocab-size; config.json records vocab_size 512"]
    config = json.loads((out / "adamw-lr0.001-s0" / "config.json").read_text())
    assert config["vocab_size"] == 512 and config["numerics"]["requested_vocab_size"] == 1280
    assert main(argv) == 0
    assert "meqmuon: reused 1 finished run(s)" in capsys.readouterr().err


def test_unreachable_hub_is_one_line_in_seconds_and_writes_nothing(cache, tmp_path, capsys, monkeypatch):
    """An offline machine: a hub tokenizer that is not cached, and ``--data c4`` (with a local tokenizer),
    fail with one line naming what to do instead, without the hub library's minute of retries and its
    22 warning lines (issue 46). HF_ENDPOINT points at a closed local port, so nothing leaves the machine."""
    import logging

    from meqmuon.train import hub
    from meqmuon.train.tokenizer import train_bpe

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in hub.RETRY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"text": "one document"}) + "\n")
    tok_dir = tmp_path / "tok"
    train_bpe(["some text to learn a few merges from"] * 4, vocab_size=300).save(tok_dir)
    cache_dir = tmp_path / "cache"
    try:
        for extra, needle in (
            (["--data", str(data), "--tokenizer", "meqmuon-tests/no-such-tokenizer"],
             "cannot load tokenizer 'meqmuon-tests/no-such-tokenizer': it is not in the Hugging Face cache and the "
             "Hugging Face hub cannot be reached (http://127.0.0.1:9 is unreachable: "),
            (["--data", "c4", "--tokenizer", str(tok_dir)],
             "--data c4 streams allenai/c4 from the hub, but the Hugging Face hub cannot be reached"),
        ):
            argv = small(str(cache_dir), tmp_path / "run", *extra)
            assert main(argv) == 1
            line = one_error_line(capsys)
            assert needle in line and "offline: use --data builtin or --data pysrc" in line, line
            assert not (tmp_path / "run").exists() and not cache_dir.exists()  # nothing was created
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert records == []  # no "'...' thrown while requesting" / "Retrying in 1s [Retry 1/5]." lines
    assert [lg.level for lg in loggers] == levels  # silenced only around the hub call, never globally


def test_quiet_retries_silences_the_hub_retry_loggers_only_inside():
    import logging

    from meqmuon.train import hub

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    lg = logging.getLogger(hub.RETRY_LOGGERS[0])
    lg.addHandler(handler)
    try:
        with hub.quiet_retries():
            lg.warning("Retrying in 1s [Retry 1/5].")
        assert records == []
        lg.warning("Retrying in 2s [Retry 2/5].")
        assert [r.getMessage() for r in records] == ["Retrying in 2s [Retry 2/5]."]
    finally:
        lg.removeHandler(handler)
