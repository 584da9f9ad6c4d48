"""What every update rule is handed and what it must say about itself: ``Item``, ``StepContext``, ``Rule``.

A rule (``rules/``) receives all parameters of its kind in one param group at once, as items; the
momentum rules run through the one driver (``driver.py``), the Adam-type and SCALE rules write their
two forms themselves (``rules/adam.py``, ``rules/scale.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .distributed import LocalSplit
from .views import Layout

__all__ = ["ELEMENTWISE_COST", "Item", "Rule", "StepContext", "rule_defaults", "state_dtype", "validate_rule"]


class StepContext:
    """Per-call extras the engine hands to rules, made once per call and kept between steps.

    ``capture`` is the opt-in diagnostics hook: momentum rules call it as ``capture(name, kind,
    "momentum_input", x)`` with the direction input (the pre-Newton-Schulz matrix for hidden weights),
    Adam/SCALE rules with ``"gradient"`` and the raw gradient. ``None``: no call, no cost.
    """

    __slots__ = ("capture", "kind", "split", "compile", "workspace", "call", "inputs")

    def __init__(self, capture: Callable[[str, str, str, Tensor], None] | None = None, kind: str = "",
                 split: LocalSplit | None = None, compile: bool = False, workspace: dict | None = None,
                 call: int = 0) -> None:
        self.capture = capture
        self.kind = kind
        #: Work splitter (``distributed.py``): who computes which matrix, sums over shards.
        self.split = split if split is not None else LocalSplit()
        #: Run the compiled forms (``compile=True``).
        self.compile = compile
        #: Tensors kept between steps (the batched step's stacks, the resolved Newton-Schulz dtypes);
        #: owned by the optimizer, never part of its state_dict.
        self.workspace = workspace if workspace is not None else {}
        #: This call's position among the step's batched calls: its input stacks are its own.
        self.call = call
        #: The batched step's direction inputs, by item id, until they are stacked (``driver.stack_inputs``).
        self.inputs: dict[int, Tensor] = {}

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

    __slots__ = ("param", "grad", "state", "name", "shape", "kind")

    def __init__(self, param: Tensor, grad: Tensor | None, state: dict[str, Any], name: str,
                 shape: torch.Size | None = None, kind: str = "") -> None:
        self.param = param
        self.grad = grad
        self.state = state
        self.name = name
        self.shape = param.shape if shape is None else shape
        self.kind = kind


def state_dtype(p: Tensor, group: dict) -> torch.dtype:
    """The dtype of a parameter's state tensors: the group's ``state_dtype``, else the parameter's."""
    return group.get("state_dtype") or p.dtype


#: Cost of an elementwise update, in matmul-FLOP equivalents per element, for balancing DDP owners
#: (``MomentumRule.cost``): on CPU, the row-blocked equilibration of a 32000 x 512 matrix took as long
#: as 1000 Newton-Schulz FLOPs per element at the bf16 matmul rate. A heuristic: results never depend on it.
ELEMENTWISE_COST = 1000.0


class Rule:
    """Base class. Subclasses set ``name``, the state they keep, and implement ``step`` and ``step_foreach``."""

    name: ClassVar[str]
    #: The rule needs >=2-D tensors (matrix rules).
    needs_matrix: ClassVar[bool] = False
    #: The rule's own hyperparameters and their defaults (optax's transforms own theirs the same way): every
    #: optimizer whose table holds the rule takes them as keywords (``Muon(groups, alpha=2.0)``) and as
    #: param-group keys, and fills them in where neither gives one. A subclass's add to its bases'.
    defaults: ClassVar[dict[str, Any]] = {}
    #: Every key the rule reads from its group: the ``defaults``' keys (added by ``__init_subclass__``) and
    #: any the optimizer supplies; the engine refuses a group that lacks one.
    hyperparameters: ClassVar[tuple[str, ...]] = ()
    #: ``compile=True`` runs a compiled form of this rule (the momentum rules: ``driver.py``); AdamW and
    #: SCALE have none yet and run eagerly (the optimizer says so when built).
    compiles: ClassVar[bool] = False
    #: Each element's update depends on that element alone (AdamW): the engine hands a vector rule
    #: a stack of vectors (view ``"vectors"``) whole, where any other vector rule gets each vector.
    elementwise: ClassVar[bool] = False
    #: How each state tensor divides among a parameter's matrices (``views.py``): ``"param"`` (shaped
    #: like the parameter), ``"rows"`` (one value per matrix row), ``"counter"`` (one per matrix),
    #: ``"step"`` (the step count, read only).
    state_views: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        merged: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            merged.update(vars(klass).get("defaults", {}))
        cls.defaults = merged
        cls.hyperparameters = tuple(dict.fromkeys((*cls.hyperparameters, *merged)))

    def validate(self, group: dict) -> None:
        """Check this rule's hyperparameters in ``group`` (all of them present); raise ``ValueError`` showing
        the bad value. Called when the optimizer is built and at ``add_param_group``, for every param group
        that holds a parameter of this rule, after the engine's own checks; each class's ``validate`` in
        the rule's hierarchy runs, base first, so a subclass checks only its own keys (no ``super()``).
        A check may store a value back in its checked form (``group[key] = ...``)."""

    def state_elements(self, layout: Layout) -> int:
        """Number of state elements (excluding scalar counters) kept for a parameter of ``layout``."""
        raise NotImplementedError

    def init_state(self, p: Tensor, state: dict[str, Any], group: dict, layout: Layout) -> None:
        """Create the state of parameter ``p``; ``state["step"]`` is counted by the engine."""
        raise NotImplementedError

    def step(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        """The per-tensor form (``foreach=False``)."""
        raise NotImplementedError

    def step_foreach(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        """The batched form (``foreach=True``): the same maths over shape buckets."""
        raise NotImplementedError



def validate_rule(rule: Rule, group: dict) -> None:
    """Check ``group`` for ``rule``: every key the rule reads is present (``ValueError`` naming the missing
    ones), then every ``validate`` of the rule's class hierarchy, base first (:meth:`Rule.validate`)."""
    missing = [k for k in rule.hyperparameters if k not in group]
    if missing:
        raise ValueError(f"rule {rule.name!r} reads hyperparameter(s) {missing}, which this param group lacks; "
                         f"declare them in the rule's defaults, or pass them as optimizer keywords or group keys")
    for klass in reversed(type(rule).__mro__):
        check = vars(klass).get("validate")
        if check is not None:
            check(rule, group)


def rule_defaults(rules: Iterable[Rule], given: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults that ``rules`` declare (:attr:`Rule.defaults`) for the keys ``given`` does not hold (the
    optimizer's own defaults and keywords); ``ValueError`` where two rules declare different ones."""
    out: dict[str, tuple[Any, str]] = {}
    for rule in rules:
        for key, value in rule.defaults.items():
            if key in given:
                continue
            if key in out and not _same(out[key][0], value):
                raise ValueError(f"rules {out[key][1]!r} and {rule.name!r} declare different defaults for {key!r} "
                                 f"({out[key][0]!r} and {value!r}); pass {key}=... to the optimizer")
            out.setdefault(key, (value, rule.name))
    return {k: v for k, (v, _) in out.items()}


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements, say
        return a is b
