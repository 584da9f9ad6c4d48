"""``metrics.jsonl``: the run log that plots and tables are derived from (design notes, convention 7).

One JSON object per line. Train records carry ``{"kind": "train", "step", "tokens", "loss", "lr",
"grad_norm", "tokens_per_s", "time_s"}``; evaluation records ``{"kind": "eval", "step", "tokens",
"val_loss", "val_ppl", "val_bpb"}``. ``step`` counts completed optimizer updates.

On resume the log is truncated to the records with ``step <= `` the checkpoint's step before new
ones are appended, so a run that was interrupted after its last checkpoint never holds a step twice.
TensorBoard is optional (``--tensorboard``) and mirrors the same scalars.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "read_metrics", "truncate_metrics", "write_json"]


def _clean(value: Any) -> Any:
    # JSON has no NaN/Inf; write them as strings so the file stays standard JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (a torn last line, from a killed process, is skipped)."""
    out = []
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"metrics file does not exist: {p}")
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def truncate_metrics(path: str | Path, step: int) -> None:
    """Keep only the records with ``step <= step`` (atomically rewritten)."""
    p = Path(path)
    if not p.exists():
        return
    kept = [r for r in read_metrics(p) if int(r.get("step", 0)) <= step]
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, p)


class MetricsLogger:
    """Appends records to ``<run>/metrics.jsonl`` (rank 0 only; other ranks get ``enabled=False``)."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        if self._tb is not None:
            prefix = record.get("kind", "train")
            for k, v in record.items():
                if k not in ("kind", "step") and isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(f"{prefix}/{k}", v, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
