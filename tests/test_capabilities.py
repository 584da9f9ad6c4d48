"""The capability table (capabilities.py) covers every registered optimizer and says consistent things.

The parametrised tests read their optimizer names from the table; a registered optimizer without a
row would silently run in none of them, so this file fails instead. Likewise each rule family's file
names its optimizers: the families' float64 reference tests together must run every optimizer in
every step form, each in one family, or an optimizer added later could go untested.
"""

import importlib

from capabilities import (
    ALL,
    CAPABILITIES,
    CHECKS,
    ENGINE,
    FORMS,
    LAYOUTS,
    NEWTON_SCHULZ,
    ONE_PER_HIDDEN_RULE,
    STATED,
    covered,
    ddp_exchanges,
    every_form,
    having,
    runs,
)
from references import MUONEQ_MODE

import meqmuon
from meqmuon.optim.registry import REGISTRY


def test_the_table_has_one_row_per_registered_optimizer():
    assert set(STATED) == set(REGISTRY), (sorted(set(REGISTRY) - set(STATED)), sorted(set(STATED) - set(REGISTRY)))
    assert list(CAPABILITIES) == ALL == list(REGISTRY) == list(meqmuon.OPTIMIZERS)


def test_names_cover_every_optimizer():
    assert set(ENGINE) | {"adamw"} == set(ALL)


def test_derived_columns_agree_with_the_library():
    assert set(NEWTON_SCHULZ) == set(ENGINE) - {"scale"}
    assert [n for n, c in CAPABILITIES.items() if not c.nesterov] == ["adamw", "scale"]
    assert having("compile") == having("batched-compile") == ENGINE  # every optimizer takes compile=True
    assert all(c.forms == () for n, c in CAPABILITIES.items() if n not in ENGINE)
    assert all({"per-tensor", "batched"} <= set(c.forms) <= set(FORMS) for n, c in CAPABILITIES.items() if c.engine)
    assert ONE_PER_HIDDEN_RULE == ["muon", "normuon", "meqmuon", "muoneq-r", "muon-plus", "muon-vs", "muonh", "aurora",
                                   "meqmuon-shape"]
    # every MuonEq preset has its mode in the references
    assert [n for n, c in CAPABILITIES.items() if c.rules["hidden"] == "muoneq_hidden"] == list(MUONEQ_MODE)
    hidden = [CAPABILITIES[n].rules["hidden"] for n in ONE_PER_HIDDEN_RULE]
    assert len(set(hidden)) == len(hidden) and {CAPABILITIES[n].rules["hidden"] for n in NEWTON_SCHULZ} == set(hidden)


def test_stated_columns_use_known_words_and_agree_with_each_other():
    for name, c in CAPABILITIES.items():
        s = c.stated
        assert s.distributed <= set(LAYOUTS) and s.checks <= set(CHECKS), name
        for layout in s.distributed:  # a layout's step form is one the optimizer has
            form = {"compile": "compile", "batched": "batched"}.get(layout.rpartition("-")[2], "per-tensor")
            assert form in c.forms, (name, layout)
        if "views" in s.checks:
            assert {"per-tensor", "batched"} <= set(c.forms), name  # test_views runs both forms
        assert (s.ddp_exchanges is not None) == ("ddp-batched" in s.distributed), name
        if s.ddp_exchanges is not None:
            # test_distributed's hidden shapes: 3 buckets with transposes, 4 without; the embedding and head
            # rules (MeqMuon's equilibration, AdamW) run in place on every rank
            assert s.ddp_exchanges == (3 if s.transposes else 4), name
        # MeqMuon's and Muon's hidden rules are transpose-equivariant; NorMuon's per-row second moment,
        # MuonEq's R/C, SCALE's rows and AdamW's elementwise state are not (or need no buckets).
        assert s.transposes == (c.rules["hidden"] in ("meq_hidden", "moonlight_hidden", "meq_shape_hidden")), name
    assert ddp_exchanges() == {"muon": 3, "normuon": 4, "meqmuon": 3}
    assert runs("ddp", "ddp-compile") == ["muon", "normuon", "meqmuon", "meqmuon+compile"]
    assert runs("experts-fsdp2", "experts-fsdp2-batched") == ["muon+foreach", "normuon", "meqmuon"]


#: The rule families' test files, each holding its optimizers' float64 reference test (``CASES``).
FAMILIES = ("test_meqmuon", "test_muon", "test_normuon", "test_scale", "test_adamw", "test_presets_2026",
            "test_recipes_2026")


def test_the_rule_families_run_every_optimizer_in_every_form():
    pairs = {f: covered(importlib.import_module(f).CASES) for f in FAMILIES}
    union = set().union(*pairs.values())
    assert union == set(every_form()), (sorted(set(every_form()) - union), sorted(union - set(every_form())))
    names = [{n for n, _ in p} for p in pairs.values()]
    assert sum(map(len, names)) == len(set().union(*names)) == len(ALL)  # each optimizer in one family
