"""Optimizer-state memory: measured from a live optimizer, or predicted from parameter shapes.

The paper's accounting (section 4, "Memory overhead"): with ``N_h`` elements in hidden matrices,
``N_a`` in all other parameters and ``R_h`` rows of hidden matrices, Muon stores ``N_h + 2 N_a``
values, NorMuon ``N_h + 2 N_a + R_h`` and MeqMuon ``N_h + N_a``. Scalar step counters are not
counted (they are bookkeeping, not per-element state, and the paper's Table 5 omits them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .driver import state_elements
from .rules import RULES
from .views import group_layout

MIB = 2**20


def optimizer_state_bytes(opt: torch.optim.Optimizer, *, include_counters: bool = False) -> int:
    """Bytes held by the optimizer's state tensors.

    Works for any ``torch.optim.Optimizer``. Counters (0-D tensors such as torch's step counts, and
    integer tensors such as MeqMuon's per-matrix selection counts) are excluded unless
    ``include_counters`` is set, matching the paper's accounting.
    """
    total = 0
    seen: set[int] = set()
    for state in opt.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            if (value.ndim == 0 or not value.is_floating_point()) and not include_counters:
                continue
            key = id(value)
            if key in seen:
                continue
            seen.add(key)
            total += value.numel() * value.element_size()
    return total


def predicted_state_elements(rules: Mapping[str, str], groups: Iterable[Mapping[str, Any]]) -> int:
    """State elements an optimizer with rule table ``rules`` (kind -> rule) keeps for ``groups``.

    ``groups`` are param groups with ``kind`` (e.g. from :func:`meqmuon.param_groups`, possibly on
    the meta device: only shapes are read). Each rule declares its own per-tensor count.
    """
    total = 0
    for g in groups:
        rule = RULES[rules[g["kind"]]]
        for i, p in enumerate(g["params"]):
            total += state_elements(rule, group_layout(g, i, p.shape))
    return total
