"""The one optimizer engine: a ``torch.optim.Optimizer`` that dispatches each parameter to a rule by kind.

Every public optimizer (MeqMuon, Muon, NorMuon, Scale and the ablations) is this engine with a
table ``RULES: kind -> rule name`` and its own defaults. Because all parameters live in param
groups of one ``torch.optim.Optimizer``, LR schedulers, ``state_dict``/``load_state_dict``, HF
``Trainer(optimizers=...)`` and ``torch.compile`` of the training step work unchanged.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from . import commit, decision, driver
from .calls import Item, StepContext
from .commit import SKIPPED, Commit
from .cuda_graph import GraphedStep
from .decision import NONFINITE
from .distributed import LocalSplit, is_dtensor, local, resolve_process_group
from .driver import HiddenRule
from .entry import Entry, held_rows
from .exchange import DEPTHS, Exchange
from .groups import KINDS, infer_kind
from .inputs import FLOAT_KEYS, check_unique_params, listed_params, validate_group, with_floats, wrong_params
from .placement import EXECUTORS, Path, path_of, splitter
from .rule import MomentumRule, Rule, SteppingRule, rule_defaults, validate_rule
from .rules import RULES
from .saved_state import dtypes_named, keeping_saved_dtypes
from .shared_ns import unit_prices, unit_shapes
from .views import group_layout, normalise_group_views

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised here that names the first caller outside the package
    (presets and ``build_optimizer`` add frames of their own)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


class RoleOptimizer(Optimizer):
    """Base engine. Subclasses define ``RULES`` (kind -> rule name) and call ``__init__`` with defaults.

    Param groups may carry ``kind`` (one of hidden, embedding, head, vector; see
    :func:`meqmuon.param_groups`) and ``names``. A group without ``kind`` gets one inferred per
    tensor from its shape (>=2-D: hidden, else vector), with a warning, because embeddings and
    heads cannot be recognised from shape. A tensor given twice is an error (torch.optim only warns), and
    float hyperparameters take any real number or a 0-D CPU tensor, as torch.optim does (:mod:`.inputs`).

    Distributed (see ``placement.py`` and ``exchange.py``): with ``torch.distributed`` initialised, rules
    without Newton-Schulz run in place on every rank's copy or shard, and each hidden matrix's Newton-Schulz
    runs once, at one owner rank of ``process_group`` (default: the default group; under DDP the gradients
    already all-reduced), which sends its direction back; with DTensor parameters (FSDP2, TP) the pieces
    follow their mesh. The process group is an attribute, not a param-group entry, so
    ``state_dict()`` is the same as single-process and loads into any world size.

    ``cuda_graph=True`` (every optimizer takes it): the batched step, eager or ``compile=True``, captured in a
    CUDA graph after one eager step and replayed, with ``lr``, ``weight_decay``, ``momentum`` and AdamW's bias
    corrections read from device tensors that each step refreshes (``cuda_graph.py``: what it keeps static,
    what re-captures, what it refuses).

    ``overlap`` (every optimizer takes it): under ``torch.distributed``, the exchange's shape buckets pipelined two
    deep, the next bucket's inputs and the previous bucket's directions travelling while owners run this bucket's
    Newton-Schulz (asynchronous collectives; transient memory two buckets' whole matrices instead of one);
    ``"all"``: every bucket's inputs posted at once, so that every owner works as soon as its own arrive (transient
    memory: every matrix a rank owns, whole). The same bits every way. ``None`` (default): ``True`` where the
    parameters are on CUDA, ``False`` elsewhere.

    ``ns_group`` (every optimizer takes it; default 1, off): under ``torch.distributed``, blocks of this many
    consecutive ranks (a node's GPUs), or a size dividing it, may share one unit's Newton-Schulz where the plan
    predicts it shortens the step (``shared_ns.py``: a stack by matrices, a large matrix by columns, exact to rounding),
    and whole local matrices that a block holds alike (experts repeated over ``tp``) are shared by it in the batched
    form (``shared_ns.ReplicaShare``), not orthogonalised by every member.
    ``relay_group`` (default 1, off): the exchange relayed through the receiving node of this many consecutive
    ranks, so that an owner's bytes cross all its node's network links (``relay.py``; the same bytes, bit for bit).
    ``exchange_unit`` (every optimizer takes it): the exchange's unit of a DTensor stack that no placement splits
    along its matrices (torchtitan's experts on their dimension 1): ``"matrix"`` (default), each matrix to an owner
    of its own (``placement.by_matrix``): the bytes at their floor and the Newton-Schulz spread, a stretch of alike
    matrices moved and applied as one stack (``assembly.py``); ``"tensor"``, the stack to one owner
    (docs/benchmarks.md: DeepSeek-V3 on 1,024 ranks 4x faster on the device, for 1.2x the stack's kernels). The
    same bits either way.
    """

    RULES: ClassVar[dict[str, str]] = {}
    #: ``torch.amp.GradScaler`` hands ``step()`` its scale and ``found_inf`` instead of unscaling and checking the
    #: gradients itself with a host sync: the step unscales them in its own check kernel (:meth:`step`).
    _step_supports_amp_scaling: ClassVar[bool] = True

    def __init__(self, params: Any, defaults: dict[str, Any], process_group: Any = None, compile: bool = False,
                 rules: dict[str, Rule] | None = None, cuda_graph: bool = False, overlap: bool | None = None,
                 nonfinite: str = "skip", ns_group: int = 1, relay_group: int = 1, exchange_unit: str = "matrix",
                 **hyperparameters: Any) -> None:
        if (what := wrong_params(params)) is not None:
            cls = type(self).__name__
            raise TypeError(f"{cls}(params=...) takes parameters or param groups, e.g. "
                            f"{cls}(meqmuon.param_groups(model)); got {what}")
        if not isinstance(compile, bool):
            raise ValueError(f"Invalid compile: {compile!r} (expected True or False)")
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"Invalid cuda_graph: {cuda_graph!r} (expected True or False)")
        if nonfinite not in NONFINITE:
            raise ValueError(f"Invalid nonfinite: {nonfinite!r} (expected one of {', '.join(map(repr, NONFINITE))})")
        #: What a step does with a non-finite gradient (:data:`NONFINITE`, docs/algorithm.md).
        self._nonfinite = nonfinite
        if overlap is not None and not isinstance(overlap, bool) and overlap != "all":
            raise ValueError(f"Invalid overlap: {overlap!r} (expected True, False, 'all' or None)")
        for key, g in (("ns_group", ns_group), ("relay_group", relay_group)):
            if isinstance(g, bool) or not isinstance(g, int) or g < 1 or (g > 1 and compile):
                raise ValueError(f"Invalid {key}: {g!r} (expected an integer >= 1; not built for compile=True)")
        if exchange_unit not in ("tensor", "matrix"):
            raise ValueError(f"Invalid exchange_unit: {exchange_unit!r} (expected 'tensor' or 'matrix')")
        self._compile, self._ns_group, self._relay_group = compile, ns_group, relay_group
        #: ``exchange_unit == "matrix"``: a DTensor stack's exchange units are its matrices (``placement.by_matrix``).
        self._by_matrix = exchange_unit == "matrix"
        #: ``overlap``: the exchange's buckets in flight (``exchange.DEPTHS``); ``None``: on CUDA (docs/algorithm.md).
        self._overlap = overlap
        #: ``cuda_graph=True``: the step captured in a CUDA graph and replayed (``cuda_graph.py``).
        self._graphed = GraphedStep() if cuda_graph else None
        self._rules = self._rule_table(rules)
        # The rules' own hyperparameters (Rule.defaults): keywords for them, their defaults where neither the
        # class nor a keyword gives one. Any other keyword is refused as Python refuses it.
        own = {k for rule in self._rules.values() for k in rule.defaults}
        for key in hyperparameters:
            if key not in own:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {key!r} (its rules' own "
                                f"hyperparameters: {', '.join(sorted(own - set(defaults))) or 'none'})")
        defaults = {**rule_defaults(self._rules.values(), {**defaults, **hyperparameters}), **defaults,
                    **hyperparameters}
        eager: dict[str, list[str]] = {}
        for kind, rule in self._rules.items():
            if not driver.compiles(rule):
                eager.setdefault(rule.name, []).append(kind)
        if compile and eager:
            warnings.warn(f"{type(self).__name__}(compile=True) compiles the momentum rules; rules without a compiled "
                          "form run eagerly: " + "; ".join(f"{r!r} ({', '.join(k)})" for r, k in eager.items()),
                          UserWarning, stacklevel=3)
        self._warned_inferred = self._warned_traced = False
        self._capture_hook: Callable[[str, str, str, torch.Tensor], None] | None = None
        self._process_group = resolve_process_group(process_group)
        #: The batched step's persistent buffers (see ``step.workspace``); not optimizer state.
        self._workspace: dict = {}
        self._init_step_cache()
        super().__init__(params, defaults)
        self._warn_if_no_matrix()

    # ---- pickling and deepcopy -------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, param groups) plus this engine's settings (torch's keeps only its own
        three entries: a ``copy.deepcopy``-ed or unpickled optimizer lost ``compile`` and failed at its first step).
        The process group is not carried (it cannot be pickled): the copy uses the default group, and an optimizer
        built with an explicit ``process_group`` refuses to be copied rather than silently step on another group.
        The capture hook is dropped, like torch's optimizer hooks."""
        if self._process_group is not None and self._process_group is not resolve_process_group(None):
            raise RuntimeError(
                f"{type(self).__name__} was built with an explicit process_group, which cannot be pickled or "
                "copied; build a new optimizer with that group and load_state_dict() this one's state_dict()"
            )
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in ("_compile", "_overlap", "_ns_group",
                "_relay_group", "_warned_inferred", "_rules", "_nonfinite", "_by_matrix")},
                "_graphed": None if self._graphed is None else GraphedStep()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy's settings (:meth:`__getstate__`), or, from ``load_state_dict``, new state and param
        groups for this optimizer, which keeps its settings and hook and prepares its next step anew."""
        super().__setstate__(state)
        for key, value in (("_compile", False), ("_overlap", None), ("_warned_inferred", False),
                           ("_warned_traced", False), ("_capture_hook", None), ("_workspace", {}), ("_graphed", None),
                           ("_nonfinite", "skip"), ("_ns_group", 1), ("_relay_group", 1), ("_by_matrix", False)):
            self.__dict__.setdefault(key, value)
        self.__dict__.setdefault("_rules", self._rule_table(None))
        self.__dict__.setdefault("_process_group", resolve_process_group(None))
        self._init_step_cache()

    def _init_step_cache(self) -> None:
        """The step's kept objects: the plan of the param groups (:meth:`_plan`), the rule calls' contexts
        and the single process's splitter; none of it is state."""
        self._plan_key: tuple | None = None
        self._plan_cache: list = []
        self._gate_constants: dict = {}  # the skip flag's 0-D constants, kept across steps (commit.constant)
        #: The plan's splitters: the exchange of ``OWNERS`` (``None`` without one), the ``RowSums`` of ``ROWS`` by
        #: mesh and placements, and ``LOCAL``'s.
        self._exchange: Exchange | None = None
        self._rows: dict[tuple, LocalSplit] = {}
        self._local = LocalSplit()
        self._last_workspace = 0
        self._released = True
        self._contexts: list[StepContext] = []

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict`` with the param groups' dtypes (``ns_dtype``, ``state_dtype``) as their names,
        which torch.distributed.checkpoint's state-dict utilities take (``saved_state.py``)."""
        return dtypes_named(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` without its cast of state to the parameter's dtype: every state
        tensor keeps its saved dtype and values, moved to its parameter's device, and the groups' dtype
        names are dtypes again (``saved_state.py``)."""
        with keeping_saved_dtypes(self):
            super().load_state_dict(state_dict)

    def set_capture_hook(self, hook: Callable[[str, str, str, torch.Tensor], None] | None) -> None:
        """Install (or, with ``None``, remove) an opt-in diagnostics hook called during ``step()``.

        The hook is called as ``hook(name, kind, what, tensor)`` for every parameter updated:
        ``what == "momentum_input"`` with the direction input of momentum rules (for hidden
        weights, the matrix that enters Newton-Schulz), or ``"gradient"`` with the raw gradient for
        Adam-type and SCALE rules. The tensor is the optimizer's own buffer: copy what you keep.
        Off by default; when off, nothing is called and nothing is copied.
        """
        self._capture_hook = hook

    # ---- construction and validation -------------------------------------------------------

    def _rule_table(self, rules: dict[str, Rule] | None) -> dict[str, Rule]:
        """kind -> rule: the class's ``RULES``, with ``rules`` (kind -> a :class:`Rule` instance, such as a
        :class:`meqmuon.HiddenRule` subclass's) replacing the rule of each kind it names."""
        table = {kind: RULES[name] for kind, name in self.RULES.items()}
        for kind, rule in (rules or {}).items():
            if kind not in KINDS:
                raise ValueError(f"Invalid rules key: {kind!r} (expected one of {KINDS})")
            if not isinstance(rule, HiddenRule | MomentumRule | SteppingRule):
                raise TypeError(f"rules[{kind!r}] must be a rule instance, e.g. a meqmuon.HiddenRule subclass's "
                                f"MyVariant() (or a MomentumRule's or SteppingRule's, meqmuon.optim.rule); "
                                f"got {rule!r}")
            if not getattr(rule, "name", None):
                raise TypeError(f"rules[{kind!r}]: {type(rule).__name__} must set a class attribute 'name'")
            table[kind] = rule
        return table

    def _warn_if_no_matrix(self) -> None:
        """A ``UserWarning`` when this optimizer orthogonalises some kind but no parameter is of that kind.

        DeepSpeed ZeRO hands optimizers flat 1-D partitions: a Muon there routes every tensor to its vector
        rule and silently runs as AdamW (deepspeedai/DeepSpeed#8438, #8441). A warning and not an error:
        an optimizer over 1-D parameters alone is legitimate where its matrices come later
        (``add_param_group``) or live elsewhere (torchtitan builds one optimizer per pipeline stage, and a
        last stage may hold only the final norm and the head).
        """
        ns = sorted(k for k, r in self._rules.items() if isinstance(r, HiddenRule))
        if not ns:
            return  # no Newton-Schulz to miss (SCALE)
        seen: dict[str, list[tuple[int, ...]]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                kind = group.get("kind") or infer_kind(p)
                if kind in ns:
                    return
                seen.setdefault(kind, []).append(tuple(p.shape))
        found = "; ".join(f"{len(v)} {k} of shape {', '.join(map(str, v[:3]))}{', ...' if len(v) > 3 else ''}"
                          for k, v in seen.items())
        rules = ", ".join(sorted({self._rules[k].name for k in seen}))
        warnings.warn(
            f"{type(self).__name__}: no >=2-D parameter reaches Newton-Schulz: no parameter is of kind "
            f"{' or '.join(ns)} (found {found}), so every update is {rules}, not {type(self).__name__}. Flat 1-D "
            "partitions (DeepSpeed ZeRO) lose the matrices: give the optimizer the model's own >=2-D parameters "
            "(FSDP2, DDP, or ZeRO stage 0), route with meqmuon.param_groups(model), or add the hidden groups "
            "with add_param_group.",
            UserWarning, stacklevel=_outside_stacklevel())

    def _rule_for(self, kind: str) -> Rule:
        return self._rules[kind]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and "params" in param_group:  # else torch's own error
            check_unique_params([*self.param_groups, listed_params(param_group)])
        super().add_param_group(param_group)
        self._plan_key = None
        try:
            self._check_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            raise

    def _check_group(self, group: dict[str, Any]) -> None:
        kind = group.get("kind")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"Invalid kind: {kind!r} (expected one of {KINDS})")
        if kind is None and not self._warned_inferred:
            self._warned_inferred = True
            warnings.warn(
                f"{type(self).__name__}: a param group has no 'kind'; kinds are inferred from shape "
                "(>=2-D: hidden, else vector) and a >=3-D tensor is one (shape[0], -1) matrix unless its group "
                "sets 'views'. Token embeddings, LM heads and MoE experts cannot be recognised from shape: "
                "route them with meqmuon.param_groups(model).",
                UserWarning,
                stacklevel=4,
            )
        names = group.get("names")
        if names is not None and len(names) != len(group["params"]):
            raise ValueError(f"param group 'names' has {len(names)} entries for {len(group['params'])} params")
        normalise_group_views(group, names or [f"params[{i}]" for i in range(len(group["params"]))])
        keys = {"lr", "weight_decay"}
        rules: dict[int, Rule] = {}
        for i, p in enumerate(group["params"]):
            pname = names[i] if names else f"params[{i}]"
            if p.is_complex():
                raise ValueError(f"{type(self).__name__} does not support complex parameters ({pname})")
            pkind = kind or infer_kind(p)
            rule = self._rule_for(pkind)
            if driver.needs_matrix(rule) and p.ndim < 2:
                raise ValueError(
                    f"parameter {pname} of shape {tuple(p.shape)} is in a '{pkind}' group, whose rule "
                    f"'{rule.name}' needs a >=2-D tensor"
                )
            if driver.needs_matrix(rule) and group_layout(group, i, p.shape, pname).view == "vectors":
                raise ValueError(f"parameter {pname} has view 'vectors' in a '{pkind}' group, whose rule "
                                 f"'{rule.name}' needs matrices; put it in a 'vector' group")
            rules.setdefault(id(rule), rule)
        for optional in ("state_dtype", "foreach"):
            if optional in group:
                keys.add(optional)
        # Only the keys the rules read are checked; others stay in the group, unread, as in torch.optim.
        # torchtitan puts "fused" (no fused kernel here: ignored) and "param_names" (its checkpoint keys)
        # in every group (pytorch/torchtitan torchtitan/components/optimizer/optimizer.py,
        # OptimizersContainer._build_param_groups); tests/test_contracts.py holds them to that.
        validate_group(group, sorted(keys))
        for rule in rules.values():  # each rule checks its own keys (Rule.validate)
            validate_rule(rule, group)

    # ---- stepping --------------------------------------------------------------------------

    def _prepare(self) -> list[tuple[dict[str, Any], list[Entry], bool]]:
        """What the step needs of the param groups, made once and kept while they and the state are the same
        objects: per group its entries and whether it takes the batched forms: ``foreach``, resolved here once
        (``None``: where every parameter is on a CUDA device, where a step is launch-bound; the per-tensor forms
        are faster on CPU, docs/benchmarks.md).

        Creates the state of every parameter, gradient or not, so that the state is the same on every rank (a
        ``torch.distributed.checkpoint`` save needs that; microsoft/dion#89). Each parameter's path is decided
        here, once (:func:`.placement.path_of`), and its splitter made (:func:`.placement.splitter`): one
        :class:`~.exchange.Exchange` for every ``OWNERS`` unit of the optimizer (no collective: where every piece
        lies is read off the placements), so that its owners balance over the whole step.
        """
        pg = self._process_group
        world = 1 if pg is None else dist.get_world_size(pg)
        plan, units, costs, shares, cache, prices = [], [], [], [], {}, {}
        for group in self.param_groups:
            kind, names = group.get("kind"), group.get("names")
            cuda = all(p.device.type == "cuda" for p in group["params"])
            batched = cuda if group.get("foreach") is None else group["foreach"]
            entries = []
            for i, p in enumerate(group["params"]):
                name = names[i] if names else f"params[{i}]"
                pkind = kind or infer_kind(p)
                rule = self._rules[pkind]
                layout = group_layout(group, i, p.shape, name)
                state = self.state[p]
                if not state:
                    driver.init_state(rule, p, state, group, layout)
                if SKIPPED not in state:  # the steps skipped so far (a state saved before it was counted: 0)
                    state[SKIPPED] = torch.zeros((), dtype=torch.int64, device=p.device)
                path = path_of(p, rule, layout, world, self._compile and batched)
                e = Entry(p, state, name, pkind, rule, layout, path, self._by_matrix)
                if e.path is Path.OWNERS:
                    for u in e.exchange_units(cache):
                        e.units.append(len(units))
                        units.append(u)
                        shares.append((price := unit_prices(rule, unit_shapes(u), group, self._ns_group, prices))[0])
                        costs.append(price[1])
                if not e.cut:
                    e.item = Item(p, None, state, name, p.shape, pkind, *e.units)
                entries.append(e)
            kinds = {is_dtensor(p): i for i, p in enumerate(group["params"])}
            if len(kinds) == 2:
                plain, dt = ((names[i] if names else f"params[{i}]") for i in (kinds[False], kinds[True]))
                raise NotImplementedError(
                    f"a param group mixes a plain tensor ({plain}) with DTensors ({dt}, placements "
                    f"{tuple(group['params'][kinds[True]].placements)}): under FSDP2 or TP the plain one's "
                    "gradient may differ between ranks. Shard every module of the group (fully_shard / "
                    "parallelize_module) or none, or put the plain tensors in a group of their own")
            plan.append((group, entries, batched))
        overlap = self._overlap if self._overlap is not None else all(
            p.device.type == "cuda" for group in self.param_groups for p in group["params"])
        self._exchange = (Exchange(units, costs, pg, depth=DEPTHS[overlap], shares=shares, ns_group=self._ns_group,
                                   relay_group=self._relay_group) if units else None)
        self._rows = {}
        for _, entries, batched in plan:
            # whole local matrices a block holds alike are shared by it in the eager batched form (ns_for)
            share = self._ns_group if batched and not self._compile and pg is resolve_process_group(None) else 1
            for e in entries:
                e.split = splitter(e.path, e.param, self._local, self._rows, self._exchange,
                                   share if isinstance(e.rule, HiddenRule) else 1)
        return plan

    def _plan(self) -> list[tuple[dict[str, Any], list[Entry], bool]]:
        """:meth:`_prepare`'s plan, remade when a param group, its parameters or the state changed."""
        key = (id(self.state), len(self.state), *(id(g) for g in self.param_groups),
               *(id(p) for g in self.param_groups for p in g["params"]))
        if key != self._plan_key:
            self._plan_cache = self._prepare()  # which creates state: the key is taken after it
            self._plan_key = (id(self.state), len(self.state), *key[2:])
        return self._plan_cache

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None):  # noqa: D401 - torch signature
        """Perform one optimisation step, all or nothing (no host-device synchronisation).

        Gather (the step's rule calls, :meth:`_calls`: per-tensor groups one call each, batched groups with the same
        rule, path and hyperparameters merged into one, so that they share shape buckets), then two phases
        (:meth:`_transact`): every call computes its directions by what its path's executor names
        (``placement.EXECUTORS``: the one chooser, as torch's ``adam()`` picks among its siblings) and writes
        nothing; then the step's writes (``commit.py``). Whatever raises in the first phase leaves parameters and
        state as they were, and names the rule and the parameter. A non-finite gradient skips the whole step under
        ``nonfinite="skip"`` (the default; decided on the device, counted in the state's ``"skipped_steps"``), raises
        under ``"raise"``, steps under ``"propagate"``. The calls are independent (no parameter in two), so the order
        among them changes no bits; it is the same on every rank, which the collectives need.

        ``grad_scale`` / ``found_inf``: ``torch.amp.GradScaler``'s protocol for optimizers that unscale themselves
        (``_step_supports_amp_scaling``; it sets them as attributes, read here too): the gradients are unscaled by
        ``1 / grad_scale`` in the check's own kernel and the step is skipped where ``found_inf`` is set, whatever
        ``nonfinite`` says (the scaler's overflows are its business), with no host sync of the scaler's.

        Under ``torch.compile`` (a compiled training step that calls ``opt.step()``) the step is not traced: it
        runs as here, with a warning once (docs/algorithm.md, "compile=True"); ``compile=True`` is the way to
        compiled kernels in the step.
        """
        if torch.compiler.is_compiling():  # a constant True while dynamo traces
            return self._untraced_step(closure)
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if self._graphed is not None:
            return self._graphed.step(self, closure, grad_scale, found_inf)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._prepare_gradients(grad_scale)
        calls, grads, counted = self._calls(self._plan())
        self._released = False
        try:
            self._transact(calls, grads, counted, grad_scale, found_inf)
        finally:
            self._release(measure=not self._released)
        return loss

    def _prepare_gradients(self, grad_scale: torch.Tensor | None) -> None:
        """A preset's work on the gradients before the step reads them, in place, no host sync: nothing here."""

    def _transact(self, calls: tuple[list[driver.Call], list[driver.Call]], grads: list[tuple[str, torch.Tensor]],
                  counted: list[dict[str, Any]], grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None,
                  stepping: Callable[[Commit], None] | None = None) -> None:
        """The two phases of a step (:meth:`step`): the gate (the non-finite check and the scaler's protocol,
        ``decision.gate``), every call's directions (:meth:`_run`; ``stepping`` queues more writes: ``cuda_graph``'s
        AdamW), the decision (``decision.decide``: the ranks' agreement, on a CPU the flag read), then the writes. A
        step that raises before its writes is not counted (``counted``: the states whose ``"step"`` advanced)."""
        world = 1 if self._process_group is None else dist.get_world_size(self._process_group)
        step = Commit(tolerant=world > 1)
        if stepping is None:  # the momentum rules' stacks, before the stepping rules copy their tensors
            step.between = self._release
        try:
            try:
                step.gate = decision.gate(self, grads, grad_scale, found_inf, world)
                if stepping is not None:
                    stepping(step)
                self._run(calls, step)
                decision.decide(step, self._process_group if world > 1 else None)
            except BaseException:
                for state in counted:
                    state["step"] -= 1
                raise
            step.run()
        finally:
            for call in (*calls[0], *calls[1]):
                for it in call[1]:
                    it.grad = None  # a kept item must not keep its gradient alive past zero_grad()
        if step.gate is not None:
            decision.count_skipped(step.gate, counted)
        if step.error is not None:  # this rank's error, after the step was skipped on every rank
            raise step.error

    def skipped_steps(self) -> int:
        """The steps skipped so far (``nonfinite="skip"``, a ``GradScaler``'s overflows, an error on another rank): the
        largest ``"skipped_steps"`` of any parameter's state (one host sync: call it to log, not in the step)."""
        counts = [local(st[SKIPPED]).reshape(1).cpu() for st in self.state.values() if SKIPPED in st]
        return int(torch.cat(counts).max()) if counts else 0

    def _calls(self, plan: list) -> tuple[tuple[list[driver.Call], list[driver.Call]], list[tuple[str, torch.Tensor]],
                                          list[dict[str, Any]]]:
        """The step's rule calls: per-tensor groups one call each, batched groups with the same rule, splitter and
        hyperparameter values (the embedding and head groups, say) merged into one, so that they share shape
        buckets; each with its context, kept between steps (its workspace is the optimizer's; its number among
        the step's calls keeps its input stacks its own). Counts the steps of the parameters with gradients (undone
        where the step raises, :meth:`_transact`); float hyperparameters given as tensors are read as Python floats
        (``inputs.with_floats``). Returns the calls (per-tensor, batched), the gradients the rules read by parameter
        name (:meth:`_gate` checks them) and the states counted."""
        batched: dict[tuple, tuple[Rule, dict, list[Item], Any, str, Path]] = {}
        single: list[tuple] = []  # the per-tensor groups' calls (foreach=False), in group order
        grads: list[tuple[str, torch.Tensor]] = []
        counted: list[dict[str, Any]] = []
        for group, entries, batched_group in plan:
            if any(isinstance(group.get(k), torch.Tensor) for k in FLOAT_KEYS) or any(
                    isinstance(b, torch.Tensor) for b in group.get("betas", ())):
                group = with_floats(group)
            by_rule: dict[tuple, list[Item]] = {}
            for e in entries:  # the items with a gradient, by rule and splitter
                g = e.param.grad
                if g is None:
                    continue
                if g.is_sparse:
                    for state in counted:
                        state["step"] -= 1
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients ({e.name})")
                g = e.local_grad(g)
                grads.append((e.name, g))
                e.state["step"] += 1
                counted.append(e.state)
                items = by_rule.setdefault((e.rule, e.path, e.split), [])
                if e.item is not None and not e.dtensor:  # a whole plain tensor's kept item: only its gradient is new
                    e.item.grad = g
                    items.append(e.item)
                else:
                    items += e.items(g)
            for (rule, path, split), items in by_rule.items():
                if not items and path is Path.LOCAL:
                    # this rank holds none of the call's matrices (FSDP2's Shard(0) of a stack of experts over
                    # more ranks than experts) and a LOCAL call joins no collective: nothing to do here
                    continue
                kind = group.get("kind") or items[0].kind
                if not batched_group:
                    single.append((rule, items, group, kind, split, path))
                    continue
                values = sorted({"lr", "weight_decay", *rule.hyperparameters})
                key = (rule.name, id(split), *(repr(group[k]) for k in values))
                batched.setdefault(key, (rule, group, [], split, kind, path))[2].extend(items)
        calls = [*single, *((rule, items, group, kind, split, path)
                            for rule, group, items, split, kind, path in batched.values())]
        while len(self._contexts) < len(calls):
            self._contexts.append(StepContext(workspace=self._workspace))
        out: list[driver.Call] = []
        for i, (rule, items, group, kind, split, path) in enumerate(calls):
            ctx = self._contexts[i]
            ctx.capture, ctx.kind, ctx.split, ctx.call, ctx.path = self._capture_hook, kind, split, i, path
            out.append((rule, items, group, ctx))
        return (out[: len(single)], out[len(single) :]), grads, counted

    def _run(self, calls: tuple[list[driver.Call], list[driver.Call]], step: Commit) -> None:
        """The first phase of a step: each call by its path's executor (``placement.EXECUTORS``: the one chooser),
        which computes and queues its writes on ``step``. A :class:`SteppingRule` runs its executor's ``stepping``
        (its own ``step`` or ``step_foreach``, a write; or the exchange's), the momentum rules the executor's form
        ``[foreach, compile]``. Under ``torch.distributed`` an error of one form is kept and the next forms still run,
        so that this rank takes part in all of the step's collectives."""
        for foreach, group_calls in zip((False, True), calls, strict=True):
            by_form: dict[int, tuple[Callable, list[driver.Call]]] = {}
            for call in group_calls:
                call[3].commit = step
                executor = EXECUTORS[call[3].path]
                if isinstance(call[0], SteppingRule):
                    commit.guarded(step, call[0], call[1], executor.stepping,
                                  call[0].step_foreach if foreach else call[0].step, *call[1:])
                else:
                    form = executor.forms[foreach, self._compile]
                    by_form.setdefault(id(form), (form, []))[1].append(call)
            for form, form_calls in by_form.values():
                commit.guarded(step, form_calls[0][0], [it for c in form_calls for it in c[1]], form, form_calls)

    # torch._disable_dynamo (torch.optim's own tool) imports dynamo at the first traced call only:
    # torch.compiler.disable as a decorator would add its ~1 s import to `import meqmuon`.
    @torch._disable_dynamo
    def _untraced_step(self, closure):
        if not self._warned_traced:
            self._warned_traced = True
            kernels = ("its compile=True kernels still run compiled" if self._compile else
                       "for compiled update kernels build the optimizer with compile=True")
            warnings.warn(f"{type(self).__name__}.step() is called inside torch.compile: it runs eagerly (dynamo "
                          f"would recompile it at every step); {kernels}", UserWarning, stacklevel=2)
        return self.step(closure)  # dynamo is off here: is_compiling() is False

    def _release(self, measure: bool = True) -> None:
        """Let go of the step's workspaces (stacks, Newton-Schulz buffers): only the state is kept between steps, so
        that the forward and backward get that memory (CUDA's caching allocator hands freed blocks back to them).
        :meth:`workspace_bytes` keeps their size at the step's end (``measure``: the first release of a step, once
        the momentum rules' writes are made; the stepping rules' buffers after it are let go too)."""
        spaces = [self._workspace, self._local.workspace, *(r.workspace for r in self._rows.values()),
                  *([self._exchange.workspace] if self._exchange is not None else [])]
        # the bytes of the tensors in the workspaces' entries (tensors, or dicts, lists and tuples of them)
        pending, total = [v for ws in spaces for v in ws.values()], 0
        while pending:
            v = pending.pop()
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
            elif isinstance(v, dict | list | tuple):
                pending += v.values() if isinstance(v, dict) else v
        if measure:
            self._last_workspace = total
        self._released = True
        for ws in spaces:  # what stays: the resolved Newton-Schulz dtypes
            for key in [k for k, v in ws.items() if not isinstance(v, torch.dtype)]:
                del ws[key]

    def _splitter(self, group: dict[str, Any]) -> Any:
        """The splitter of ``group``'s first parameter in a step (introspection; the step takes each entry's)."""
        for g, entries, _ in self._plan():
            if g is group and entries:
                return entries[0].split
        return self._local

    def workspace_bytes(self) -> int:
        """Bytes the last step's workspaces held at its end, freed then (:meth:`_release`); 0 before the first step."""
        return self._last_workspace

    # ---- introspection -----------------------------------------------------------------------

    def selection_counts(self) -> dict[str, tuple[int, int]]:
        """Per matrix using MeqMuon's adaptive rule: ``(row_steps, column_steps)`` so far, keyed by the
        parameter's name, or ``name[e]#j`` for the matrices of a stacked or split parameter (under
        FSDP2, the experts this rank holds: no collective, so rank 0 alone may call it).

        Counting happens on device during ``step()``; this call reads the counters (one sync). A skipped step
        (``nonfinite="skip"``) counts in neither.
        """
        out: dict[str, tuple[int, int]] = {}
        for gi, group in enumerate(self.param_groups):
            names = group.get("names")
            for i, p in enumerate(group["params"]):
                st = self.state.get(p)
                if not st or "rows_chosen" not in st:
                    continue
                name = names[i] if names else f"group{gi}.params[{i}]"
                counts = local(st["rows_chosen"]).reshape(-1).tolist()
                taken = int(st["step"]) - int(local(st[SKIPPED])) if SKIPPED in st else int(st["step"])
                layout = group_layout(group, i, p.shape, name)
                labels = [""] if layout.whole else layout.labels(held_rows(st["rows_chosen"]))
                for label, rows in zip(labels, counts, strict=True):
                    out[name + label] = (rows, taken - rows)
        return out
