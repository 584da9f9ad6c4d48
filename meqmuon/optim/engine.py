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

from . import compiled, driver
from .calls import Item, StepContext
from .cuda_graph import GraphedStep
from .distributed import (
    SHARDED_LAYOUTS,
    LocalSplit,
    RowPieceSplit,
    is_dtensor,
    local,
    replicated_splitter,
    resolve_process_group,
    share_loads,
    splitter_for,
)
from .driver import HiddenRule
from .exchange import Job, directions_at_owners, gather_whole, scatter_whole
from .groups import KINDS, infer_kind
from .inputs import FLOAT_KEYS, check_unique_params, listed_params, validate_group, with_floats, wrong_params
from .owners import OwnerPlan, is_replicated
from .placement import Path, cuts, path_of
from .rule import MomentumRule, Rule, SteppingRule, rule_defaults, validate_rule
from .rules import RULES
from .saved_state import dtypes_named, keeping_saved_dtypes
from .views import Layout, group_layout, normalise_group_views

#: The forms of a momentum rule's step by ``(foreach, compile)``, one signature (a sequence of rule calls),
#: picked in :meth:`RoleOptimizer._run` (a phase of ``step``): ``driver.py``'s eager two and ``compiled.py``'s
#: two with graphs.
FORMS: dict[tuple[bool, bool], Callable[[list[driver.Call]], None]] = {
    (False, False): driver.per_tensor,
    (True, False): driver.batched,
    (False, True): compiled.compiled_per_tensor,
    (True, True): compiled.compiled_batched,
}

#: The form of a hidden rule's FSDP2 row shards (``placement.ROWS``), by ``compile``: batched whatever
#: ``foreach`` (their whole matrices meet at owner ranks a shape bucket at a time, ``sharded.py``).
ROW_FORMS: dict[bool, Callable[[list[driver.Call]], None]] = {False: driver.batched, True: compiled.rows_batched}


