"""What a rule call is handed: the matrices (:class:`Item`) and the step's extras (:class:`StepContext`).

A rule (``rule.py``) receives all parameters of its kind in one param group at once, as items, with
one context per call; the engine (``engine.py``) makes both, the driver (``driver.py``) runs the calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from .distributed import LocalSplit

__all__ = ["Item", "Path", "StepContext", "state_dtype"]


class Path(Enum):
    """Where a parameter steps, decided once per parameter by ``placement.path_of``; ``placement.EXECUTORS`` says
    what runs each (the table is there)."""

    LOCAL = "local"
    ROWS = "rows"
    OWNERS = "owners"


class StepContext:
    """Per-call extras the engine hands to rules, made once per call and kept between steps.

    ``capture`` is the opt-in diagnostics hook: momentum rules call it as ``capture(name, kind,
    "momentum_input", x)`` with the direction input (the pre-Newton-Schulz matrix for hidden weights),
    Adam/SCALE rules with ``"gradient"`` and the raw gradient. ``None``: no call, no cost.
    """

    __slots__ = ("capture", "kind", "split", "workspace", "call", "path", "commit", "gate")

    def __init__(self, capture: Callable[[str, str, str, Tensor], None] | None = None, kind: str = "",
                 split: LocalSplit | None = None, workspace: dict | None = None,
                 call: int = 0, path: Path = Path.LOCAL) -> None:
        self.capture = capture
        self.kind = kind
        #: Work splitter (``distributed.py``): who computes which matrix, sums over shards.
        self.split = split if split is not None else LocalSplit()
        #: Tensors kept between steps (the batched step's stacks, the resolved Newton-Schulz dtypes);
        #: owned by the optimizer, never part of its state_dict.
        self.workspace = workspace if workspace is not None else {}
        #: This call's position among the step's batched calls: its input stacks are its own.
        self.call = call
        #: The path of this call's parameters (``placement.py``).
        self.path = path
        #: The step's writes (``commit.Commit``): a form queues them there while it computes, the engine makes them.
        self.commit: Any = None
        #: While a write runs, the step's skip flag (``commit.Gate``, or ``None``): the writes of an elementwise
        #: rule's per-tensor ``update`` read it (``driver.apply_update(..., gate=ctx.gate)``).
        self.gate: Any = None

    def keep(self, error: Exception) -> None:
        """An error inside this rank's part of a step's first phase under ``torch.distributed``: kept on the step's
        commit (which skips the step on every rank and raises it afterwards), so that this rank still takes part in
        every collective of the step, with placeholder results; raised at once where the step is not tolerant."""
        if not self.commit.tolerant:
            raise error
        self.commit.fail(error)

    def emit(self, items: Sequence[Item], tensors: Sequence[Tensor], what: str) -> None:
        if self.capture is not None:
            for it, x in zip(items, tensors, strict=True):
                self.capture(it.name, it.kind or self.kind, what, x)


class Item:
    """One matrix (or tensor) in a rule call: the tensor, its gradient, its state, its name, its global shape.

    Tensors are local: under FSDP2 ``param``, ``grad`` and the tensors of ``state`` are this rank's row
    shards (sharing storage with the DTensors) and ``shape`` is the full shape; for a matrix of a
    stacked or split view (``views.py``) they are views of the parameter's and of its state's.
    """

    __slots__ = ("param", "grad", "state", "name", "shape", "kind", "index")

    def __init__(self, param: Tensor, grad: Tensor | None, state: dict[str, Any], name: str,
                 shape: torch.Size | None = None, kind: str = "", index: int = -1) -> None:
        self.param = param
        self.grad = grad
        self.state = state
        self.name = name
        self.shape = param.shape if shape is None else shape
        self.kind = kind
        #: Under ``placement.OWNERS``, the exchange's unit this item is (``exchange.Exchange.units``).
        self.index = index


def state_dtype(p: Tensor, group: dict) -> torch.dtype:
    """The dtype of a parameter's state tensors: the group's ``state_dtype``, else the parameter's."""
    return group.get("state_dtype") or p.dtype
