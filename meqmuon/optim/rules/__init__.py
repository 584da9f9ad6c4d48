"""Update rules: one object per rule, each turning gradients (and its state) into a parameter update.

An optimizer in this package is an assignment of rules to parameter kinds (see ``presets.py``),
by name through :data:`RULES`. One module per rule family, each holding every form of its rules
side by side (per-tensor, batched, compiled where there is one): ``meqmuon.py`` (MeqMuon's hidden,
embedding/head and vector rules), ``muon.py`` (Moonlight's Muon, MuonEq), ``normuon.py``,
``adam.py`` (AdamW, SCALE's Adam) and ``scale.py``. The machinery they share is ``../step.py``.

Every rule applies decoupled weight decay and its step the same way,

    W <- (1 - lr * wd) * W - lr * scale * D,

where ``D`` is the rule's direction and ``scale`` its multiplier (``rho`` for MeqMuon's rules,
``rho * sqrt(max(m, n))`` for Moonlight's Muon, 1 for Adam-type and SCALE rules).
"""

from __future__ import annotations

from ..step import Rule
from .adam import AdamScale, AdamW
from .meqmuon import MeqHidden
from .muon import MoonlightHidden, MuonEqHidden
from .normalize import Equilibrate, RmsNormalize
from .normuon import NorMuonHidden
from .scale import ScaleCol, ScaleHead, ScaleRow

__all__ = ["RULES", "AdamScale", "AdamW", "Equilibrate", "MeqHidden", "MoonlightHidden", "MuonEqHidden",
           "NorMuonHidden", "RmsNormalize", "ScaleCol", "ScaleHead", "ScaleRow"]

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
    )
}
