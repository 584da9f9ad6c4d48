"""``meqmuon train --fsdp --tp N`` under torchrun (gloo, CPU), and checkpoints that resume on another layout.

One uninterrupted run of 4 updates per layout, checkpoints after update 2 and 4 (``--save-every 2``);
the update-2 checkpoint, alone in a copy of the run directory, is then resumed:

- 4 processes, FSDP2 over TP (2 x 2): the validation loss of one process to 1e-4 (the issue's target;
  observed ~1e-7: only reduction orders differ);
- its sharded checkpoint resumed on 4 processes in the same layout ends bit for bit where the
  uninterrupted run ended, and on 2 processes (FSDP2) and on 1 (no sharding) within 1e-5 relative;
- the other way: one process's single-file checkpoint resumed on 4 processes, FSDP2 over TP.

Every resumed run ends at update 4 with the tokens of 4 updates: each update applied exactly once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from meqmuon.train.checkpoint import list_checkpoints, load_checkpoint

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--model", "llama-tiny", "--optimizer", "meqmuon", "--lr", "1e-2", "--vocab-size", "512", "--seq-len", "32",
          "--global-batch", "8", "--micro-batch", "2", "--steps", "4", "--eval-every", "4", "--save-every", "2",
          "--val-tokens", "256", "--precision", "fp32", "--optimizer-arg", "ns_dtype=float32", "--quiet"]


def _train(tmp: Path, out: str, ranks: int, *flags: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]
    cmd = [*launch, "-m", "meqmuon", "train", *COMMON, "--cache-dir", str(tmp / "cache"), "--out", str(tmp / out),
           *flags]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _from_update_2(tmp: Path, run: str, copy: str) -> None:
    """A copy of ``run`` that holds only its update-2 checkpoint (as if it had stopped there)."""
    shutil.copytree(tmp / run, tmp / copy)
    for step, path in list_checkpoints(tmp / copy):
        if step != 2:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    (tmp / copy / "summary.json").unlink()


def _ended_at_update_4(tmp: Path, run: str) -> None:
    (step, path), *_ = reversed(list_checkpoints(tmp / run))
    meta = load_checkpoint(path)
    assert step == meta["step"] == 4 and meta["tokens"] == 4 * 8 * 32


def test_fsdp_over_tp_trains_like_one_process_and_resumes_on_any_layout(tmp_path):
    one = _train(tmp_path, "one", 1)
    grid = _train(tmp_path, "grid", 4, "--fsdp", "--tp", "2")
    assert list_checkpoints(tmp_path / "grid")[-1][1].is_dir()  # a DCP directory
    assert abs(grid["val_loss"] - one["val_loss"]) <= 1e-4 * one["val_loss"]
    resumed = {}
    for name, ranks, flags in (("same", 4, ("--fsdp", "--tp", "2")), ("fsdp2", 2, ("--fsdp",)), ("one", 1, ())):
        _from_update_2(tmp_path, "grid", f"grid_{name}")
        resumed[name] = _train(tmp_path, f"grid_{name}", ranks, *flags, "--resume", "auto")
        _ended_at_update_4(tmp_path, f"grid_{name}")
    assert resumed["same"]["val_loss"] == grid["val_loss"]  # the same layout: bit for bit
    for name in ("fsdp2", "one"):
        assert abs(resumed[name]["val_loss"] - grid["val_loss"]) <= 1e-5 * grid["val_loss"], (name, resumed[name])
    _from_update_2(tmp_path, "one", "one_grid")
    back = _train(tmp_path, "one_grid", 4, "--fsdp", "--tp", "2", "--resume", "auto")
    _ended_at_update_4(tmp_path, "one_grid")
    assert abs(back["val_loss"] - one["val_loss"]) <= 1e-5 * one["val_loss"]


def test_bad_layouts_are_one_clear_line(tmp_path):
    from meqmuon.train.parallel import check_layout

    with pytest.raises(ValueError, match="does not divide the 4 ranks"):
        check_layout(4, 3, True)
    with pytest.raises(ValueError, match="add --fsdp"):
        check_layout(4, 2, False)
    with pytest.raises(ValueError, match="torchrun"):
        check_layout(1, 1, True)

    class Config:
        num_attention_heads, num_key_value_heads, intermediate_size = 4, 2, 344

    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_layout(4, 4, False, Config())
