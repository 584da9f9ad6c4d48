"""Optimizer-state memory: measured from a live optimizer, or predicted from parameter shapes.

The paper's accounting (section 4, "Memory overhead"): with ``N_h`` elements in hidden matrices,
``N_a`` in all other parameters and ``R_h`` rows of hidden matrices, Muon stores ``N_h + 2 N_a``
values, NorMuon ``N_h + 2 N_a + R_h`` and MeqMuon ``N_h + N_a``. Scalar step counters are not
counted (they are bookkeeping, not per-element state, and the paper's Table 5 omits them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
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
    """Bytes of every tensor storage reachable from ``opt`` (:func:`held_tensors`), by what holds them:
    ``"state"`` (reachable from ``opt.state``), ``"other"`` (everything else the optimizer keeps: workspaces,
    whole copies, index maps) and ``"params"`` (the bytes of the parameters' storages, which the model owns;
    their gradients are not counted anywhere). A storage counts once, whole (a view keeps all of it alive); a
    DTensor counts its local tensor.

    What issue 47 asks of a step: after it, ``other`` is metadata only (0 bytes of tensors).
    """
    held = {"state": 0, "other": 0}
    for t, kind in held_tensors(opt):
        if kind != "params":
            held[kind] += t.untyped_storage().nbytes()
    held["params"] = sum(_local(p).untyped_storage().nbytes() for g in opt.param_groups for p in g["params"])
    return held


def storage_key(t: torch.Tensor) -> int:
    """One key per storage (its ``StorageImpl``): views share it; ``meta`` storages have one too."""
    return t.untyped_storage()._cdata


def held_tensors(opt: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, str]]:
    """Every tensor storage reachable from ``opt`` once, as ``(tensor, kind)``: ``kind`` is ``"params"`` for the
    storages of the parameters and their gradients (the model's), ``"state"`` for the rest of what
    ``opt.state`` reaches, ``"other"`` for the rest of what ``opt`` reaches (its ``__dict__``, containers and
    slots). DTensors are followed to their local tensors; objects of ``torch`` itself (process groups, device
    meshes, modules) are not entered, but for optimizers; classes are not entered. Any device, ``meta``
    included (its storages have sizes). The one walk of :func:`optimizer_held_bytes` and of the benchmarks'
    ``step_accounting.held_bytes``."""
    params = {storage_key(_local(t)) for g in opt.param_groups for p in g["params"] for t in (p, p.grad)
              if t is not None}
    seen: dict[int, Any] = {}  # shared by both walks: what the state reaches is the state's
    found: set[int] = set()
    for root, kind in ((opt.state, "state"), (opt, "other")):
        for t in _reachable(root, seen):
            key = storage_key(t)
            if key not in found:
                found.add(key)
                yield t, "params" if key in params else kind


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the object it keeps, not a new alias), else ``t``."""
    return getattr(t, "_local_tensor", t)


#: Leaves of the walk that hold no tensor.
_ATOMS = (str, bytes, int, float, complex, type(None), type, torch.dtype, torch.device)


def _reachable(root: Any, seen: dict[int, Any]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``root`` and not in ``seen`` (ids of the objects visited, kept with them so
    that no id is reused while the walk runs; updated), through ``__dict__``, ``__slots__``, dicts, lists,
    tuples and sets; DTensors as their local tensors."""
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        if isinstance(obj, torch.Tensor):
            local = _local(obj)
            if local is obj:
                yield obj
            else:
                stack.append(local)
        elif isinstance(obj, _ATOMS):
            continue
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif type(obj).__module__.startswith("torch") and not isinstance(obj, torch.optim.Optimizer):
            continue
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if isinstance(slot, str) and hasattr(obj, slot):
                        stack.append(getattr(obj, slot))
