"""The one table of per-optimizer facts: name, class, learning rates and the tables each optimizer is a row of.

Every other module (``build_optimizer``, ``meqmuon train``'s default lr, ``compare``/``sweep``, the memory
and ablation tables, the CLI's lists of names) reads this registry, so that a new optimizer is one
:class:`OptimizerSpec` here. Before it, four tables held these facts and ``muoneq-*`` reached only three
of them: ``meqmuon train --optimizer muoneq-r`` without ``--lr`` failed with ``KeyError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

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
from .presets_2026 import (
    Aurora,
    AuroraShared,
    MeqMuonShape,
    MuonH,
    MuonH202601,
    MuonPlus,
    MuonPlusShared,
    MuonVS,
    MuonVSShared,
)

__all__ = ["OptimizerSpec", "REGISTRY", "ABLATION_NAMES", "DEMO_NAMES", "MEMORY_NAMES", "spec"]


@dataclass(frozen=True)
class OptimizerSpec:
    """What the package knows about one optimizer name."""

    name: str
    cls: type[torch.optim.Optimizer]
    #: Learning rate of ``meqmuon train`` without ``--lr`` (the paper's setting, section 4).
    default_lr: float
    #: Learning rate of ``meqmuon compare`` / ``ablation`` at the CPU demo setting (docs/training.md).
    demo_lr: float
    #: Name in the paper-style tables (memory, ablation); ``None``: the name itself.
    label: str | None = None
    #: In ``meqmuon compare``'s default set of optimizers.
    demo: bool = False
    #: Row (0-based) in ``meqmuon memory``'s default table (Table 5's order, then Table 7's, then MuonEq).
    memory_row: int | None = None
    #: Row (0-based) in the component ablation (the paper's Table 7 order: Muon, the variants, MeqMuon).
    ablation_row: int | None = None
    #: Keyword defaults that ``build_optimizer`` adds to the class's own.
    build_defaults: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def display(self) -> str:
        """The name in tables: :attr:`label` or :attr:`name`."""
        return self.label or self.name


# default_lr: MeqMuon the paper's 2e-3 (Llama-60M, section 4); the Muon-family baselines and the
# ablations share it; AdamW 1e-3 (GaLore's Llama-60M/130M setting). MuonEq had no default before this
# registry: it is Muon with an equilibrated Newton-Schulz input and shares Muon's lr grid, so Muon's.
# demo_lr: the best of a pre-check grid at the demo setting (100 updates; AdamW 1e-3/3e-3/1e-2, the
# others 1e-2/3e-2; docs/training.md has the numbers). SCALE and the ablations were not pre-checked and
# use 1e-2. MuonEq: R's is the best of the 3-seed grid at the demo setting
# (docs/benchmarks.md, 5e-3..8e-2; 2e-2 with and without Polar Express); C and RC were not swept: Muon's.
_SPECS = (
    # adamw is torch.optim.AdamW with betas (0.9, 0.95) and weight decay 0.1 (the paper's setting,
    # section 4) over the same role groups.
    OptimizerSpec("adamw", torch.optim.AdamW, 1e-3, 3e-3, "AdamW", demo=True, memory_row=0,
                  build_defaults={"betas": ADAMW_BETAS, "weight_decay": WEIGHT_DECAY}),
    OptimizerSpec("muon", Muon, 2e-3, 1e-2, "Muon", demo=True, memory_row=2, ablation_row=0),
    OptimizerSpec("normuon", NorMuon, 2e-3, 3e-2, "NorMuon", demo=True, memory_row=3),
    OptimizerSpec("scale", Scale, 2e-3, 1e-2, "SCALE", memory_row=1),
    OptimizerSpec("meqmuon", MeqMuon, 2e-3, 3e-2, "MeqMuon", demo=True, memory_row=4, ablation_row=4),
    OptimizerSpec("meqmuon-only-hidden", MuonOnlyHidden, 2e-3, 1e-2, "Only 2D weights in hidden layers",
                  memory_row=5, ablation_row=1),
    OptimizerSpec("meqmuon-only-embedding", MuonOnlyEmbedding, 2e-3, 1e-2, "Only remaining 2D parameters",
                  memory_row=6, ablation_row=2),
    OptimizerSpec("meqmuon-only-vector", MuonOnlyVector, 2e-3, 1e-2, "Only 1D parameters", memory_row=7,
                  ablation_row=3),
    # The memory table's one MuonEq row stands for all three modes: they keep the same state as Muon.
    OptimizerSpec("muoneq-r", MuonEqR, 2e-3, 2e-2, "MuonEq (R, C, RC)", memory_row=8),
    OptimizerSpec("muoneq-c", MuonEqC, 2e-3, 1e-2),
    OptimizerSpec("muoneq-rc", MuonEqRC, 2e-3, 1e-2),
    # The 2026 field (issue 48), each under its name with its upstream recipe for every kind and, as "-shared"
    # (muonh: "-2026-01"), issue 48's preset with the shared protocol's AdamW (issue 58; presets_2026.py).
    # default_lr from each method's own code at its nearest setting to ours; none was pre-checked at the demo
    # setting, so demo_lr is default_lr, except where the step shares Muon's scale.
    # muon-plus: upstream's Llama-60M config (configs/llama60M_row-col.yaml: lr 0.04; its sqrt(m/n) scale).
    OptimizerSpec("muon-plus", MuonPlus, 4e-2, 4e-2, "Muon+"),
    OptimizerSpec("muon-plus-shared", MuonPlusShared, 4e-2, 4e-2, "Muon+ (shared)"),
    # muon-vs: Moonlight's scale as Muon's; upstream's NanoGPT config (config/small_muon_vs.py) 6e-4 for Muon-VS
    # and its AdamW; issue 48's preset Muon's.
    OptimizerSpec("muon-vs", MuonVS, 6e-4, 1e-2, "Muon-VS"),
    OptimizerSpec("muon-vs-shared", MuonVSShared, 2e-3, 1e-2, "Muon-VS (shared)"),
    # muonh: lr is the relative step ||dW||/||W||; 2e-2 is what Muon at its 2e-3 (step RMS 0.2 lr) does to a
    # weight of RMS 0.02, the initialisation of our Llamas (levanter's rule sqrt(lr wd) needs a Muon lr and wd
    # of levanter's own scale, which we do not have). The recipe's Adam lr is its own (adam_lr, 6e-4).
    OptimizerSpec("muonh", MuonH, 2e-2, 2e-2, "MuonH"),
    OptimizerSpec("muonh-2026-01", MuonH202601, 2e-2, 2e-2, "MuonH (2026-01, shared)"),
    # aurora: sqrt(max(1, m/n)) scale, Keller Jordan's Muon convention, whose LLM lr is 0.02
    # (KellerJordan/Muon README); upstream's own default eta 0.05 is for a CIFAR-10 MLP.
    OptimizerSpec("aurora", Aurora, 2e-2, 2e-2, "Aurora"),
    OptimizerSpec("aurora-shared", AuroraShared, 2e-2, 2e-2, "Aurora (shared)"),
    # meqmuon-shape: MeqMuon's lrs (same step RMS rho lr).
    OptimizerSpec("meqmuon-shape", MeqMuonShape, 2e-3, 3e-2, "MeqMuon (shape)"),
)

#: name -> spec, in the order in which names are listed (help texts, error messages).
REGISTRY: dict[str, OptimizerSpec] = {s.name: s for s in _SPECS}

#: ``meqmuon compare``'s default optimizers.
DEMO_NAMES: tuple[str, ...] = tuple(s.name for s in _SPECS if s.demo)
#: Rows of ``meqmuon memory``'s default table, in order.
MEMORY_NAMES: tuple[str, ...] = tuple(s.name for s in sorted(_SPECS, key=lambda s: s.memory_row or 0)
                                      if s.memory_row is not None)
#: Rows of the component ablation (paper Table 7), in order.
ABLATION_NAMES: tuple[str, ...] = tuple(s.name for s in sorted(_SPECS, key=lambda s: s.ablation_row or 0)
                                        if s.ablation_row is not None)


def spec(name: str) -> OptimizerSpec:
    """The spec of optimizer ``name`` (case-insensitive); ``ValueError`` listing the valid names."""
    key = str(name).lower()
    if key not in REGISTRY:
        raise ValueError(f"unknown optimizer {name!r}; valid optimizers: {', '.join(REGISTRY)}")
    return REGISTRY[key]
