"""The optimizer library: routing, rules, the engine and the named optimizers (torch only)."""

from .driver import HiddenRule
from .engine import RoleOptimizer
from .factory import OPTIMIZERS, build_optimizer, rules_of, valid_hyperparameters
from .groups import KINDS, describe_groups, param_groups
from .memory import optimizer_state_bytes, predicted_state_elements
from .presets import MeqMuon, Muon, MuonEq, MuonOnlyEmbedding, MuonOnlyHidden, MuonOnlyVector, NorMuon, Scale

__all__ = [
    "KINDS",
    "OPTIMIZERS",
    "HiddenRule",
    "MeqMuon",
    "Muon",
    "MuonOnlyEmbedding",
    "MuonOnlyHidden",
    "MuonOnlyVector",
    "MuonEq",
    "NorMuon",
    "RoleOptimizer",
    "Scale",
    "build_optimizer",
    "describe_groups",
    "optimizer_state_bytes",
    "param_groups",
    "predicted_state_elements",
    "rules_of",
    "valid_hyperparameters",
]
