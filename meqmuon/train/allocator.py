"""Keep freed host memory in the process during a CPU run (glibc's ``malloc``), instead of unmapping it.

PyTorch's CPU tensors come from ``malloc``. glibc serves a request above its mmap threshold (at most
32 MiB on 64-bit Linux) with a fresh ``mmap`` and unmaps it again on ``free``, so every large
activation of every update (a ``llama-tiny`` batch's fp32 logits are 32 x 128 x 4096 x 4 B = 64 MiB)
is a new mapping whose pages the kernel faults in and zeroes one by one. A 20-update ``llama-tiny``
run made ~2.2 million page faults that way, 3.3 s of its 16.4 s of CPU time in the kernel
(docs/benchmarks.md, "Wall time of a 20-update `llama-tiny` run"). With ``M_MMAP_MAX = 0`` (no
mmap'd chunks) and a trim threshold the heap never reaches, freed blocks stay in the heap and the
next update reuses them: ~0.25 million faults, 0.6 s in the kernel. The cost is resident memory:
the heap keeps its peak (+13 % RSS for that run, 0.87 -> 0.99 GB) until the run ends.

:func:`keep_freed_memory` applies this for the duration of :func:`meqmuon.train.loop.train` on a CPU
device and restores glibc's defaults afterwards. It does nothing where the choice is the user's or
not glibc's: a ``MALLOC_*`` variable or ``GLIBC_TUNABLES`` set in the environment, an ``LD_PRELOAD``
(another allocator, e.g. jemalloc or tcmalloc), a C library other than glibc, or
``MEQMUON_KEEP_FREED_MEMORY=0``. What a run computes does not depend on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from collections.abc import Iterator

__all__ = ["keep_freed_memory", "applies"]

# mallopt parameters (malloc.h) and glibc's defaults, restored afterwards
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def _user_choice() -> str | None:
    """Why the environment leaves malloc alone, or None."""
    if os.environ.get("MEQMUON_KEEP_FREED_MEMORY", "1") == "0":
        return "MEQMUON_KEEP_FREED_MEMORY=0"
    for name in os.environ:
        if name.startswith("MALLOC_") or name == "GLIBC_TUNABLES":
            return name
    if os.environ.get("LD_PRELOAD"):
        return "LD_PRELOAD"
    return None


def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL("libc.so.6").mallopt  # glibc's soname (x86-64, aarch64, ...); elsewhere OSError
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def applies() -> bool:
    """Whether :func:`keep_freed_memory` changes anything in this process."""
    return _user_choice() is None and _mallopt() is not None


@contextlib.contextmanager
def keep_freed_memory(enabled: bool = True) -> Iterator[bool]:
    """Within the block, large freed blocks stay in glibc's heap (see the module docstring); yields
    whether that applied. ``enabled=False`` (e.g. a CUDA run, whose tensors use CUDA's own allocator)
    does nothing."""
    mallopt = _mallopt() if enabled and _user_choice() is None else None
    if mallopt is None:
        yield False
        return
    ok = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
    try:
        yield ok
    finally:
        mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
