"""Which optimizer has which forms and which paths the tests check: one row per registered optimizer.

Rows follow ``meqmuon.optim.registry.REGISTRY`` (its names and order). What the library already says is
read from it: the class (a meqmuon ``RoleOptimizer``, or torch's AdamW), the keyword arguments it takes
(``ns_dtype``, ``nesterov``, ``compile``) and its kind -> rule table. What only the tests say is written
in ``STATED``: whether its batched buckets take a matrix transposed, which distributed layouts
(``LAYOUTS``) and which other checks (``CHECKS``, the matrix views among them) run it. test_capabilities.py fails when a
registered optimizer has no row, so a new optimizer cannot be left out of the parametrised tests.
:func:`every_form` lists every (optimizer, step form) pair, which test_param_shapes.py steps on
parameters of every rank (0-D to 4-D). :func:`reference_cases` is the parametrisation of each rule
family's float64 reference test (test_meqmuon.py, test_muon.py, test_normuon.py, test_scale.py,
test_adamw.py, test_presets_2026.py, test_recipes_2026.py); test_capabilities.py checks that together they hold
every pair of :func:`every_form`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import meqmuon
from meqmuon.optim.registry import REGISTRY

#: Single-process step forms: the per-tensor step, the batched step (``foreach=True``), and each of
#: them with ``compile=True``.
FORMS = ("per-tensor", "batched", "compile", "batched-compile")

#: Distributed layouts (test_distributed.py). A ``-compile`` layout runs ``compile=True``, a
#: ``-batched`` one the batched step with float32 Newton-Schulz (against the per-tensor float32 step).
LAYOUTS = {
    "ddp": "2 DDP ranks equal one process bit for bit, the work split, the state complete on every rank",
    "ddp-compile": "the same with compile=True",
    "ddp-batched": "batched step under DDP: ddp_exchanges exchanges per step, ranks identical, = one process",
    "ddp-resume": "rank 0's mid-run state_dict resumes in one process bit for bit",
    "fsdp2": "FSDP2 row shards (odd sizes, an empty shard) equal the unsharded optimizer to 1e-6",
    "fsdp2-compile": "the same with compile=True",
    "fsdp2-batched": "FSDP2 with the batched step equals the unsharded per-tensor step to 1e-5",
    "fsdp2-dcp": "FSDP2 + torch.distributed.checkpoint resumes bit for bit, and across world sizes",
    "hsdp": "HSDP (2 x 2 mesh) equals the unsharded optimizer, replica groups bit-identical",
    "hsdp-dcp": "HSDP + torch.distributed.checkpoint resumes bit for bit",
    "experts-ddp": "stacked expert views under DDP equal one process bit for bit",
    "experts-ddp-batched": "the same with the batched step",
    "experts-fsdp2": "FSDP2 updates whole experts per rank with no collective; same state keys on every rank",
    "experts-fsdp2-batched": "the same with the batched step",
    # tests/test_layouts.py: real models under torch's parallel APIs, the same gradients fed to one process
    "tp": "Llama under torchtitan's TP plan (mesh of 2) equals one process to 1e-6",
    "tp-batched": "the same with the batched step",
    "tp-compile": "the same with compile=True",
    "tp-batched-compile": "the same with compile=True and the batched step",
    "fsdp2-views": "FSDP2 on Phi3, GPT-2, Qwen3-MoE, DBRX, GPT-OSS (fused, transposed, expert views) = one process",
    "fsdp2-views-batched": "the same with the batched step",
    "fsdp2xtp": "FSDP2 over TP on a 2 x 2 mesh (4 processes) equals one process to 1e-6",
    "fsdp2xtp-batched": "the same with the batched step",
    "ddp-batched-compile": "compile=True with the batched step under DDP and FSDP2 equals eager one process",
}

#: Other checks that run on some optimizers only.
CHECKS = {
    "views": "matrix views (experts, split fused projections, Conv1D) equal separate 2-D matrices (test_views.py)",
    "own-stacks": "same-rule batched calls with different hyperparameters keep their own stacks (test_foreach.py)",
    "op-count": "the batched step's op count: <= 300 at Llama-60M shapes, <= 1.15x for 3x the depth "
                "(test_foreach.py), flat in the number of experts (test_views.py)",
}


@dataclass(frozen=True)
class Stated:
    """What the tests check of one optimizer that the library does not say."""

    #: Batched step: a 2-D ``(n, m)`` matrix may join an ``(m, n)`` bucket transposed (NorMuon's per-row
    #: second moment and MuonEq's R/C, which a transpose would swap, keep them apart).
    transposes: bool = False
    #: Distributed layouts the tests run (keys of ``LAYOUTS``).
    distributed: frozenset[str] = frozenset()
    #: Exchanges (``all_to_all_single``) per step of the ``ddp-batched`` test: one per shape bucket of hidden
    #: matrices, the owners' directions to every other rank (nothing goes out: every rank holds ``X``). Its
    #: hidden shapes make 3 buckets when transposes are allowed, 4 when not; every other rule runs in place.
    ddp_exchanges: int | None = None
    #: Other checks the tests run (keys of ``CHECKS``).
    checks: frozenset[str] = frozenset()


#: One row per registered optimizer.
STATED: dict[str, Stated] = {
    "adamw": Stated(),  # torch.optim.AdamW: its forms are torch's own
    "muon": Stated(
        transposes=True,
        distributed=frozenset({"ddp", "ddp-batched", "fsdp2", "fsdp2-batched", "hsdp", "experts-ddp",
                               "experts-fsdp2-batched", "tp", "tp-batched", "fsdp2-views"}),
        ddp_exchanges=3,
        checks=frozenset({"views", "own-stacks", "op-count"}),
    ),
    "normuon": Stated(
        distributed=frozenset({"ddp", "ddp-batched", "ddp-resume", "fsdp2", "fsdp2-batched", "fsdp2-dcp", "hsdp",
                               "experts-ddp", "experts-ddp-batched", "experts-fsdp2", "tp", "tp-batched",
                               "fsdp2-views", "fsdp2-views-batched", "fsdp2xtp-batched", "ddp-batched-compile"}),
        ddp_exchanges=4,
        checks=frozenset({"views", "own-stacks", "op-count"}),
    ),
    "scale": Stated(distributed=frozenset({"fsdp2", "fsdp2-batched", "tp", "tp-batched", "fsdp2-views", "fsdp2xtp"}),
                    checks=frozenset({"views"})),
    "meqmuon": Stated(
        transposes=True,
        distributed=frozenset({"ddp", "ddp-compile", "ddp-batched", "ddp-resume", "fsdp2", "fsdp2-compile",
                               "fsdp2-batched", "fsdp2-dcp", "hsdp", "hsdp-dcp", "experts-ddp",
                               "experts-ddp-batched", "experts-fsdp2", "tp", "tp-batched", "tp-compile",
                               "tp-batched-compile", "fsdp2-views", "fsdp2-views-batched", "fsdp2xtp",
                               "ddp-batched-compile"}),
        ddp_exchanges=3,
        checks=frozenset({"views", "own-stacks", "op-count"}),
    ),
    "meqmuon-only-hidden": Stated(transposes=True, checks=frozenset({"views"})),
    "meqmuon-only-embedding": Stated(transposes=True),
    "meqmuon-only-vector": Stated(transposes=True),
    "muoneq-r": Stated(distributed=frozenset({"tp", "tp-batched", "fsdp2-views"}), checks=frozenset({"views"})),
    "muoneq-c": Stated(checks=frozenset({"views"})),
    "muoneq-rc": Stated(checks=frozenset({"views"})),
    # the 2026 field (issue 48; tests/test_presets_2026.py also runs each under DDP and FSDP2 itself)
    # (issue 58: the names are the upstream recipes, tests/test_recipes_2026.py; "-shared" and "muonh-2026-01" are
    # issue 48's presets)
    "muon-plus": Stated(checks=frozenset({"views"})),
    "muon-plus-shared": Stated(checks=frozenset({"views"})),
    "muon-vs": Stated(checks=frozenset({"views", "op-count"})),
    "muon-vs-shared": Stated(checks=frozenset({"views", "op-count"})),
    "muonh": Stated(checks=frozenset({"views", "op-count"})),
    "muonh-2026-01": Stated(checks=frozenset({"views", "op-count"})),
    "aurora": Stated(checks=frozenset({"views"})),
    "aurora-shared": Stated(checks=frozenset({"views"})),
    "meqmuon-shape": Stated(transposes=True, checks=frozenset({"views"})),
}


@dataclass(frozen=True)
class Capability:
    """One optimizer: what the library says (first block) and what the tests check (``stated``)."""

    name: str
    #: A meqmuon ``RoleOptimizer`` (``adamw`` is ``torch.optim.AdamW``).
    engine: bool
    #: Orthogonalises its hidden matrices (takes ``ns_dtype``; SCALE does not).
    newton_schulz: bool
    #: Takes ``nesterov`` (SCALE's head momentum is a plain EMA).
    nesterov: bool
    #: Its step forms (``FORMS``): the engine's two, and the compiled two where it takes ``compile``.
    forms: tuple[str, ...]
    #: Its kind -> rule table (``meqmuon.rules_of``).
    rules: dict[str, str]
    stated: Stated


def _capability(name: str, stated: Stated) -> Capability:
    engine = issubclass(REGISTRY[name].cls, meqmuon.RoleOptimizer)
    hyper = meqmuon.valid_hyperparameters(name)
    forms = ("per-tensor", "batched") + (("compile", "batched-compile") if "compile" in hyper else ()) if engine else ()
    return Capability(name, engine, "ns_dtype" in hyper, "nesterov" in hyper, forms, meqmuon.rules_of(name), stated)


#: name -> capability, in the registry's order (a registered name without a row in ``STATED`` is left
#: out here and fails test_capabilities.py).
CAPABILITIES: dict[str, Capability] = {n: _capability(n, STATED[n]) for n in REGISTRY if n in STATED}

#: Every registered optimizer.
ALL: list[str] = list(REGISTRY)
#: The meqmuon optimizers (every name but torch's ``adamw``).
ENGINE: list[str] = [n for n, c in CAPABILITIES.items() if c.engine]
#: Those that orthogonalise with Newton-Schulz (take ``ns_dtype``).
NEWTON_SCHULZ: list[str] = [n for n, c in CAPABILITIES.items() if c.newton_schulz]


def _one_per_hidden_rule() -> list[str]:
    first: dict[str, str] = {}
    for n, c in CAPABILITIES.items():
        if c.newton_schulz:
            first.setdefault(c.rules["hidden"], n)
    return list(first.values())


#: The first Newton-Schulz optimizer of each distinct hidden rule: one per hidden update.
ONE_PER_HIDDEN_RULE: list[str] = _one_per_hidden_rule()
#: Optimizers with at least one of MeqMuon's rules (eq. 8-10).
MEQ_RULES = frozenset({"meq_hidden", "equilibrate", "rms_normalize"})
WITH_MEQ_RULES: list[str] = [n for n, c in CAPABILITIES.items() if MEQ_RULES & set(c.rules.values())]


#: Keyword arguments of each step form (``FORMS``); torch's AdamW has one form of its own, ``"torch"``.
FORM_KWARGS = {
    "per-tensor": {"foreach": False},
    "batched": {"foreach": True},
    "compile": {"foreach": False, "compile": True},
    "batched-compile": {"foreach": True, "compile": True},
    "torch": {},
}


def every_form() -> list[tuple[str, str]]:
    """Every ``(optimizer, form)`` pair of the table, in registry order; ``adamw`` as ``"torch"``."""
    return [(n, f) for n, c in CAPABILITIES.items() for f in (c.forms or ("torch",))]


def having(*forms: str, check: str | None = None) -> list[str]:
    """Names, in registry order, with every step form of ``forms`` and the check ``check`` (if given)."""
    return [n for n, c in CAPABILITIES.items()
            if set(forms) <= set(c.forms) and (check is None or check in c.stated.checks)]


def runs(*layouts: str) -> list[str]:
    """Run names of test_distributed.py and test_layouts.py for the given layouts, in registry order:
    ``name`` for a plain layout, ``name+compile`` for a ``-compile`` one, ``name+foreach`` for a
    ``-batched`` one, ``name+foreach+compile`` for a ``-batched-compile`` one."""
    out = []
    for n, c in CAPABILITIES.items():
        for layout in layouts:
            if layout in c.stated.distributed:
                suffix = "+foreach+compile" if layout.endswith("-batched-compile") else {
                    "compile": "+compile", "batched": "+foreach"}.get(layout.rpartition("-")[2], "")
                out.append(n + suffix)
    return out


def ddp_exchanges() -> dict[str, int]:
    """name -> exchanges per step of the ``ddp-batched`` test."""
    return {n: c.stated.ddp_exchanges for n, c in CAPABILITIES.items() if c.stated.ddp_exchanges is not None}


def reference_cases(*names: str) -> list:
    """The float64 reference test's cases for ``names``: ``(name, nesterov, form)`` for every step form of
    each, with and without Nesterov where it has the option, as ``pytest.param`` with id
    ``name-nesterov-form``. The compiled forms run with Nesterov only: a compiled case costs seconds
    (tracing), and Nesterov on/off is the eager momentum code, which the other forms cover."""
    out = []
    for n in names:
        c = CAPABILITIES[n]
        for form in c.forms or ("torch",):
            for nest in (True, False) if c.nesterov and "compile" not in form else (True,):
                out.append(pytest.param(n, nest, form, id=f"{n}-{nest}-{form}"))
    return out


def covered(cases: list) -> set[tuple[str, str]]:
    """The ``(optimizer, form)`` pairs of :func:`reference_cases` output."""
    return {(p.values[0], p.values[2]) for p in cases}
