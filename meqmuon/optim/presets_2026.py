"""The 2026 field's optimizers as presets (issue 48): each is a rule table over the engine, as
``presets.py``'s, with the new hidden-matrix rule and AdamW (or MeqMuon's rules) for the other kinds.

| optimizer    | hidden           | embedding   | head        | vector        | official code                   |
|--------------|------------------|-------------|-------------|---------------|---------------------------------|
| MuonPlus     | muonplus_hidden  | adamw       | adamw       | adamw         | K1seki221/MuonPlus 8a9ace1      |
| MuonVS       | muon_vs          | adamw       | adamw       | adamw         | jingru-lee/Variance-Adaptive-Muon |
| MuonH        | muonh_hidden     | adamw       | adamw       | adamw         | marin-community/marin ab6e485   |
| Aurora       | aurora_hidden    | adamw       | adamw       | adamw         | tilde-research/aurora-release 3d79a5c |
| MeqMuonShape | meq_shape_hidden | equilibrate | equilibrate | rms_normalize | (ablation of MeqMuon's eq. 8)   |

(commits: MuonPlus 8a9ace1, Variance-Adaptive-Muon 75f78ad, marin ab6e485, aurora-release 3d79a5c.)
Every one takes :class:`~meqmuon.optim.presets.Muon`'s (or :class:`~meqmuon.optim.presets.MeqMuon`'s)
constructor and its rule's own keywords (``norm_mode``, ``vs_eps``, ``pp_iterations``/``pp_beta``); the
maths, sources and choices are in the rules' docstrings and docs/algorithm.md, "The 2026 field".
"""

from __future__ import annotations

from typing import Any

from ..functional import Coefficients
from .presets import MeqMuon, Muon
from .rules.aurora import AURORA_NS_COEFFICIENTS, AURORA_NS_STEPS

__all__ = ["Aurora", "MeqMuonShape", "MuonH", "MuonPlus", "MuonVS"]


class MuonPlus(Muon):
    """Muon+ (arXiv 2602.21545): Muon with ``row_col`` normalisation after Newton-Schulz and upstream's
    ``sqrt(m/n)`` step multiplier (:class:`~meqmuon.optim.rules.muonplus.MuonPlusHidden`; ``norm_mode=``
    picks another mode); AdamW for the other kinds, at the same lr, as upstream's ``MuonPlus``."""

    RULES = {"hidden": "muonplus_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


class MuonVS(Muon):
    """Muon-VS (arXiv 2601.14603): the momentum divided elementwise by the root of its bias-corrected
    variance before Newton-Schulz, Moonlight's step multiplier (:class:`~meqmuon.optim.rules.muon_vs.MuonVS`);
    AdamW for the other kinds."""

    RULES = {"hidden": "muon_vs", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


class MuonH(Muon):
    """MuonH / hyperball (arXiv 2606.16899): Muon whose weights keep their initial Frobenius norm, each step
    ``lr`` times it (:class:`~meqmuon.optim.rules.muonh.MuonH`); AdamW for the other kinds (levanter
    uses Adam for embeddings and vectors and AdamH for the LM head: see docs/algorithm.md)."""

    RULES = {"hidden": "muonh_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}


class Aurora(Muon):
    """Aurora (arXiv 2606.27715): the leverage-uniform polar factor of rectangular matrices, two polars per
    step, each 12 simple-quintic Newton-Schulz iterations by default (upstream's ``polar``), and
    ``sqrt(max(1, m/n))`` (:class:`~meqmuon.optim.rules.aurora.AuroraHidden`); AdamW for the other kinds."""

    RULES = {"hidden": "aurora_hidden", "embedding": "adamw", "head": "adamw", "vector": "adamw"}

    def __init__(self, params: Any, lr: float = 1e-3, *, ns_steps: int = AURORA_NS_STEPS,
                 ns_coefficients: Coefficients = AURORA_NS_COEFFICIENTS, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, ns_steps=ns_steps, ns_coefficients=ns_coefficients, **kwargs)


class MeqMuonShape(MeqMuon):
    """``meqmuon-shape``: MeqMuon with eq. 8's row/column choice fixed by shape (tall and square: rows, wide:
    columns; :class:`~meqmuon.optim.rules.meq_shape.MeqShapeHidden`), an ablation of the CV choice."""

    RULES = {"hidden": "meq_shape_hidden", "embedding": "equilibrate", "head": "equilibrate",
             "vector": "rms_normalize"}
