"""``build_optimizer(name, model_or_groups, **hparams)``: every optimizer of the comparison by name."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .engine import RoleOptimizer
from .groups import param_groups
from .inputs import check_unique_params, listed_params, wrong_params
from .registry import REGISTRY, spec
from .rule import Rule
from .rules import RULES

#: name -> optimizer class, read from :data:`meqmuon.optim.registry.REGISTRY` (where the facts are written).
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {name: s.cls for name, s in REGISTRY.items()}

# Rule tables for memory prediction; AdamW keeps two moments for every tensor.
ADAMW_RULES = {"hidden": "adamw", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


def rules_of(name: str) -> dict[str, str]:
    """The kind -> rule table of optimizer ``name`` (for memory accounting)."""
    cls = spec(name).cls
    return ADAMW_RULES if cls is torch.optim.AdamW else dict(cls.RULES)  # type: ignore[attr-defined]


def valid_hyperparameters(name: str, rules: Mapping[str, Rule] | None = None) -> list[str]:
    """Keyword arguments accepted by optimizer ``name`` (besides the parameters): its constructor's, then its
    rules' own hyperparameters (:attr:`Rule.defaults`), with ``rules`` (kind -> instance) replacing its own."""
    names: list[str] = []
    for klass in spec(name).cls.__mro__:  # a subclass that forwards **kwargs takes its parent's too
        if klass is RoleOptimizer:  # the engine's own keywords (cuda_graph), then its **kwargs: the rules', below
            names += [p.name for p in inspect.signature(klass.__init__).parameters.values()
                      if p.kind == p.POSITIONAL_OR_KEYWORD and p.name not in ("self", "params", "defaults", *names)]
            break
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                  and p.name not in ("self", "params") and p.name not in names]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    cls = spec(name).cls
    if issubclass(cls, RoleOptimizer):
        table = {kind: RULES[rule] for kind, rule in cls.RULES.items()} | dict(rules or {})
        names += [k for rule in table.values() for k in rule.defaults if k not in names]
    return list(dict.fromkeys(names))


def build_optimizer(name: str, model_or_groups: nn.Module | Iterable[Any], **hparams: Any) -> torch.optim.Optimizer:
    """Build optimizer ``name`` over a model (routed with :func:`param_groups`) or given groups.

    Args:
        name: a name of :data:`meqmuon.optim.registry.REGISTRY` (case-insensitive).
        model_or_groups: an ``nn.Module``, parameters or param groups.
        **hparams: keyword arguments of the optimizer class; unknown ones are an error.

    Raises:
        TypeError: ``model_or_groups`` is none of those (one line saying what to pass).
        ValueError: an unknown name or hyperparameter, a tensor given twice (``torch.optim.AdamW`` included,
            which would only warn), or a bad hyperparameter value.
    """
    entry = spec(name)
    rules = hparams.get("rules")
    valid = valid_hyperparameters(name, rules if isinstance(rules, Mapping) else None)
    unknown = sorted(set(hparams) - set(valid))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {unknown} for optimizer {name!r}; valid: {', '.join(valid)}")
    if isinstance(model_or_groups, nn.Module):
        groups = param_groups(model_or_groups)
    elif (what := wrong_params(model_or_groups)) is not None:
        raise TypeError(f"build_optimizer(name, model_or_groups) takes an nn.Module, parameters or param groups, "
                        f"e.g. build_optimizer({entry.name!r}, model); got {what}")
    else:
        groups = list(model_or_groups)
    if not issubclass(entry.cls, RoleOptimizer):  # the engine checks its groups itself (add_param_group)
        listed = [listed_params(g) if isinstance(g, dict) else g for g in groups]
        check_unique_params(listed if listed and isinstance(listed[0], dict) else [{"params": listed}])
    return entry.cls(groups, **{**entry.build_defaults, **hparams})
