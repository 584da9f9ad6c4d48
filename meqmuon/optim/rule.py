"""What a rule is: the protocols an update rule implements, and nothing of how a step runs.

Three kinds of rule, each a class to subclass (the built-in ones are in ``rules/``):

- ``HiddenRule`` (in ``driver.py``, beside the Newton-Schulz seam that calls it, as torch's ``Adam``
  sits beside its step functions): a hidden-matrix rule, ``D = post(Orth(pre(X)))`` around the driver's
  Newton-Schulz; a researcher's variant overrides ``pre``, ``post`` (or ``post_all``), ``lr_scale``,
  declares ``state_views`` and ``defaults`` and checks them in ``validate``;
- :class:`MomentumRule`: an elementwise momentum rule (MeqMuon's eq. 9 and 10): a ``direction`` of a stack
  of direction inputs and a per-tensor ``update``;
- :class:`SteppingRule`: a rule that writes its own forms, per-tensor ``step`` and batched
  ``step_foreach`` (AdamW, SCALE), and its own state.

How a step runs (momentum, shape stacks, Newton-Schulz, the split over ranks, the update, compiled or
not) is the driver's (``driver.py``), a set of functions that read what a rule declares here. Every
rule owns its hyperparameters: their defaults (``defaults``, merged over the class hierarchy) and
their checks (``validate``, each class's own, base first), beside its maths, as optax's transforms do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from torch import Tensor

from .. import functional as F
from .calls import Item, StepContext
from .inputs import flag, number
from .views import Layout

__all__ = ["MOMENTUM", "RHO", "MomentumBase", "MomentumRule", "Rule", "SteppingRule", "rule_defaults", "validate_rule"]

#: The paper's momentum and RMS alignment (section 4: Nesterov momentum 0.95, rho = 0.2), the momentum
#: rules' defaults.
MOMENTUM = 0.95
RHO = 0.2


class Rule:
    """What every rule declares: its ``name``, its hyperparameters and their checks."""

    name: ClassVar[str]
    #: The rule's own hyperparameters and their defaults (optax's transforms own theirs the same way): every
    #: optimizer whose table holds the rule takes them as keywords (``Muon(groups, alpha=2.0)``) and as
    #: param-group keys, and fills them in where neither gives one. A subclass's add to its bases'.
    defaults: ClassVar[dict[str, Any]] = {}
    #: Every key the rule reads from its group: the ``defaults``' keys (added by ``__init_subclass__``) and
    #: any the optimizer supplies; the engine refuses a group that lacks one.
    hyperparameters: ClassVar[tuple[str, ...]] = ()

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


class SteppingRule(Rule):
    """A rule that writes its own forms and state (AdamW, SCALE): the driver calls :meth:`step`
    (``foreach=False``) or :meth:`step_foreach` (``foreach=True``) among the step's writes, once every momentum
    rule's direction exists (``commit.py``); ``compile=True`` leaves it eager."""

    #: The rule needs >=2-D tensors (matrix rules).
    needs_matrix: ClassVar[bool] = False
    #: Each element's update depends on that element alone (AdamW): the engine hands a vector rule
    #: a stack of vectors (view ``"vectors"``) whole, where any other vector rule gets each vector, and any
    #: DTensor layout steps its local piece.
    elementwise: ClassVar[bool] = False
    #: How each state tensor divides among a parameter's matrices (``views.py``; as the momentum rules'
    #: below): the keys a stacked or split parameter's matrices see as views of their own.
    state_views: ClassVar[dict[str, str]] = {}
    #: The rule's :meth:`step` and :meth:`step_foreach` read the step's skip flag, ``ctx.gate``, and write nothing on
    #: a skipped step (``driver.apply_update(..., gate=ctx.gate)``, ``commit.update_``, ``commit.lerp_``: SCALE's
    #: rules). Else (AdamW) the engine runs them on copies of the parameters and state, written back unless the step
    #: is skipped (``commit.stepping_``): the same kernels, so the same bits, and any rule's writes kept out of a
    #: skipped step.
    gates_itself: ClassVar[bool] = False

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


class MomentumBase(Rule):
    """What the momentum rules share: ``B <- mu B + G`` (paper eq. 6; Moonlight's convention), the direction
    input ``X = G + mu B`` with Nesterov (else ``B``), and the step ``W <- (1 - lr wd) W - lr s D``; the
    driver does all three. ``state_views`` names the state and how it divides among a parameter's matrices
    (``views.py``): ``"param"`` (shaped like the parameter), ``"rows"`` (one float per matrix row),
    ``"counter"`` (one int64 per matrix), ``"step"`` (the step count, read only)."""

    defaults = {"momentum": MOMENTUM, "nesterov": True, "rho": RHO}
    state_views: ClassVar[dict[str, str]] = {"momentum_buffer": "param"}
    #: The per-matrix state the direction changes (``"rows"``, ``"counter"`` views), which the owner rank
    #: sends with the parameter (DDP, FSDP2). Derived from ``state_views`` per class, not declared.
    _owner_state: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._owner_state = tuple(k for k, how in cls.state_views.items() if how in ("rows", "counter"))

    def validate(self, group: dict) -> None:
        """``momentum`` in [0, 1), ``nesterov`` a bool, ``rho`` > 0."""
        group["momentum"] = number("momentum", group["momentum"], low=0.0, high=1.0)
        flag("nesterov", group["nesterov"])
        group["rho"] = number("rho", group["rho"], low=0.0, low_inclusive=False)


class MomentumRule(MomentumBase):
    """An elementwise momentum rule: a :meth:`direction` of a stack of direction inputs (the batched and
    compiled forms) and a per-tensor :meth:`update` (MeqMuon's eq. 9 and 10, ``rules/meqmuon.py``)."""

    #: The rule needs >=2-D tensors (eq. 9 normalises rows and columns).
    needs_matrix: ClassVar[bool] = False
    #: Split the work over DDP ranks; False where repeating it is cheaper than sending it (vectors).
    split_work: ClassVar[bool] = True

    def direction(self, X: Tensor, group: dict, psum: F.PSum, shape: tuple[int, ...]) -> Tensor:
        """The direction of a stack ``X`` ``(K, *shape)`` of direction inputs (float32 or float64, scratch: may
        be the result), its step multiplier folded in (the step adds it with ``s = 1``); ``psum`` sums
        statistics over row shards (FSDP2), ``shape`` is one member's unsharded shape."""
        raise NotImplementedError

    def update(self, items: Sequence[Item], group: dict, ctx: StepContext) -> None:
        """The per-tensor form: the directions of ``items`` and their steps, called among the step's writes (the
        momentum already written, ``driver.direction_input`` reads it); its steps go through
        ``driver.apply_update(..., gate=ctx.gate)``, so that a skipped step writes nothing."""
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
