"""The paper's analysis (section 3.1 and section 4) as functions and commands.

- :mod:`.capture`    loading the captures (pre-NS matrices, embedding/head momentum) that
  :class:`meqmuon.train.capture.CaptureRecorder` writes (re-exported here as ``CaptureRecorder``).
- :mod:`.imbalance`  row/column CVs of Muon's updates and of momentum, before/after MeqMuon (Tables 1, 3, 4, 8-10).
- :mod:`.trajectory` CVs along the Newton-Schulz iteration vs exact orthogonalisation (Figure 1).
- :mod:`.selection`  share of row vs column normalisation per module type (Table 6).
- :mod:`.memory`     optimizer-state memory, predicted and measured (Table 5, Table 7's memory).
- :mod:`.ablation`   the component ablation run (Table 7); the only module importing ``meqmuon.train``.
- :mod:`.cli`        ``meqmuon memory | diagnose {imbalance,ns-trajectory,selection} | ablation``.

The analysis modules depend on torch (and lazily matplotlib for figures) only.

The names below are loaded on first use (PEP 562), as ``meqmuon``'s are: the ``meqmuon`` command
registers ``diagnose``, ``memory`` and ``ablation`` from :mod:`.cli` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that defines it.
_HOME = {
    "CaptureRecorder": "meqmuon.train.capture",
    **dict.fromkeys(("captured_steps", "layer_index", "load_captures", "module_type"), ".capture"),
    **dict.fromkeys(("hidden_cv_table", "imbalance_records", "matrix_stats", "momentum_cv_table",
                     "normalization_table"), ".imbalance"),
    **dict.fromkeys(("memory_mib", "memory_table", "predicted_state_bytes"), ".memory"),
    **dict.fromkeys(("read_selection_counts", "selection_shares", "selection_table"), ".selection"),
    **dict.fromkeys(("exact_orthogonalize", "ns_trajectory", "plot_trajectories", "trajectory_table"), ".trajectory"),
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
