"""torchtitan's configs with meqmuon's optimizer, for torchtitan's ``--module`` (torchtitan 0.3.0,
``torchtitan/config/manager.py``: ``--module X`` imports ``X.config_registry``, ``--config NAME`` calls its
function ``NAME``). Importing this module imports torchtitan.

Every config function of torchtitan's models (``torchtitan.models.<model>.config_registry``: ``llama3_debugmodel``,
``llama3_8b``, ``qwen3_moe_debug``, ...) is a function here of the same name, whose ``Trainer.Config`` is
torchtitan's with ``optimizer`` set to :class:`~.container.MeqMuonOptimizers`'s config (MeqMuon at lr 2e-2);
``--optimizer.name``, ``--optimizer.lr``, ``--optimizer.weight_decay`` choose another of meqmuon's optimizers
and its hyperparameters, as any field of torchtitan's config::

    torchrun --nproc_per_node 8 -m torchtitan.train --module meqmuon.integrations.torchtitan \\
        --config llama3_8b --optimizer.name meqmuon --optimizer.lr 2e-2

A config registry of one's own calls :func:`with_meqmuon` on a config.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torchtitan.models import _supported_models
from torchtitan.trainer import Trainer

from .container import MeqMuonOptimizers

__all__ = ["with_meqmuon"]


def with_meqmuon(config: Trainer.Config, name: str = "meqmuon", lr: float = 2e-2, weight_decay: float = 0.1,
                 **kwargs: Any) -> Trainer.Config:
    """``config`` with its optimizer replaced by meqmuon's ``name`` (in place; returned). torchtitan's LR
    scheduler config stays: its warmup and decay scale the ``lr`` given here."""
    config.optimizer = MeqMuonOptimizers.Config(name=name, lr=lr, weight_decay=weight_decay, kwargs=kwargs)
    return config


def _registries(config_name: str) -> list[str]:
    """torchtitan's model config registries, those whose model name starts ``config_name`` first."""
    models = sorted(_supported_models, key=lambda m: (not config_name.startswith(m + "_"), -len(m), m))
    return [f"torchtitan.models.{m}.config_registry" for m in models]


def _torchtitan_config(config_name: str) -> Callable[[], Trainer.Config]:
    """torchtitan's config function ``config_name``; the first registry that has it, those named by its prefix
    first (a registry that does not import, e.g. for a missing optional dependency, is named in the error)."""
    failed = []
    for path in _registries(config_name):
        try:
            module = importlib.import_module(path)
        except ImportError as e:
            failed.append(f"{path} ({e})")
            continue
        fn = getattr(module, config_name, None)
        if callable(fn):
            return fn
    raise AttributeError(f"no config function {config_name!r} in torchtitan's model config registries"
                         + (f"; not imported: {'; '.join(failed)}" if failed else ""))


def __getattr__(config_name: str) -> Callable[[], Trainer.Config]:
    if config_name.startswith("__"):
        raise AttributeError(config_name)
    base = _torchtitan_config(config_name)

    def config() -> Trainer.Config:
        return with_meqmuon(base())

    config.__name__ = config.__qualname__ = config_name
    config.__doc__ = f"torchtitan's {base.__module__}.{config_name} with meqmuon's optimizer (MeqMuon, lr 2e-2)."
    return config
