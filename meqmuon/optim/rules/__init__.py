"""Update rules: one object per rule, each turning gradients (and its state) into a parameter update.

An optimizer in this package is an assignment of rules to parameter kinds (see ``presets.py``),
by name through :data:`RULES`, or by instance through ``rules={kind: rule}``. The hidden-matrix rules
are :class:`~meqmuon.optim.driver.HiddenRule` s, ``pre``/``post`` around the driver's Newton-Schulz:
``meqmuon.py`` (MeqMuon, eq. 8), ``muon.py`` (Moonlight's Muon, MuonEq), ``normuon.py``, and the 2026
field's ``muonplus.py`` (Muon+), ``aurora.py`` (Aurora), ``meq_shape.py`` (MeqMuon's choice fixed by shape),
``muon_vs.py`` (Muon-VS, its own direction input) and ``muonh.py`` (MuonH, its own step). MeqMuon's
embedding/head and vector rules (eq. 9 and 10, ``meqmuon.py``) are :class:`~meqmuon.optim.rule.MomentumRule` s:
a direction of a stack and a per-tensor update. The Adam-type and SCALE rules write their own per-tensor
and batched forms (:class:`~meqmuon.optim.rule.SteppingRule`: ``adam.py``, with AdamW's eps-before-correction form
and AdamH for the 2026 field's recipes, and ``scale.py``). What a rule is:
``../rule.py``; how a step runs, in every form: ``../driver.py``.

Every rule applies decoupled weight decay and its step the same way,

    W <- (1 - lr * wd) * W - lr * scale * D,

where ``D`` is the rule's direction and ``scale`` its multiplier (``rho`` for MeqMuon's rules,
``rho * sqrt(max(m, n))`` for Moonlight's Muon, 1 for Adam-type and SCALE rules).
"""

from __future__ import annotations

from ..rule import Rule
from .adam import AdamH, AdamScale, AdamW, AdamWEpsBefore
from .aurora import AuroraHidden
from .meq_shape import MeqShapeHidden
from .meqmuon import Equilibrate, MeqHidden, RmsNormalize
from .muon import MoonlightHidden, MuonEqHidden
from .muon_vs import MuonVS
from .muonh import MuonH
from .muonplus import MuonPlusHidden
from .normuon import NorMuonHidden
from .scale import ScaleCol, ScaleHead, ScaleRow

__all__ = ["RULES", "AdamH", "AdamScale", "AdamW", "AdamWEpsBefore", "AuroraHidden", "Equilibrate", "MeqHidden",
           "MeqShapeHidden", "MoonlightHidden", "MuonEqHidden", "MuonH", "MuonPlusHidden", "MuonVS", "NorMuonHidden",
           "RmsNormalize", "ScaleCol", "ScaleHead", "ScaleRow"]

#: The rules by name, as the presets' tables (kind -> rule name) and the engine look them up.
RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        MeqHidden(),
        MoonlightHidden(),
        MuonEqHidden(),
        NorMuonHidden(),
        Equilibrate(),
        RmsNormalize(),
        AdamW(),
        AdamScale(),
        ScaleRow(),
        ScaleCol(),
        ScaleHead(),
        # the 2026 field (issue 48; docs/algorithm.md, "The 2026 field")
        MuonPlusHidden(),
        MuonVS(),
        MuonH(),
        AuroraHidden(),
        MeqShapeHidden(),
        # the 2026 field's upstream recipes (issue 58)
        AdamWEpsBefore(),
        AdamH(),
    )
}
