"""Suite-wide pytest hooks.

The header and the summary name the CPU kind the suite ran on (``meqmuon.precision.detect_cpu_capability()``) and
what ``ns_dtype=None`` / ``--precision auto`` mean there, because a result is only comparable with
another from the same kind of CPU: bf16 is native on ``AVX512_BF16``/AMX and emulated on ``AVX2``.
Exactness tests pin their precision (float32 or float64) and so mean the same on every kind; the bf16
paths have their own tests with bf16 tolerances (``tests/test_precision.py``).
"""

from __future__ import annotations

import os

import torch

from meqmuon import precision


def _cpu_line() -> str:
    cap = precision.detect_cpu_capability()
    native = precision.cpu_native_bf16(cap)
    forced = f" (from ${precision.CAPABILITY_ENV})" if os.environ.get(precision.CAPABILITY_ENV) else ""
    return (f"meqmuon: CPU capability {cap}{forced} ({'native' if native else 'emulated'} bf16; "
            f"ns_dtype=None -> {str(precision.resolve_ns_dtype(None, 'cpu')).removeprefix('torch.')}), "
            f"torch {torch.__version__}, {torch.get_num_threads()} thread{'' if torch.get_num_threads() == 1 else 's'}")


def pytest_report_header(config) -> str:
    return _cpu_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The same line at the end, where ``pytest -q`` (the README's command, which hides the header)
    shows it next to the counts."""
    terminalreporter.write_line(_cpu_line())
