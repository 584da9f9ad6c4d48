"""Reading the captures that :class:`meqmuon.train.capture.CaptureRecorder` writes during training.

The recorder, the file format and what each tensor is (paper section 3.1) are described in
:mod:`meqmuon.train.capture`; this module only finds and loads the files and names parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from meqmuon.train.capture import capture_path, layer_index

__all__ = ["layer_index", "module_type", "load_captures", "captured_steps", "capture_path"]


def module_type(name: str) -> str:
    """The module's own name: the last component before ``.weight``/``.bias`` (``q_proj``, ``lm_head``)."""
    parts = name.split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return parts[-1]


def captured_steps(run_dir: str | Path) -> list[int]:
    """Steps with a capture file in ``run_dir/captures``, ascending."""
    folder = Path(run_dir) / "captures"
    steps = []
    for p in folder.glob("step_*.pt"):
        try:
            steps.append(int(p.stem.split("_", 1)[1]))
        except ValueError:
            continue
    return sorted(steps)


def load_captures(run_dir: str | Path, steps: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
    """Load capture files (``weights_only=True``); ``steps=None`` loads every captured step.

    Raises:
        FileNotFoundError: a requested step has no file (the message lists the captured steps).
    """
    available = captured_steps(run_dir)
    wanted = available if steps is None else [int(s) for s in steps]
    missing = [s for s in wanted if s not in available]
    folder = Path(run_dir) / "captures"
    if not available:
        raise FileNotFoundError(f"no captures in {folder}: train with --capture-steps to record them")
    if missing or not wanted:
        raise FileNotFoundError(
            f"no capture for step{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} in {folder}; "
            f"captured steps: {', '.join(map(str, available))} (train with --capture-steps to record others)"
        )
    return {s: torch.load(capture_path(run_dir, s), weights_only=True) for s in wanted}
