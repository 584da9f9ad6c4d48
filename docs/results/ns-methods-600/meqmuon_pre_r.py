"""``meqmuon`` CLI with one more optimizer name, ``meqmuon-pre-r``: MeqMuon whose hidden rule also
row-equilibrates the direction input before Newton-Schulz, as MuonEq-R does
(:func:`meqmuon.functional.muoneq_equilibrate` in mode R), then MeqMuon's eq. 8 after it.

An experiment of issue 38 item 3 (docs/results/ns-methods-600), not a library optimizer: the rule is a
user's ``HiddenRule`` (docs/variants.md), registered here at run time so that ``meqmuon sweep`` can
name it. Usage, from the repository root::

    PYTHONPATH=. python docs/results/ns-methods-600/meqmuon_pre_r.py sweep --optimizers meqmuon-pre-r ...
"""

from __future__ import annotations

import dataclasses
import sys

from meqmuon import functional as F
from meqmuon.cli import main
from meqmuon.optim import registry
from meqmuon.optim.presets import MeqMuon
from meqmuon.optim.rules import RULES, MeqHidden


class MeqPreRHidden(MeqHidden):
    """``U = Orth(E_R(X))`` (every row of the direction input to unit L2 norm), then eq. 8."""

    name = "meq_pre_r_hidden"
    transposes = False  # as MuonEq's rule: the rows equilibrated are the matrix's own

    def pre(self, X, group, state):
        return F.muoneq_equilibrate(X, "R")


class MeqMuonPreR(MeqMuon):
    RULES = {**MeqMuon.RULES, "hidden": MeqPreRHidden.name}


RULES[MeqPreRHidden.name] = MeqPreRHidden()
registry.REGISTRY["meqmuon-pre-r"] = dataclasses.replace(
    registry.spec("meqmuon"), name="meqmuon-pre-r", cls=MeqMuonPreR, label="MeqMuon, MuonEq-R before NS",
    demo=False, memory_row=None, ablation_row=None)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
