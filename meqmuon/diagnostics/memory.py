"""Optimizer-state memory, predicted from parameter shapes and measured after a real step (Tables 5 and 7).

Accounting (paper section 4, "Memory overhead"): with ``N_h`` elements in hidden matrices, ``N_a``
in all other parameters and ``R_h`` rows of hidden matrices,

    AdamW    2 (N_h + N_a)        Muon      N_h + 2 N_a        NorMuon   N_h + 2 N_a + R_h
    MeqMuon  N_h + N_a            ablations: Muon with one kind's AdamW moments replaced by momentum

state values. Each rule of :mod:`meqmuon.optim.rules` declares its per-tensor count
(:func:`meqmuon.predicted_state_elements`); bytes = elements x the state dtype's size, and MiB =
bytes / 2**20. Scalar step/selection counters are not counted (the paper's Table 5 omits them).
NorMuon keeps its ``R_h`` row second moments in float32 whatever the state dtype, which the byte
count below honours. SCALE is undefined for a tied embedding/LM head (the optimizer refuses it):
reported as ``None`` and printed ``--``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..optim import build_optimizer, optimizer_state_bytes, rules_of
from ..optim.driver import state_elements
from ..optim.memory import MIB
from ..optim.registry import MEMORY_NAMES, REGISTRY
from ..optim.rules import RULES
from ..optim.views import group_layout
from .tables import markdown_table

__all__ = [
    "predicted_state_bytes",
    "memory_mib",
    "memory_table",
    "measure_state_bytes",
    "measure_table",
    "label",
    "relative_saving",
]

# Rules whose state includes one float32 value per matrix row regardless of the state dtype.
_FP32_ROW_STATE = {"normuon_hidden"}


def label(name: str) -> str:
    """Display name of an optimizer in the paper's tables (the registry's label; unknown names as given)."""
    entry = REGISTRY.get(name)
    return entry.display if entry else name


def _supported(name: str, groups: Sequence[Mapping[str, Any]]) -> bool:
    """Whether optimizer ``name`` accepts these groups (SCALE refuses a tied embedding/head)."""
    try:
        build_optimizer(name, [dict(g) for g in groups])
    except ValueError:
        return False
    return True


def predicted_state_bytes(name: str, groups: Sequence[Mapping[str, Any]], state_bytes: int = 4) -> int | None:
    """Predicted optimizer-state bytes of optimizer ``name`` for param ``groups`` (shapes only).

    Args:
        name: a :func:`meqmuon.build_optimizer` name.
        groups: :func:`meqmuon.param_groups` output, typically of a meta-device model.
        state_bytes: bytes per state element (4 for float32 state, 2 for bf16).

    Returns:
        bytes, or ``None`` where the optimizer is undefined for the model (SCALE on tied weights).
    """
    if not _supported(name, groups):
        return None
    rules = rules_of(name)
    total = 0
    for g in groups:
        rule_name = rules[g["kind"]]
        rule = RULES[rule_name]
        for i, p in enumerate(g["params"]):
            layout = group_layout(g, i, p.shape)
            elements = state_elements(rule, layout)
            if rule_name in _FP32_ROW_STATE:
                rows = math.prod(layout.rows_shape)
                total += (elements - rows) * state_bytes + rows * max(state_bytes, 4)
            else:
                total += elements * state_bytes
    return total


def memory_mib(
    models: Mapping[str, Sequence[Mapping[str, Any]]],
    optimizers: Iterable[str] = MEMORY_NAMES,
    state_bytes: int = 4,
) -> dict[str, dict[str, float | None]]:
    """``{optimizer: {model: MiB or None}}`` for ``models`` given as name -> param groups."""
    return {
        opt: {
            m: (None if (b := predicted_state_bytes(opt, groups, state_bytes)) is None else b / MIB)
            for m, groups in models.items()
        }
        for opt in optimizers
    }


def memory_table(values: Mapping[str, Mapping[str, float | None]], digits: int = 2) -> str:
    """Table 5 layout: one row per optimizer, one column per model, MiB; ``--`` where undefined."""
    opts = list(values)
    models = list(next(iter(values.values()))) if opts else []
    body = []
    for opt in opts:
        cells = [label(opt)]
        for m in models:
            v = values[opt][m]
            cells.append("--" if v is None else f"{v:.{digits}f}")
        body.append(cells)
    return markdown_table(["Optimizer", *models], body)


def measure_state_bytes(
    make_model: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module], torch.Tensor],
    optimizers: Iterable[str] = MEMORY_NAMES,
    state_dtype: torch.dtype = torch.float32,
) -> list[dict[str, Any]]:
    """Take one real step per optimizer and compare measured state bytes with the prediction.

    ``make_model`` builds a fresh model (same architecture each call); ``loss_fn(model)`` returns a
    scalar loss to backpropagate. Optimizers without a ``state_dtype`` option (``torch.optim.AdamW``)
    get a model cast to ``state_dtype``, since their state follows the parameter dtype.

    Returns:
        rows ``{optimizer, predicted, measured}`` in bytes; both ``None`` where undefined.
    """
    from ..optim import param_groups, valid_hyperparameters

    rows = []
    for name in optimizers:
        model = make_model()
        hp: dict[str, Any] = {}
        if "state_dtype" in valid_hyperparameters(name):
            hp["state_dtype"] = state_dtype
        else:
            model = model.to(state_dtype)
        groups = param_groups(model)
        predicted = predicted_state_bytes(name, groups, torch.empty((), dtype=state_dtype).element_size())
        if predicted is None:
            rows.append({"optimizer": name, "predicted": None, "measured": None})
            continue
        opt = build_optimizer(name, groups, lr=1e-3, **hp)
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        measured = optimizer_state_bytes(opt)
        rows.append({"optimizer": name, "predicted": predicted, "measured": measured})
    return rows


def measure_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: predicted and measured state bytes (and MiB) per optimizer, with a match column."""
    body = []
    for r in rows:
        p, m = r["predicted"], r["measured"]
        if p is None:
            body.append([label(r["optimizer"]), "--", "--", "--", "--", "undefined"])
            continue
        ok = "yes" if p == m else f"no ({m - p:+d} B)"
        body.append([label(r["optimizer"]), f"{p:,}", f"{m:,}", f"{p / MIB:.3f}", f"{m / MIB:.3f}", ok])
    return markdown_table(
        ["Optimizer", "predicted (B)", "measured (B)", "predicted (MiB)", "measured (MiB)", "match"], body, "lrrrrl"
    )


def relative_saving(values: Mapping[str, Mapping[str, float | None]], model: str, a: str, b: str) -> float:
    """Fractional saving of optimizer ``a`` over ``b`` on ``model`` (e.g. 0.216 for MeqMuon vs Muon, Qwen2)."""
    va, vb = values[a][model], values[b][model]
    if va is None or vb is None:
        return math.nan
    return 1.0 - va / vb