def _held(p: torch.Tensor) -> slice:
    """The indices along dim 0 of ``p`` that this rank holds: all, or under FSDP2/HSDP its
    ``Shard(0)`` piece (``torch.chunk`` sizes over the mesh's last dimension)."""
    if not is_dtensor(p) or is_replicated(p):
        return slice(None)
    mesh = p.device_mesh
    size = -(-p.shape[0] // mesh.size(mesh.ndim - 1))
    start = min(mesh.get_local_rank(mesh.ndim - 1) * size, p.shape[0])
    return slice(start, start + p.to_local().shape[0])


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised here that names the first caller outside the package
    (presets and ``build_optimizer`` add frames of their own)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


#: A group without row-sharded DTensors: the step's splitter (DDP's, or one process's) is theirs.
_PLAIN = LocalSplit()


def _with_floats(plan: list) -> list[dict[str, Any]]:
    """The plan's param groups, each with its float hyperparameters as Python floats where they are tensors."""
    return [with_floats(g) if any(isinstance(g.get(k), torch.Tensor) for k in FLOAT_KEYS) or any(
        isinstance(b, torch.Tensor) for b in g.get("betas", ())) else g for g, _, _, _ in plan]


def _shape_buckets(jobs: Any) -> list[list[Job]]:
    """The owner path's jobs by global shape (in first-appearance order, the same on every rank): each bucket
    is one exchange out and one back, so a step holds one bucket's whole matrices at a time and its
    collectives grow with the number of shapes, not with depth."""
    out: dict[tuple, list[Job]] = {}
    for j in jobs:
        out.setdefault(tuple(j.param.shape), []).append(j)
    return list(out.values())


def _row_key(p: torch.Tensor) -> tuple | None:
    """Which splitter steps ``p``'s row pieces: ``None`` for FSDP2's / HSDP's (``splitter_for``), else
    ``RowPieceSplit``'s mesh and the mesh dimensions that replicate."""
    if tuple(p.placements) in SHARDED_LAYOUTS:
        return None
    return id(p.device_mesh), tuple(i for i, q in enumerate(p.placements) if q.is_replicate())


def _tensor_bytes(v: Any) -> int:
    """Bytes of the tensors in ``v`` (a tensor, or dicts, lists and tuples of them: a workspace entry)."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, dict):
        v = v.values()
    return sum(map(_tensor_bytes, v)) if isinstance(v, list | tuple | type({}.values())) else 0


class _Entry:
    """One parameter of a param group as the step sees it, prepared once (:meth:`RoleOptimizer._prepare`):
    its :class:`~.placement.Path` (``PLAIN``, ``LOCAL`` or ``ROWS``; ``PIECES`` parameters are the owner
    path's) and whether its rule sees the matrices of its view (``cut``)."""

    __slots__ = ("param", "state", "name", "kind", "rule", "layout", "cut", "path", "item")

    def __init__(self, param: torch.Tensor, state: dict[str, Any], name: str, kind: str, rule: Rule,
                 layout: Layout, path: Path) -> None:
        self.param, self.state, self.name, self.kind, self.rule, self.layout = param, state, name, kind, rule, layout
        self.cut = cuts(rule, layout)
        self.path = path
        #: A whole plain tensor is one item for good: each step only sets its gradient.
        self.item = None if self.cut or is_dtensor(param) else Item(param, None, state, name, param.shape, kind)

    def items(self, grad: torch.Tensor) -> list[Item]:
        """This step's items of a parameter that is not one whole plain tensor: its local shard (FSDP2)
        and/or one item per matrix of its view (:meth:`Layout.matrices`), with the state as local views
        (``rule.state_views`` says how each state tensor divides), named ``name[e]#j``."""
        if is_dtensor(grad) and tuple(grad.placements) != tuple(self.param.placements):  # Partial() under TP
            grad = grad.redistribute(grad.device_mesh, self.param.placements)
        param, grad = local(self.param), local(grad)
        state = {k: local(v) for k, v in self.state.items()}
        if not self.cut:
            return [Item(param, grad, state, self.name, self.param.shape, self.kind)]
        layout = self.layout
        pieces = {"param": layout.matrices, "rows": layout.row_pieces, "counter": layout.counters}
        per_key = {k: pieces[how](state[k]) for k, how in self.rule.state_views.items() if how in pieces}
        labels = layout.labels(_held(self.param))
        return [Item(p, g, {"step": state["step"], **{k: v[j] for k, v in per_key.items()}}, self.name + label,
                     p.shape, self.kind)
                for j, (p, g, label) in enumerate(zip(layout.matrices(param), layout.matrices(grad), labels,
                                                      strict=True))]


class RoleOptimizer(Optimizer):
    """Base engine. Subclasses define ``RULES`` (kind -> rule name) and call ``__init__`` with defaults.

    Param groups may carry ``kind`` (one of hidden, embedding, head, vector; see
    :func:`meqmuon.param_groups`) and ``names``. A group without ``kind`` gets one inferred per
    tensor from its shape (>=2-D: hidden, else vector), with a warning, because embeddings and
    heads cannot be recognised from shape. A tensor given twice is an error (torch.optim only warns), and
    float hyperparameters take any real number or a 0-D CPU tensor, as torch.optim does (:mod:`.inputs`).

    Distributed (see ``distributed.py``): with plain-tensor parameters and ``torch.distributed``
    initialised, the updates of the momentum rules' parameters are split over ``process_group``
    (default: the default group; DDP, gradients already all-reduced): each parameter's owner rank
    computes its update and broadcasts it; with DTensor parameters (FSDP2) the work follows their
    mesh. The process group is an attribute, not a param-group entry, so
    ``state_dict()`` is the same as single-process and loads into any world size.

    ``cuda_graph=True`` (every optimizer takes it): the batched step, eager or ``compile=True``, captured in a
    CUDA graph after one eager step and replayed, with ``lr``, ``weight_decay``, ``momentum`` and AdamW's bias
    corrections read from device tensors that each step refreshes (``cuda_graph.py``: what it keeps static,
    what re-captures, what it refuses).
    """

    RULES: ClassVar[dict[str, str]] = {}

    def __init__(self, params: Any, defaults: dict[str, Any], process_group: Any = None, compile: bool = False,
                 rules: dict[str, Rule] | None = None, cuda_graph: bool = False, **hyperparameters: Any) -> None:
        if (what := wrong_params(params)) is not None:
            cls = type(self).__name__
            raise TypeError(f"{cls}(params=...) takes parameters or param groups, e.g. "
                            f"{cls}(meqmuon.param_groups(model)); got {what}")
        if not isinstance(compile, bool):
            raise ValueError(f"Invalid compile: {compile!r} (expected True or False)")
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"Invalid cuda_graph: {cuda_graph!r} (expected True or False)")
        self._compile = compile
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
        self._warned_inferred = False
        self._warned_traced = False
        self._capture_hook: Callable[[str, str, str, torch.Tensor], None] | None = None
        self._process_group = resolve_process_group(process_group)
        #: The batched step's persistent buffers (see ``step.workspace``); not optimizer state.
        self._workspace: dict = {}
        self._init_step_cache()
        super().__init__(params, defaults)
        self._warn_if_no_matrix()

    # ---- pickling and deepcopy -------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, param groups) plus this engine's settings.

        ``torch.optim.Optimizer.__getstate__`` keeps only its own three entries, so without this a
        ``copy.deepcopy``-ed or unpickled optimizer lost ``compile`` and failed at its first
        ``step()``. The process group is not carried (process groups cannot be pickled): the copy
        uses the default group again, and an optimizer built with an explicit ``process_group``
        refuses to be copied rather than silently stepping on another group. The capture hook is
        dropped, like torch's optimizer hooks.
        """
        if self._process_group is not None and self._process_group is not resolve_process_group(None):
            raise RuntimeError(
                f"{type(self).__name__} was built with an explicit process_group, which cannot be pickled or "
                "copied; build a new optimizer with that group and load_state_dict() this one's state_dict()"
            )
        return {**super().__getstate__(), "_compile": self._compile, "_warned_inferred": self._warned_inferred,
                "_rules": self._rules, "_graphed": None if self._graphed is None else GraphedStep()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy's settings (:meth:`__getstate__`), or, from ``load_state_dict``, new state and param
        groups for this optimizer, which keeps its settings and hook and prepares its next step anew."""
        super().__setstate__(state)
        for key, value in (("_compile", False), ("_warned_inferred", False), ("_warned_traced", False),
                           ("_capture_hook", None), ("_workspace", {}), ("_graphed", None)):
            self.__dict__.setdefault(key, value)
        self.__dict__.setdefault("_rules", self._rule_table(None))
        self.__dict__.setdefault("_process_group", resolve_process_group(None))
        self._init_step_cache()

    def _init_step_cache(self) -> None:
        """The step's kept objects: the plan of the param groups (:meth:`_plan`), the rule calls' contexts
        and the single process's splitter; none of it is state."""
        self._plan_key: tuple | None = None
        self._plan_cache: list = []
        self._owners: OwnerPlan | None = None
        self._loads: list = []
        self._owned: list[list[tuple]] = []
        self._last_workspace = 0
        #: The splitter of the owner path's whole tensors: one for all groups, so that they share buckets.
        self._owner_split = LocalSplit()
        self._contexts: list[StepContext] = []
        self._local = LocalSplit()

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
        ns = sorted(k for k, r in self._rules.items()
                    if isinstance(r, HiddenRule) or (isinstance(r, SteppingRule) and r.orthogonalizes))
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

    def _prepare(self) -> list[tuple[dict[str, Any], list[_Entry], LocalSplit | None, bool]]:
        """What the step needs of the param groups, made once and kept while they and the state are the
        same objects: per group its entries, its splitter (``None``: the step's splitter of plain tensors)
        and whether it takes the batched forms: ``foreach``, resolved here once (``None``: where every
        parameter is on a CUDA device, where a step is launch-bound; the per-tensor forms are faster on
        CPU, docs/benchmarks.md). Which function runs a call is :meth:`step`'s choice.

        Creates the state of every parameter, gradient or not, so that the state is the same on every
        rank (a ``torch.distributed.checkpoint`` save needs that; microsoft/dion#89).

        Each parameter's path is decided here, once (:func:`.placement.path_of`). ``PIECES`` parameters go to
        the owner path (``owners.py``): :attr:`_owners` plans it (no collective: where every piece lies is read
        off the placements) and :attr:`_owned` lists per group ``(index, parameter, name, kind, rule, layout)``.
        """
        plan, owned, at_owners = [], [], []
        for group in self.param_groups:
            kind, names = group.get("kind"), group.get("names")
            entries, rows, pieces = [], [], []
            cuda = all(p.device.type == "cuda" for p in group["params"])
            batched = cuda if group.get("foreach") is None else group["foreach"]
            for i, p in enumerate(group["params"]):
                name = names[i] if names else f"params[{i}]"
                pkind = kind or infer_kind(p)
                rule = self._rules[pkind]
                layout = group_layout(group, i, p.shape, name)
                state = self.state[p]
                if not state:
                    driver.init_state(rule, p, state, group, layout)
                path = path_of(p, rule, layout, self._compile and batched)
                if path is Path.ROWS and _row_key(p) != _row_key(rows[0] if rows else p):
                    path = Path.PIECES  # a group's row pieces share one splitter: the others go to owners
                if path is Path.PIECES:
                    pieces.append((len(at_owners), p, name, pkind, rule, layout))
                    at_owners.append((p, state, driver.cost(rule, p.shape, group), name))
                    continue
                entries.append(_Entry(p, state, name, pkind, rule, layout, path))
                if path is Path.ROWS:
                    rows.append(p)
            kinds = {is_dtensor(p): i for i, p in enumerate(group["params"])}
            if len(kinds) == 2:
                plain, dt = ((names[i] if names else f"params[{i}]") for i in (kinds[False], kinds[True]))
                raise NotImplementedError(
                    f"a param group mixes a plain tensor ({plain}) with DTensors ({dt}, placements "
                    f"{tuple(group['params'][kinds[True]].placements)}): under FSDP2 or TP the plain one's "
                    "gradient may differ between ranks. Shard every module of the group (fully_shard / "
                    "parallelize_module) or none, or put the plain tensors in a group of their own")
            split = _PLAIN if not rows else splitter_for(rows) if _row_key(rows[0]) is None else RowPieceSplit(
                rows[0].device_mesh, _row_key(rows[0])[1])
            plan.append((group, entries, None if split is _PLAIN else split, batched))
            owned.append(pieces)
        self._owners = OwnerPlan(*(list(x) for x in zip(*at_owners, strict=True))) if at_owners else None
        self._owned = owned
        self._loads = share_loads([split for _, _, split, _ in plan], self._owners.load if self._owners else None)
        return plan

    def _plan(self) -> list[tuple[dict[str, Any], list[_Entry], LocalSplit | None, bool]]:
        """:meth:`_prepare`'s plan, remade when a param group, its parameters or the state changed."""
        key = (id(self.state), len(self.state), *(id(g) for g in self.param_groups),
               *(id(p) for g in self.param_groups for p in g["params"]))
        if key != self._plan_key:
            self._plan_cache = self._prepare()  # which creates state: the key is taken after it
            self._plan_key = (id(self.state), len(self.state), *key[2:])
        return self._plan_cache

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch signature
        """Perform one optimisation step (no host-device synchronisation).

        Three phases: gather (the owner path, ``owners.py``: direction inputs to owners, directions back and
        applied; a stepping rule's whole tensors to its owner), compute (the step's rule calls collected by
        :meth:`_calls`: per-tensor groups one call each, batched groups with the same rule and hyperparameters
        merged into one; and run each in its form by :meth:`_run`, the one place a form is chosen, as torch's
        ``adam()`` picks among its siblings; ``_prepare`` resolves ``foreach`` once) and scatter (the stepping
        rules' results back); then the step's workspaces are let go (:meth:`_release`). A
        :class:`SteppingRule` (AdamW, SCALE) runs its own ``step`` or ``step_foreach`` (eagerly, whatever
        ``compile``); the momentum rules run in :data:`FORMS` ``[foreach, compile]``, except that a hidden
        rule's FSDP2 row shards take the batched form whatever ``foreach``: their whole matrices meet at
        owner ranks a bucket at a time (``sharded.py``), and each matrix still gets the per-matrix
        Newton-Schulz of the per-tensor form on CPU (``newton_schulz.BATCHED_NS_DEVICES``). The calls are
        independent (no parameter in two), so the order among them changes no bits; it is the same on
        every rank, which the collectives need.

        Under ``torch.compile`` (a compiled training step that calls ``opt.step()``) the step is
        not traced: dynamo breaks the graph around it and it runs as here, with a warning once.
        Traced, it recompiled at every step (the step count and the learning rate are Python
        numbers that dynamo specialises on) until dynamo's recompile limit made it eager anyway.
        ``compile=True`` is the way to compiled kernels in the step.
        """
        if torch.compiler.is_compiling():  # a constant True while dynamo traces
            return self._untraced_step(closure)
        if self._graphed is not None:
            return self._graphed.step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # One splitter for all plain-tensor groups of the step, so that DDP owner loads balance across
        # groups (the embedding and the head land on different ranks).
        replicated = self._local if self._process_group is None else replicated_splitter(self._process_group)
        plan = self._plan()
        for load in self._loads:  # the row path's owners are planned per step, from the planned owner path's load
            load.reset()
        groups = _with_floats(plan)
        # gather: the owner path's direction inputs out, directions back and applied (momentum rules); a
        # stepping rule's whole tensors at its owner (owners.py)
        jobs = self._owner_jobs(plan, groups)
        whole = [j for j in jobs if isinstance(j.rule, SteppingRule)]
        for bucket in _shape_buckets([j for j in jobs if not isinstance(j.rule, SteppingRule)]):
            directions_at_owners(self._owners, bucket)  # a shape bucket at a time: bounded transient memory
        wholes = gather_whole(self._owners, whole) if whole else []  # one per job, None where not its owner
        self._run(self._calls(plan, groups, replicated, list(zip(whole, wholes, strict=True))))  # compute
        if replicated is not self._local:
            replicated.finish()  # wait for the owners' broadcasts (DDP)
        if whole:
            scatter_whole(self._owners, whole, wholes)  # scatter: every rank's pieces of the owners' results
        self._release(plan)
        return loss

    def _calls(self, plan: list, groups: list[dict[str, Any]], replicated: LocalSplit,
               whole: Any) -> tuple[list[driver.Call], list[driver.Call]]:
        """The step's rule calls: per-tensor groups one call each, batched groups with the same rule and the
        same hyperparameter values (the embedding and head groups, say) merged into one call, so that they
        share shape buckets. Counts the steps of the parameters with gradients. ``whole``: the owner path's
        whole-tensor fallback, ``(job, (param, grad, state))`` at its owner."""
        batched: dict[tuple, tuple[Rule, dict, list[Item], LocalSplit, str, Path]] = {}
        single: list[driver.Call] = []  # the per-tensor groups' calls (foreach=False), in group order
        at_owner: dict[int, list[tuple[Any, tuple]]] = {}
        for job, w in whole:
            if w is not None:
                at_owner.setdefault(id(job.group), []).append((job, w))
        for (_, entries, group_split, batched_group), group in zip(plan, groups, strict=True):
            by_rule: dict[tuple[Rule, Path], list[Item]] = {}
            for e in entries:  # the items with a gradient, by rule and path
                g = e.param.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients ({e.name})")
                e.state["step"] += 1
                if e.item is not None:
                    e.item.grad = g
                    by_rule.setdefault((e.rule, e.path), []).append(e.item)
                else:
                    by_rule.setdefault((e.rule, e.path), []).extend(e.items(g))
            for job, (param, grad, state) in at_owner.get(id(group), []):  # whole tensors at this owner
                e = _Entry(param, state, job.name, job.ctx.kind, job.rule, job.layout, Path.LOCAL)
                if e.item is not None:
                    e.item.grad = grad
                    by_rule.setdefault((e.rule, Path.PIECES), []).append(e.item)
                else:
                    by_rule.setdefault((e.rule, Path.PIECES), []).extend(e.items(grad))
            for (rule, path), items in by_rule.items():
                # LOCAL: whole local matrices of a sharded stack (FSDP2 experts) need no other rank; PIECES: the
                # whole-tensor fallback at its owner; ROWS the group's row splitter; PLAIN the step's DDP one
                split = (LocalSplit() if path is Path.LOCAL else self._owner_split if path is Path.PIECES
                         else group_split if path is Path.ROWS else replicated)
                kind = group.get("kind") or items[0].kind
                if not batched_group:
                    single.append((rule, items, group, self._context(len(single), kind, split, path)))
                    continue
                values = sorted({"lr", "weight_decay", *rule.hyperparameters})
                key = (rule.name, *(repr(group[k]) for k in values))
                if split is not replicated:  # DTensor groups follow their own mesh: never merged
                    key += (id(split),)
                batched.setdefault(key, (rule, group, [], split, kind, path))[2].extend(items)
        merged = [(rule, items, group, self._context(len(single) + i, kind, split, path))
                  for i, (rule, group, items, split, kind, path) in enumerate(batched.values())]
        return single, merged

    def _run(self, calls: tuple[list[driver.Call], list[driver.Call]]) -> None:
        """Each call in its form: the one chooser. A :class:`SteppingRule` runs its own ``step`` or
        ``step_foreach``; the momentum rules :data:`FORMS` ``[foreach, compile]``; a hidden rule's row shards
        (``Path.ROWS``) :data:`ROW_FORMS` ``[compile]``."""
        for foreach, group_calls in zip((False, True), calls, strict=True):
            momentum, rows = [], []
            for call in group_calls:
                rule = call[0]
                if isinstance(rule, SteppingRule):
                    (rule.step_foreach if foreach else rule.step)(*call[1:])
                elif isinstance(rule, HiddenRule) and call[3].path is Path.ROWS:
                    rows.append(call)
                else:
                    momentum.append(call)
            if momentum:
                FORMS[foreach, self._compile](momentum)
            if rows:
                ROW_FORMS[self._compile](rows)
        for call in (*calls[0], *calls[1]):
            for it in call[1]:
                it.grad = None  # a kept item must not keep its gradient alive past zero_grad()

    # torch._disable_dynamo (torch.optim's own tool) imports dynamo at the first traced call only:
    # torch.compiler.disable as a decorator would add its ~1 s import to `import meqmuon`.
    @torch._disable_dynamo
    def _untraced_step(self, closure):
        if not self._warned_traced:
            self._warned_traced = True
            kernels = "its compile=True kernels still run compiled" if self._compile else (
                "for compiled update kernels build the optimizer with compile=True"
            )
            warnings.warn(
                f"{type(self).__name__}.step() is called inside torch.compile: it runs eagerly (dynamo would "
                f"recompile it at every step); {kernels}",
                UserWarning,
                stacklevel=2,
            )
        return self.step(closure)  # dynamo is off here: is_compiling() is False

    def _owner_jobs(self, plan: list, groups: list[dict[str, Any]]) -> list[Job]:
        """The owner path's parameters with gradients in this step (their steps counted), in plan order."""
        jobs: list[Job] = []
        for (_, _, _, batched_group), group, owned in zip(plan, groups, self._owned, strict=True):
            ctx = None
            for index, p, name, kind, rule, layout in owned:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients ({name})")
                ctx = ctx or StepContext(self._capture_hook, group.get("kind") or kind, self._owner_split,
                                         self._workspace, path=Path.PIECES)
                state = self.state[p]
                state["step"] += 1
                jobs.append(Job(index, p, p.grad, state, rule, layout, group, cuts(rule, layout), not batched_group,
                                ctx, name))
        return jobs

    def _release(self, plan: list) -> None:
        """Let go of the step's workspaces (stacks, Newton-Schulz buffers): nothing but the state is kept
        between steps, so that the forward and backward get that memory (on CUDA the caching allocator hands
        freed blocks back to them). :meth:`workspace_bytes` keeps their size at the step's end."""
        spaces = [self._workspace, self._local.workspace, self._owner_split.workspace,
                  *(split.workspace for _, _, split, _ in plan if split is not None)]
        self._last_workspace = sum(_tensor_bytes(v) for ws in spaces for v in ws.values())
        for ws in spaces:  # what stays: the resolved Newton-Schulz dtypes
            for key in [k for k, v in ws.items() if not isinstance(v, torch.dtype)]:
                del ws[key]

    def _splitter(self, group: dict[str, Any]) -> LocalSplit:
        """The work splitter of ``group`` in a step (introspection; the step takes it from its plan)."""
        for g, _, split, _ in self._plan():
            if g is group and split is not None:
                return split
        return self._local if self._process_group is None else replicated_splitter(self._process_group)

    def _context(self, i: int, kind: str, split: LocalSplit, path: Path) -> StepContext:
        """The ``i``-th rule call's context of this step, kept between steps (its workspace is the
        optimizer's; ``i`` numbers it among the step's calls, whose input stacks are their own)."""
        while len(self._contexts) <= i:
            self._contexts.append(StepContext(workspace=self._workspace))
        ctx = self._contexts[i]
        ctx.capture, ctx.kind, ctx.split, ctx.call, ctx.path = self._capture_hook, kind, split, i, path
        return ctx

    def workspace_bytes(self) -> int:
        """Bytes the last step's workspaces held at its end (at most one stack per shape bucket, plus
        MeqMuon's small statistics buffers), freed then (:meth:`_release`); 0 before the first step."""
        return self._last_workspace

    # ---- introspection -----------------------------------------------------------------------

    def selection_counts(self) -> dict[str, tuple[int, int]]:
        """Per matrix using MeqMuon's adaptive rule: ``(row_steps, column_steps)`` so far, keyed by the
        parameter's name, or ``name[e]#j`` for the matrices of a stacked or split parameter (under
        FSDP2, the experts this rank holds: no collective, so rank 0 alone may call it).

        Counting happens on device during ``step()``; this call reads the counters (one sync).
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
                layout = group_layout(group, i, p.shape, name)
                labels = [""] if layout.whole else layout.labels(_held(st["rows_chosen"]))
                for label, rows in zip(labels, counts, strict=True):
                    out[name + label] = (rows, int(st["step"]) - rows)
        return out
