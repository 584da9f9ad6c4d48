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


def optimizer_held_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of every tensor storage reachable from ``opt`` (its attributes, followed through dicts, lists,
    tuples and objects), by what holds them: ``"state"`` (reachable from ``opt.state``), ``"params"`` (the
    parameters and their gradients, which the model owns) and ``"other"`` (everything else the optimizer
    keeps: workspaces, whole copies, index maps). A storage counts once, whole (a view keeps all of it
    alive); a DTensor counts its local tensor. Process groups and device meshes are not followed.

    What issue 47 asks of a step: after it, ``other`` is metadata only (0 bytes of tensors).
    """
    params: set[int] = set()
    for group in opt.param_groups:
        for p in group["params"]:
            for t in (p, p.grad):
                if t is not None:
                    params.add(_storage(t)[0])
    state: dict[int, int] = {}
    _walk(opt.state, state, set())
    other: dict[int, int] = {}
    _walk({k: v for k, v in vars(opt).items() if k not in ("state", "param_groups")}, other, set())
    _walk(opt.param_groups, other, set())
    other = {k: v for k, v in other.items() if k not in state and k not in params}
    return {"state": sum(v for k, v in state.items() if k not in params), "other": sum(other.values()),
            "params": sum(_storage(p)[1] for g in opt.param_groups for p in g["params"])}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    local = getattr(t, "_local_tensor", None)
    t = local if local is not None else t
    s = t.untyped_storage()
    return (s.data_ptr() or id(s)), s.nbytes()


def _walk(obj: Any, out: dict[int, int], seen: set[int]) -> None:
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, str | int | float | bool | bytes | type):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type != "meta":
                key, n = _storage(o)
                out[key] = n
            if o.grad is not None if isinstance(o, torch.nn.Parameter) else False:
                stack.append(o.grad)
            continue
        name = type(o).__name__
        if name in ("DeviceMesh", "ProcessGroup") or callable(o) and not hasattr(o, "__dict__"):
            continue
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend(o)
        else:
            stack.extend(getattr(o, "__dict__", {}).values())
            for klass in type(o).__mro__:
                for slot in getattr(klass, "__slots__", ()):
                    stack.append(getattr(o, slot, None))
