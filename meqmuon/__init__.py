"""meqmuon: MeqMuon (Matrix-Equilibrating Muon) and faithful Muon-family baselines for LLM pretraining.

Quick start::

    import meqmuon
    groups = meqmuon.param_groups(model)      # hidden / embedding / head / vector, by role
    opt = meqmuon.MeqMuon(groups, lr=2e-3)    # or Muon / NorMuon / Scale on the same groups
    # or: opt = meqmuon.build_optimizer("meqmuon", model, lr=2e-3)

The core (this package minus ``meqmuon.train``) depends on torch alone.
"""

from . import functional
from .optim import (
    KINDS,
    OPTIMIZERS,
    HiddenRule,
    MeqMuon,
    Muon,
    MuonEq,
    MuonOnlyEmbedding,
    MuonOnlyHidden,
    MuonOnlyVector,
    NorMuon,
    RoleOptimizer,
    Scale,
    build_optimizer,
    describe_groups,
    optimizer_state_bytes,
    param_groups,
    predicted_state_elements,
    rules_of,
    valid_hyperparameters,
)

__version__ = "0.1.0"

__all__ = [
    "KINDS",
    "OPTIMIZERS",
    "HiddenRule",
    "MeqMuon",
    "Muon",
    "MuonOnlyEmbedding",
    "MuonOnlyHidden",
    "MuonEq",
    "MuonOnlyVector",
    "NorMuon",
    "RoleOptimizer",
    "Scale",
    "build_optimizer",
    "describe_groups",
    "functional",
    "optimizer_state_bytes",
    "param_groups",
    "predicted_state_elements",
    "rules_of",
    "valid_hyperparameters",
]
