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
"""

from meqmuon.train.capture import CaptureRecorder

from .capture import captured_steps, layer_index, load_captures, module_type
from .imbalance import hidden_cv_table, imbalance_records, matrix_stats, momentum_cv_table, normalization_table
from .memory import memory_mib, memory_table, predicted_state_bytes
from .selection import read_selection_counts, selection_shares, selection_table
from .trajectory import exact_orthogonalize, ns_trajectory, plot_trajectories, trajectory_table

__all__ = [
    "CaptureRecorder",
    "captured_steps",
    "exact_orthogonalize",
    "hidden_cv_table",
    "imbalance_records",
    "layer_index",
    "load_captures",
    "matrix_stats",
    "memory_mib",
    "memory_table",
    "module_type",
    "momentum_cv_table",
    "normalization_table",
    "ns_trajectory",
    "plot_trajectories",
    "predicted_state_bytes",
    "read_selection_counts",
    "selection_shares",
    "selection_table",
    "trajectory_table",
]
