"""Complete, atomic, ``weights_only``-loadable checkpoints (design notes, convention 8).

A checkpoint holds everything the next update depends on: model weights, optimizer state,
LR-scheduler state, the train stream's position, the RNG states of torch (CPU and CUDA), Python and
NumPy, the step/token counters and the resolved config. It is written to a temporary file and
renamed with ``os.replace`` (atomic on POSIX), so a crash while saving never leaves a half-written
``step_*.pt``; older checkpoints are pruned only after the new one is in place.

It is loaded with ``torch.load(weights_only=True)``, which only unpickles tensors, primitives,
dicts/lists/tuples and a few torch types; therefore the RNG states are stored as tensors and
primitives (Python's ``random`` state is a tuple of ints; NumPy's a uint32 array). ``torch.dtype``
values in optimizer param groups (``ns_dtype``) are on the ``weights_only`` allow-list
(``tests/test_train.py`` checks the round trip).

Layout: ``<run>/checkpoints/step_0000123.pt``. A sharded run (``--fsdp`` / ``--tp``) writes a directory
``<run>/checkpoints/step_0000123/`` instead: model and optimizer through ``torch.distributed.checkpoint``
(every rank writes its shards; DCP reshards on load, so the run resumes on any layout or number of
ranks, one process included) and ``meta.pt`` with the rest, written by rank 0. It is written as
``.step_0000123.tmp`` and renamed when complete, so it is atomic like the single file.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "FORMAT",
    "checkpoint_dir",
    "checkpoint_path",
    "list_checkpoints",
    "latest_checkpoint",
    "find_checkpoint",
    "load_latest_readable",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]

FORMAT = "meqmuon-checkpoint-v1"
_NAME = re.compile(r"^step_(\d+)(\.pt)?$")
#: The non-DCP part of a sharded checkpoint directory.
META = "meta.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not belong to this run."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int, sharded: bool = False) -> Path:
    return checkpoint_dir(run_dir) / (f"step_{step:07d}" if sharded else f"step_{step:07d}.pt")


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint of a run, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir()
             if (m := _NAME.match(p.name)) and (p.is_file() or (p / META).is_file())]
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def find_checkpoint(resume: str, run_dir: str | Path) -> Path | None:
    """The checkpoint ``--resume`` names: ``auto`` -> latest in ``run_dir`` (None if there is none),
    a run directory -> its latest (an error if it has none), a file -> that file."""
    if resume == "auto":
        return latest_checkpoint(run_dir)
    p = Path(resume)
    if p.is_dir() and (p / META).is_file():  # a sharded checkpoint itself
        return p
    if p.is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise CheckpointError(f"no checkpoints in run directory {p}")
        return latest
    if not p.is_file():
        raise CheckpointError(f"checkpoint does not exist: {p}")
    return p


def rng_state() -> dict[str, Any]:
    """RNG states of torch (CPU, every CUDA device), Python and NumPy, as tensors and primitives."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, payload: dict[str, Any], keep: int = 2) -> Path:
    """Write ``payload`` (plus the format tag and step) atomically; keep the newest ``keep`` files."""
    path = checkpoint_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save({"format": FORMAT, "step": step, **payload}, tmp)
    os.replace(tmp, path)
    # a sharded checkpoint of the same step (a resume on one process from before it) is replaced too
    shutil.rmtree(checkpoint_path(run_dir, step, sharded=True), ignore_errors=True)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True) if old.is_file() else shutil.rmtree(old, ignore_errors=True)
    return path


def save_sharded_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], payload: dict[str, Any],
                            is_main: bool, barrier: Any, keep: int = 2) -> Path:
    """A sharded checkpoint directory (see the module docstring), written by every rank: ``state`` (the
    model's and optimizer's ``get_state_dict``) through ``dcp.save``, ``payload`` to ``meta.pt`` by rank 0;
    ``barrier()`` separates the writes from the rename and the pruning of older checkpoints."""
    import torch.distributed.checkpoint as dcp

    path = checkpoint_path(run_dir, step, sharded=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if is_main:
        torch.save({"format": FORMAT, "step": step, **payload}, tmp / META)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        checkpoint_path(run_dir, step).unlink(missing_ok=True)  # a single file of the same step is replaced too
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    barrier()
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (of a sharded one: its ``meta.pt``; the model and
    optimizer load through DCP); unreadable or foreign files raise ``CheckpointError``."""
    p = Path(path)
    if p.is_dir():
        _check_shards(p)
        p = p / META
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, not a torch file: all mean "corrupt"
        raise CheckpointError(f"cannot read checkpoint {p}: {_reason(e)}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{p} is not a {FORMAT} checkpoint")
    return ckpt


def _check_shards(path: Path) -> None:
    """A sharded checkpoint's DCP files: its ``.metadata`` readable and every shard file it names present
    and long enough. Checked when the checkpoint is chosen (``--resume auto`` then falls back to an older
    one, as for a damaged single file) rather than deep inside ``dcp.load`` on every rank."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # missing or damaged .metadata
        raise CheckpointError(f"cannot read checkpoint {path}: its DCP .metadata is unreadable "
                              f"({_reason(e)})") from None
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in need if not (path / name).is_file())
    if missing:
        raise CheckpointError(f"cannot read checkpoint {path}: shard file(s) {', '.join(missing)} missing "
                              f"({len(missing)} of {len(need)})")
    short = sorted(name for name, end in need.items() if (path / name).stat().st_size < end)
    if short:
        raise CheckpointError(f"cannot read checkpoint {path}: shard file(s) {', '.join(short)} truncated")


def _reason(e: Exception) -> str:
    """A few words for why ``torch.load`` failed. torch's own messages run to ~400 characters (the zip
    reader's advice, the ``weights_only`` history), which buried the file name in one line of text."""
    text = str(e)
    if "zip archive" in text or "central directory" in text or isinstance(e, EOFError):
        return "truncated or damaged (not a complete torch zip file)"
    if "Weights only load failed" in text:
        return "not a weights-only torch file (not a meqmuon checkpoint)"
    first = " ".join(text.split()) or type(e).__name__
    return first if len(first) <= 100 else first[:97] + "..."


def load_latest_readable(run_dir: str | Path) -> tuple[Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
    """``--resume auto``: the newest checkpoint of ``run_dir`` that loads, newest first.

    Returns ``(path, checkpoint, skipped)``: ``skipped`` lists ``(path, error)`` of the newer
    checkpoints that could not be read (the caller warns about them); ``(None, None, [])`` when the
    run has no checkpoint. Why fall back: a crash or a full disk can leave the newest file damaged
    (``save_checkpoint`` renames atomically, but a disk or a copy can still truncate it), and the
    older kept checkpoint continues the run bit for bit from its own step. When none is readable the
    newest one's error is raised.
    """
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path), skipped
        except CheckpointError as e:
            skipped.append((path, str(e)))
    if skipped:
        raise CheckpointError(skipped[0][1] + (f" (and the {len(skipped) - 1} older checkpoint(s) of the run)"
                                               if len(skipped) > 1 else ""))
    return None, None, []
