"""The device of a run: ``--device`` checked before anything is written, and ``auto`` resolved per rank.

Both :mod:`meqmuon.train.config` (the check, part of :func:`~meqmuon.train.config.validate_config`) and
:mod:`meqmuon.train.run` (the device a rank builds its run on) read the device here, so that neither
imports the other for it.
"""

from __future__ import annotations

import torch

__all__ = ["check_device", "device_of"]


def device_of(spec: str, local_rank: int) -> torch.device:
    """``spec`` (a run's ``device``), or for ``"auto"`` ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if spec != "auto":
        return torch.device(spec)
    return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def check_device(spec: str) -> None:
    """``ValueError`` (one line) for a ``--device`` this process cannot use: a malformed name, CUDA on a
    torch build without it or a machine without a GPU, a CUDA index past the visible devices, MPS
    where it is absent. Checked before anything is written (torch's own error is an assertion deep
    in the first tensor moved there)."""
    if spec == "auto":
        return
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {spec!r} is not a device name (auto, cpu, cuda, cuda:0, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible to this process")
            raise ValueError(f"--device {spec}: {why}; use --device cpu (or auto, which picks the GPU when there "
                             "is one)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) are visible "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {spec}: MPS is not available here; use --device cpu or auto")
