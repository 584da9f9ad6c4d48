"""Preemption: a real SIGTERM to a real ``meqmuon train`` process, then ``--resume auto``.

The signal arrives at a random update of a 40-update ``llama-tiny`` run (the update is drawn afresh
each time and named in every assertion message). The stopped process must finish that update, save
a checkpoint at it and exit with status 143 and one line saying how to resume; the resumed run must
end with the same final validation loss as an uninterrupted run *bit for bit* (both run the same
deterministic CPU kernels on the same inputs, so any difference means lost state) and
``metrics.jsonl`` must hold every update once, the resume starting exactly where the stop was
(no update redone). Single process, and two gloo ranks launched by hand so that the signal can be
sent to rank 1 alone: rank 0, which writes the files, learns of it through the all-reduce.

The signalled run is always a launched process; on one process the uninterrupted run and the resume run
``meqmuon.cli.main`` in the test process (a launch costs ~5 CPU seconds of imports).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meqmuon.cli import main
from meqmuon.train.checkpoint import list_checkpoints
from meqmuon.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
STEPS = 40
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def args(cache: str, out: Path) -> list[str]:
    return ["train", "--model", "llama-tiny", "--optimizer", "meqmuon", "--lr", "1e-2", "--vocab-size", "512",
            "--seq-len", "32", "--global-batch", "8", "--steps", str(STEPS), "--eval-every", "10", "--val-tokens",
            "256", "--precision", "fp32", "--optimizer-arg", "ns_dtype=float32", "--threads", "1",
            "--cache-dir", cache, "--out", str(out), "--quiet"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], world: int) -> list[subprocess.Popen]:
    """``python -m meqmuon CMD`` as ``world`` processes (torchrun's environment, set by hand)."""
    if world == 1:
        return [subprocess.Popen([sys.executable, "-m", "meqmuon", *cmd], env=ENV, stderr=subprocess.PIPE, text=True)]
    port = str(_free_port())
    return [subprocess.Popen([sys.executable, "-m", "meqmuon", *cmd], stderr=subprocess.PIPE, text=True,
                             env={**ENV, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                  "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            for r in range(world)]


def finish(procs: list[subprocess.Popen]) -> tuple[list[int], list[str]]:
    errs = [p.communicate(timeout=300)[1] for p in procs]
    return [p.returncode for p in procs], errs


def run_to_end(cmd: list[str], world: int) -> tuple[list[int], list[str]]:
    """``meqmuon CMD`` to its end: launched on ``world`` > 1 processes, here (``main``) on one."""
    if world > 1:
        return finish(launch(cmd, world))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(cmd)
    return [code], [err.getvalue()]


def train_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]


def final_val_loss(run: Path) -> float:
    return json.loads((run / "summary.json").read_text())["val_loss"]


def stop_at_random_update(cache: str, run: Path, world: int, target_rank: int) -> tuple[int, int, str]:
    """Start the run, SIGTERM rank ``target_rank`` once update ``k`` (random) is logged; ``(k, stop step, stderr)``."""
    k = random.randint(2, STEPS - 20)  # leaves >= 20 updates for the signal to land before the end
    procs = launch(args(cache, run), world)
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").exists() or k not in train_steps(run):
        assert all(p.poll() is None for p in procs), f"k={k}: the run ended before the signal"
        assert time.monotonic() < deadline, f"k={k}: update {k} was never logged"
        time.sleep(0.02)
    procs[target_rank].send_signal(signal.SIGTERM)
    codes, errs = finish(procs)
    assert codes == [128 + signal.SIGTERM] * world, (k, codes, errs)
    stops = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "stop"]
    assert len(stops) == 1 and stops[0]["signal"] == "SIGTERM", (k, stops)
    return k, stops[0]["step"], errs[0]


@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_at_a_random_update_then_resume_auto_is_bit_exact(cache, tmp_path, world):
    codes, errs = run_to_end(args(cache, tmp_path / "straight"), world)
    assert codes == [0] * world, errs

    run = tmp_path / "stopped"
    k, stopped, err = stop_at_random_update(cache, run, world, target_rank=world - 1)
    assert k <= stopped < STEPS, (k, stopped)
    assert list_checkpoints(run)[-1][0] == stopped, (k, stopped)  # saved at the update it stopped after
    assert train_steps(run) == list(range(1, stopped + 1)), k
    lines = err.strip().splitlines()
    assert lines == [f"meqmuon: stopped by SIGTERM after step {stopped} of {STEPS} (checkpoint "
                     f"{run / 'checkpoints' / f'step_{stopped:07d}.pt'}); resume with: "
                     + ("meqmuon" if world == 1 else "torchrun ... -m meqmuon")
                     + f" train --out {run} --resume auto --threads 1"], (k, err)
    assert not (run / "summary.json").exists()

    codes, errs = run_to_end(["train", "--out", str(run), "--resume", "auto", "--quiet"], world)
    assert codes == [0] * world, (k, errs)
    starts = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "run"]
    assert starts == [0, stopped], (k, starts)  # the resume began at the stop: no update redone
    assert train_steps(run) == list(range(1, STEPS + 1)), k  # every update once
    assert final_val_loss(run) == final_val_loss(tmp_path / "straight"), (k, stopped)


def test_a_second_signal_exits_at_once():
    script = ("import os, signal, time\nfrom meqmuon.train.preempt import StopSignals\n"
              "with StopSignals() as s:\n    os.kill(os.getpid(), signal.SIGINT)\n"
              "    assert s.signum == signal.SIGINT\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n"
              "print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stdout == "" and done.stderr == "meqmuon: second SIGTERM: exiting at once without saving\n"


def test_sigterm_stops_compare_and_the_same_command_resumes_it(cache, tmp_path):
    out = tmp_path / "cmp"
    cmd = ["compare", "--optimizers", "adamw,meqmuon", "--vocab-size", "512", "--seq-len", "32", "--global-batch",
           "8", "--steps", "40", "--eval-every", "10", "--val-tokens", "256", "--cache-dir", cache, "--out", str(out),
           "--quiet"]
    k = random.randint(2, 20)
    (proc,) = launch(cmd, 1)
    while not (out / "adamw" / "metrics.jsonl").exists() or k not in train_steps(out / "adamw"):
        assert proc.poll() is None, f"k={k}: compare ended before the signal"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    codes, (err,) = finish([proc])
    assert codes == [128 + signal.SIGTERM], (k, err)
    (line,) = err.strip().splitlines()
    assert line.startswith("meqmuon: stopped by SIGTERM after step ") and line.endswith(
        "resume with: meqmuon " + " ".join(cmd)), (k, line)
    assert not (out / "meqmuon").exists() and not (out / "table.md").exists(), k  # compare stopped too
    codes, errs = run_to_end(cmd, 1)  # the same command again
    assert codes == [0], errs
    for name in ("adamw", "meqmuon"):
        assert train_steps(out / name) == list(range(1, 41)), (k, name)
    assert "| adamw |" in (out / "table.md").read_text() and "| meqmuon |" in (out / "table.md").read_text()
