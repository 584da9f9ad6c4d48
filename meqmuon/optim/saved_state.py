"""Loading optimizer state as it was saved: every state tensor keeps its dtype and values.

``torch.optim.Optimizer.load_state_dict`` casts every floating parameter's state tensors, ``step`` aside,
to the parameter's dtype (``Optimizer._process_value_according_to_param_policy``). For this engine's state
that is a loss, not a convenience: an int64 counter (MeqMuon's ``rows_chosen``, a variant's own) came back
float32, rounded above 2**24 (bf16: above 256, so (257, 43) -> (256, 44)); float32 state kept on a bf16
model (NorMuon's per-row second moment, momentum under ``state_dtype=torch.float32``) came back bf16, and
the resumed run departed from the uninterrupted one. Casting back afterwards cannot undo the rounding, so
the cast is skipped: each tensor moves to its parameter's device only, and ``step`` keeps torch's policy.

torch calls the policy as ``Optimizer._process_value_according_to_param_policy`` (the base class by name),
so a subclass cannot override it; its public load hooks can. :func:`keeping_saved_dtypes` installs two
around one ``load_state_dict``: the last pre-hook (after the user's, which see the state as saved) wraps
each state tensor in a :class:`_Kept`, which torch's cast passes through untouched (it is neither a tensor,
nor a dict, nor iterable); the first post-hook (before the user's, which see the state as loaded) unwraps it
onto the parameter's device. DTensor state (FSDP2, ``torch.distributed.checkpoint``'s ``set_state_dict``)
moves the same way, its placements unchanged.

Param-group values that are dtypes (``ns_dtype``, ``state_dtype``, a variant's own) are saved as
their names, ``"torch.float32"`` (:func:`dtypes_named`), and read back as dtypes: torch's state-dict utilities
take tensors, numbers, strings, bytes, lists, dicts and ``None`` only (``_state_dict_utils._iterate_state_dict``,
which ``get_optimizer_state_dict`` runs with ``cpu_offload`` or ``full_state_dict``, as Lightning's
``ModelParallelStrategy`` does for every checkpoint) and raised ``Unexpected value type <class 'torch.dtype'>``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["dtypes_named", "keeping_saved_dtypes"]


class _Kept:
    """A saved state tensor on its way through torch's ``load_state_dict``, uncast."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _wrap(value: Any, key: Any = None) -> Any:
    """``value`` with every tensor but ``step`` wrapped (in dicts, lists and tuples, as torch's cast recurses)."""
    if isinstance(value, torch.Tensor):
        return value if key == "step" else _Kept(value)
    if isinstance(value, dict):
        return {k: _wrap(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_wrap(v) for v in value)
    return value


def _unwrap(value: Any, device: torch.device | None) -> Any:
    """``value`` with every wrapped tensor back, moved to ``device`` (``None``: where it is)."""
    if isinstance(value, _Kept):
        return value.tensor if device is None else value.tensor.to(device=device)
    if isinstance(value, dict):
        return {k: _unwrap(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, device) for v in value)
    return value


def _dtype_name(value: Any) -> Any:
    return str(value) if isinstance(value, torch.dtype) else value


def _named_dtype(value: Any) -> Any:
    """``"torch.float32"`` -> ``torch.float32``; anything else as it is."""
    if isinstance(value, str) and value.startswith("torch."):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return value


def dtypes_named(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (an optimizer's) with every ``torch.dtype`` value of its param groups written as its name."""
    groups = [{k: _dtype_name(v) for k, v in g.items()} for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def _hold(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Pre-hook: the state dict (torch's shallow copy) with its per-parameter state wrapped and its param
    groups' dtype names read back as dtypes."""
    groups = [{k: _named_dtype(v) for k, v in g.items()} for g in state_dict["param_groups"]]
    return {**state_dict, "state": {k: _wrap(v) for k, v in state_dict["state"].items()}, "param_groups": groups}


def _place(optimizer: Optimizer) -> None:
    """Post-hook: each parameter's state unwrapped onto the parameter's device (state torch keeps under
    keys that are not parameters stays where it is, as torch leaves it)."""
    for p, st in optimizer.state.items():
        optimizer.state[p] = _unwrap(st, p.device if isinstance(p, torch.Tensor) else None)


@contextmanager
def keeping_saved_dtypes(optimizer: Optimizer) -> Iterator[None]:
    """Within it, ``optimizer.load_state_dict`` loads every state tensor in its saved dtype and values."""
    handles = (optimizer.register_load_state_dict_pre_hook(_hold),
               optimizer.register_load_state_dict_post_hook(_place, prepend=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
