"""``build_optimizer(name, model_or_groups, **hparams)``: every optimizer of the comparison by name."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .groups import param_groups
from .presets import (
    ADAMW_BETAS,
    WEIGHT_DECAY,
    MeqMuon,
    Muon,
    MuonEqC,
    MuonEqR,
    MuonEqRC,
    MuonOnlyEmbedding,
    MuonOnlyHidden,
    MuonOnlyVector,
    NorMuon,
    Scale,
)

#: name -> optimizer class. ``adamw`` is ``torch.optim.AdamW`` with betas (0.9, 0.95) and weight decay
#: 0.1 (the paper's setting, section 4) over the same role groups.
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "muon": Muon,
    "normuon": NorMuon,
    "scale": Scale,
    "meqmuon": MeqMuon,
    "meqmuon-only-hidden": MuonOnlyHidden,
    "meqmuon-only-embedding": MuonOnlyEmbedding,
    "meqmuon-only-vector": MuonOnlyVector,
    "muoneq-r": MuonEqR,
    "muoneq-c": MuonEqC,
    "muoneq-rc": MuonEqRC,
}

# Rule tables for memory prediction; AdamW keeps two moments for every tensor.
ADAMW_RULES = {"hidden": "adamw", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


def rules_of(name: str) -> dict[str, str]:
    """The kind -> rule table of optimizer ``name`` (for memory accounting)."""
    cls = _lookup(name)
    return ADAMW_RULES if cls is torch.optim.AdamW else dict(cls.RULES)  # type: ignore[attr-defined]


def _lookup(name: str) -> type[torch.optim.Optimizer]:
    key = name.lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid names: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[key]


def valid_hyperparameters(name: str) -> list[str]:
    """Keyword arguments accepted by optimizer ``name`` (besides the parameters)."""
    names: list[str] = []
    for klass in _lookup(name).__mro__:  # a subclass that forwards **kwargs takes its parent's too
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                  and p.name not in ("self", "params") and p.name not in names]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def build_optimizer(name: str, model_or_groups: nn.Module | Iterable[Any], **hparams: Any) -> torch.optim.Optimizer:
    """Build optimizer ``name`` over a model (routed with :func:`param_groups`) or given groups.

    Args:
        name: one of ``adamw, muon, normuon, scale, meqmuon, meqmuon-only-hidden,
            meqmuon-only-embedding, meqmuon-only-vector, muoneq-r, muoneq-c, muoneq-rc``.
        model_or_groups: an ``nn.Module`` or param groups.
        **hparams: keyword arguments of the optimizer class; unknown ones are an error.
    """
    cls = _lookup(name)
    valid = valid_hyperparameters(name)
    unknown = sorted(set(hparams) - set(valid))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {unknown} for optimizer {name!r}; valid: {', '.join(valid)}")
    groups = param_groups(model_or_groups) if isinstance(model_or_groups, nn.Module) else list(model_or_groups)
    if cls is torch.optim.AdamW:
        hparams.setdefault("betas", ADAMW_BETAS)
        hparams.setdefault("weight_decay", WEIGHT_DECAY)
    return cls(groups, **hparams)
