"""What the optimizers accept: parameters or param groups, each tensor once, and hyperparameters
as torch.optim takes them (any real number, or a 0-D CPU tensor), each checked with a one-line error."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn


def _a(what: str) -> str:
    return f"{'an' if what[:1].lower() in 'aeiou' else 'a'} {what}"


def wrong_params(params: Any) -> str | None:
    """What ``params`` is (e.g. "an nn.Module (Linear)") if it cannot be parameters or param groups, else ``None``.

    For the callers' one-line ``TypeError``: torch.optim fails on a module with "'Linear' object is not
    iterable" and treats a dict as an iterable of its keys.
    """
    if isinstance(params, nn.Module):
        return f"an nn.Module ({type(params).__name__})"
    if isinstance(params, torch.Tensor):
        return "a single tensor"
    if isinstance(params, Mapping):
        return f"{_a(type(params).__name__)} (one param group; put it in a list)"
    if isinstance(params, str | bytes) or not isinstance(params, Iterable):
        return _a(type(params).__name__)
    return None


def listed_params(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with ``params`` made a list in place (as torch.optim does), so that a generator is read once."""
    params = group.get("params")
    if params is not None and not isinstance(params, torch.Tensor | set | list):
        group["params"] = list(params)
    return group


def check_unique_params(groups: Iterable[Mapping[str, Any]]) -> None:
    """``ValueError`` naming the first tensor that appears twice, in one group or across two.

    torch.optim only warns for a repeat within a group and refuses one across groups without naming it;
    a repeated tensor would get two updates per step. Named by the group's ``names`` (or torch's
    ``(name, tensor)`` pairs), else as ``params[i] of group j``.
    """
    seen: dict[int, str] = {}
    for j, group in enumerate(groups):
        params = group.get("params", [])
        params = [params] if isinstance(params, torch.Tensor) else params
        names = group.get("names") or group.get("param_names")  # ours, or torch's from (name, tensor) pairs
        for i, p in enumerate(params):
            named = isinstance(p, tuple) and len(p) == 2
            tensor = p[1] if named else p
            if names is not None and i < len(names):
                label = repr(names[i])
            else:
                label = repr(p[0]) if named else f"params[{i}] of group {j}"
            if id(tensor) in seen:
                raise ValueError(f"parameter {label} appears twice in the param groups (first as {seen[id(tensor)]}); "
                                 "pass each tensor once")
            seen[id(tensor)] = label


def number(
    key: str,
    value: Any,
    *,
    low: float,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = False,
) -> float | torch.Tensor:
    """``value`` checked and in the form the group stores, as torch.optim takes hyperparameters.

    Any real number (``int``, numpy scalars, ...) becomes a Python ``float``: the step does Python
    arithmetic with it and the batched step keys calls by its ``repr``. A 0-D floating CPU tensor is kept
    (an LR scheduler fills it in place) and read with ``float()`` at each step (:func:`with_floats`),
    which for a CPU tensor is no host-device synchronisation; a CUDA tensor would be one per step, so it
    is refused. Bools, NaN and infinities are refused.
    """
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or not value.is_floating_point():
            raise ValueError(f"Invalid {key}: a tensor {key} must be 0-D and floating, got shape "
                             f"{tuple(value.shape)}, {value.dtype}")
        if value.device.type != "cpu":
            raise ValueError(f"Invalid {key}: a tensor on {value.device}; pass a Python float or a CPU tensor "
                             "(reading a device tensor at every step would synchronise the host with the device)")
        number = float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValueError(f"Invalid {key}: {value!r} (expected a finite number)")
    if not math.isfinite(number):
        raise ValueError(f"Invalid {key}: {value!r} (expected a finite number)")
    ok_low = number >= low if low_inclusive else number > low
    ok_high = True if high is None else (number <= high if high_inclusive else number < high)
    if not (ok_low and ok_high):
        lo = "[" if low_inclusive else "("
        hi = "]" if high_inclusive else ")"
        raise ValueError(
            f"Invalid {key}: {value!r} (expected a value in {lo}{low}, {'inf' if high is None else high}{hi})"
        )
    return value if isinstance(value, torch.Tensor) else number


#: The hyperparameters that may be 0-D CPU tensors (:func:`number`); ``betas`` holds two of them.
FLOAT_KEYS = ("lr", "weight_decay", "momentum", "rho", "beta2", "eps")


def with_floats(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` for one step: its 0-D tensor hyperparameters read as floats (a copy), or ``group`` itself.

    The group keeps the tensor, so what a scheduler wrote into it (``fill_``) is what the next step reads.
    """
    floats = {k: float(group[k]) for k in FLOAT_KEYS if isinstance(group.get(k), torch.Tensor)}
    betas = group.get("betas")
    if isinstance(betas, tuple | list) and any(isinstance(b, torch.Tensor) for b in betas):
        floats["betas"] = tuple(float(b) for b in betas)
    return {**group, **floats} if floats else group


def flag(key: str, value: Any) -> bool:
    """``value`` if it is a bool, else ``ValueError`` naming ``key``."""
    if not isinstance(value, bool):
        raise ValueError(f"Invalid {key}: {value!r} (expected True or False)")
    return value


def positive_int(key: str, value: Any) -> int:
    """``value`` if it is an integer >= 1 (not a bool), else ``ValueError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {key}: {value!r} (expected an integer >= 1)")
    return value


def float_dtype(key: str, value: Any) -> torch.dtype | None:
    """``value`` if it is ``None`` or a floating ``torch.dtype``, else ``ValueError`` naming ``key``."""
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"Invalid {key}: {value!r} (expected a floating torch.dtype or None)")
    return value


def validate_group(group: dict[str, Any], keys: Iterable[str]) -> None:
    """Check the engine's own hyperparameters ``keys`` of ``group`` (``lr``, ``weight_decay``, ``foreach``,
    ``state_dtype``); raise ``ValueError`` naming the bad one. Numbers are stored back in their checked form
    (:func:`number`). A rule's own keys are its own to check (``Rule.validate``, beside its maths).
    """
    for key in keys:
        if key in ("lr", "weight_decay"):
            group[key] = number(key, group[key], low=0.0)
        elif key == "foreach":
            v = group[key]
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"Invalid foreach: {v!r} (expected True, False or None)")
        elif key == "state_dtype":
            float_dtype(key, group[key])
        else:
            raise ValueError(f"validate_group: {key!r} is a rule's hyperparameter, checked by its rule")
