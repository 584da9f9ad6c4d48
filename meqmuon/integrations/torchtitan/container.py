"""torchtitan's ``OptimizersContainer`` with meqmuon's optimizers (torchtitan 0.3.0,
``torchtitan/components/optimizer/optimizer.py``). Importing this module imports torchtitan.

What torchtitan does with an optimizer, each kept: ``step`` / ``zero_grad`` over ``optimizers``;
``state_dict`` / ``load_state_dict`` as flat ``state.{fqn}.{key}`` and ``param_groups.{fqn}.{key}`` dicts for
DCP (``components/optimizer/utils.py``: they need ``param_names`` in every group, and ``init_optim_state``'s
step with all-zero gradients and ``lr=0`` must change nothing, both tested in ``tests/test_contracts.py``);
``LRSchedulersContainer`` builds one ``LambdaLR`` per entry of ``optimizers``; step pre-hooks on the
container (the MoE load-balancing hook, ``register_moe_load_balancing_hook``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from ...optim.groups import describe_groups
from . import IMPLEMENTATIONS, build_meqmuon


class MeqMuonOptimizers(OptimizersContainer):
    """torchtitan's container whose optimizers meqmuon builds, one per model part, routed by role.

    In a ``Trainer.Config``: ``optimizer=MeqMuonOptimizers.Config(name="meqmuon", lr=2e-2)`` in place of
    ``default_adamw(...)``; torchtitan builds it after parallelising the model (``Trainer.__init__``), so
    meqmuon sees the FSDP2 / TP DTensors and follows their layouts. The routing of each model part
    (:func:`meqmuon.describe_groups`: which tensor is hidden, embedding, head or vector, matrix views, fused
    tensors kept whole) goes to torchtitan's log.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: str = "meqmuon"
        """A name of ``meqmuon.optim.registry.REGISTRY``: meqmuon, muon, normuon, muoneq-r, scale, adamw, ..."""

        lr: float = 2e-2
        """Peak learning rate. 2e-2: the first lr to try for MeqMuon and the Muon family here (their updates
        have RMS 0.2 lr); AdamW's is lower, ~3e-3 (docs/lr.md)."""

        weight_decay: float = 0.1
        """Decoupled weight decay (the paper's 0.1)."""

        kwargs: dict[str, Any] = field(default_factory=dict)
        """Other keywords of the optimizer, e.g. ``{"ns_dtype": torch.float32, "momentum": 0.95}``."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.param_groups:
            raise ValueError("MeqMuonOptimizers routes parameters by role (meqmuon.param_groups); its config takes "
                             "no param_groups (torchtitan's regex routing): set name, lr, weight_decay and kwargs")
        if config.optimizer_factory_kwargs_by_name:
            raise ValueError("MeqMuonOptimizers builds meqmuon's optimizers: optimizer_factory_kwargs_by_name "
                             f"({sorted(config.optimizer_factory_kwargs_by_name)}) is for torchtitan's own; pass "
                             "keywords in kwargs")
        if config.implementation not in IMPLEMENTATIONS:
            build_meqmuon(config.name, nn.Module(), config.implementation)  # raises, saying why
        self.model_parts = model_parts
        self.optimizers = []
        for i, part in enumerate(model_parts):
            opt = build_meqmuon(config.name, part, config.implementation, lr=config.lr,
                                weight_decay=config.weight_decay, **config.kwargs)
            self.optimizers.append(opt)
            logger.info(f"meqmuon {config.name} (model_part={i}), lr {config.lr}, weight decay "
                        f"{config.weight_decay}:\n{describe_groups(opt.param_groups)}")
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        self._validate_params(params)
        self._post_init(params)
