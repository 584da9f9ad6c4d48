"""meqmuon in torchtitan (pytorch/torchtitan 0.3.0, the release on PyPI; docs/torchtitan.md).

torchtitan routes parameters to optimizers by regex on their names (``OptimizersContainer`` with
``ParamGroupConfig``) and builds only the optimizers of its fixed table (``_resolve_optimizer_factory``:
Adam, AdamW, DistMuon). meqmuon routes by role (:func:`meqmuon.param_groups`), so this package gives a
container whose optimizers meqmuon builds, one per model part, keeping everything else of torchtitan's
(step, zero_grad, its flat checkpoint dicts, its LR schedulers)::

    from meqmuon.integrations.torchtitan import MeqMuonOptimizers

    config.optimizer = MeqMuonOptimizers.Config(name="meqmuon", lr=2e-2)   # in a Trainer.Config

or, for every config of torchtitan's, from its command line (:mod:`.config_registry`)::

    torchrun --nproc_per_node 8 -m torchtitan.train --module meqmuon.integrations.torchtitan \\
        --config llama3_8b --optimizer.name meqmuon --optimizer.lr 2e-2

This module itself imports torch and meqmuon only: :func:`build_meqmuon` is all a container needs of
meqmuon; ``MeqMuonOptimizers`` (:mod:`.container`) imports torchtitan when first named.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...optim.engine import RoleOptimizer
from ...optim.factory import build_optimizer
from ...optim.groups import param_groups

__all__ = ["IMPLEMENTATIONS", "MeqMuonOptimizers", "build_meqmuon", "canonical_fqn"]

#: torchtitan's ``OptimizersContainer.Config.implementation`` -> meqmuon's ``foreach``: "foreach" and
#: "for-loop" choose meqmuon's batched or per-tensor step; "fused" (torchtitan's default) leaves meqmuon's own
#: choice (batched on CUDA). meqmuon has no fused kernel, and "fused_opt_states_bf16" is an Adam/AdamW hook of
#: torchtitan's (bf16 Adam moments): meqmuon's ``state_dtype`` is the keyword for that.
IMPLEMENTATIONS: dict[str, bool | None] = {"foreach": True, "for-loop": False, "fused": None}

#: The segment torchtitan's activation checkpointing inserts into parameter names
#: (``torchtitan/components/checkpointer/utils.py``, ``_WRAPPER_PREFIXES``).
_WRAPPERS = ("_checkpoint_wrapped_module",)


def canonical_fqn(name: str) -> str:
    """A parameter's name without activation-checkpointing wrappers, as torchtitan's ``canonical_fqn`` writes
    the names of its flat ``state.{fqn}.{name}`` checkpoint keys."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


def build_meqmuon(name: str, model: nn.Module, implementation: str = "fused", **hparams: Any) -> RoleOptimizer:
    """Optimizer ``name`` of meqmuon over one torchtitan model part, its groups routed by role
    (:func:`meqmuon.param_groups`) and carrying what torchtitan reads of a group: ``param_names`` (the
    canonical names its checkpoints key state by) and the step form of its ``implementation``.

    Args:
        name: a name of :data:`meqmuon.optim.registry.REGISTRY` (``"meqmuon"``, ``"muon"``, ...).
        model: one model part (the whole model without pipeline parallelism), parallelised already: meqmuon
            follows the FSDP2 / TP layouts of its DTensors.
        implementation: torchtitan's, a key of :data:`IMPLEMENTATIONS`.
        **hparams: keywords of the optimizer (``lr``, ``weight_decay``, ``ns_dtype``, ...).

    Raises:
        ValueError: an ``implementation`` meqmuon has no form for, or what :func:`meqmuon.build_optimizer` raises.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: meqmuon's step forms are {sorted(IMPLEMENTATIONS)} "
                         "('fused_opt_states_bf16' is torchtitan's bf16-moment hook for Adam/AdamW; meqmuon's "
                         "keyword for bf16 state is state_dtype=torch.bfloat16)")
    groups = param_groups(model)
    for g in groups:
        g["param_names"] = [canonical_fqn(n) for n in g["names"]]
        g["foreach"] = IMPLEMENTATIONS[implementation]
    return build_optimizer(name, groups, **hparams)


def __getattr__(attr: str) -> Any:
    if attr == "MeqMuonOptimizers":  # imports torchtitan
        try:
            from .container import MeqMuonOptimizers
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] not in ("torchtitan", "triton"):
                raise
            raise ImportError(f"MeqMuonOptimizers subclasses torchtitan's OptimizersContainer, and {e.name} does not "
                              "import: pip install 'meqmuon[torchtitan]' (torchtitan 0.3 imports triton, which a "
                              "CPU-only torch lacks: pip install triton)") from e
        return MeqMuonOptimizers
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
