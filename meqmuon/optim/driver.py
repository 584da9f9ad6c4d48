"""The driver: what a hidden rule is, and how every momentum rule's step runs eagerly, as functions.

A rule says what it computes (``rule.py``: the elementwise and stepping rules; here :class:`HiddenRule`,
the protocol a Muon variant subclasses, beside the one function that calls it); the driver runs it, as
torch's ``adam.py`` holds ``Adam`` beside ``_single_tensor_adam`` and ``_multi_tensor_adam``. Every
momentum rule updates ``B <- mu B + G`` (paper eq. 6; Moonlight's convention), takes the direction input
``X = G + mu B`` with Nesterov (else ``B``), turns it into a direction ``D`` and steps
``W <- (1 - lr wd) W - lr s D``. A hidden rule's direction is ``post(Orth(pre(X)))`` over stacks of
matrices, cut at Newton-Schulz as microsoft/dion cuts its Muon: the seam, :func:`directions`, is the one
body of every form (the compiled graphs of ``compiled.py`` and FSDP2's owners call it too) and looks the
method up in the table of ``newton_schulz.py``; an elementwise momentum rule's direction is its
``direction`` of a stack (batched, compiled) or its ``update`` (per-tensor).

**The eager forms** (``forms.py``: :func:`forms.per_tensor`, ``foreach=False``, and :func:`forms.batched`,
``foreach=True``) call the seam through :func:`bucket_directions`, the one body of a hidden rule's step wherever its
matrices are whole. Under ``torch.distributed`` the path of each parameter (``placement.path_of``) says which runs
it: those forms where the whole matrix is here and no other rank shares its work (and, for rules without
Newton-Schulz on row shards, with their statistics summed over the shards), and ``exchange.py`` (one owner per
matrix, pieces out and directions back) for hidden matrices under DDP, FSDP2, HSDP and TP alike. ``compile=True``
has the same two forms with graphs inside (``compiled.py``). The engine's ``step`` picks the form of each call (the
one chooser; ``_prepare`` resolves ``foreach``) and runs the rules that write their own forms (``SteppingRule``:
AdamW, SCALE) as they say.

What a rule declares becomes what the driver needs by the functions under "what the driver reads of a
rule": its state (:func:`init_state`, from ``state_views``), its cost for balancing owners
(:func:`cost`). No function here makes a host-device sync: step counters are Python ints, choices are
tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import functional as F
from ..precision import resolve_ns_dtype
from . import commit, transfer
from .calls import Item, StepContext, state_dtype
from .commit import Gate
from .distributed import state_like
from .inputs import float_dtype, positive_int
from .newton_schulz import NS_METHODS, method_flops
from .rule import MomentumBase, MomentumRule, Rule, SteppingRule
from .views import Layout

__all__ = ["ELEMENTWISE_COST", "Bucket", "Call", "Found", "HiddenRule", "Orth", "Stack", "apply_pending",
           "apply_update", "bucket_directions", "buffer", "cast", "compiles", "cost", "cut_items", "direction_input",
           "directions", "elementwise", "grads_like", "init_state", "make_buckets", "matrix_shape", "needs_matrix",
           "resolve_dtype", "stack_inputs", "stack_tensors", "state_elements", "unstack"]

#: One rule call of a step: the rule, its items (one param group's parameters of its kind, or several
#: groups' merged by the engine), the group, the call's context.
Call = tuple[Rule, Sequence[Item], dict, StepContext]

#: Cost of an elementwise update, in matmul-FLOP equivalents per element, for balancing DDP owners
#: (:func:`cost`): on CPU, the row-blocked equilibration of a 32000 x 512 matrix took as long
#: as 1000 Newton-Schulz FLOPs per element at the bf16 matmul rate. A heuristic: results never depend on it.
ELEMENTWISE_COST = 1000.0


# ---- the protocol of a hidden rule -------------------------------------------------------------


class HiddenRule(MomentumBase):
    """A rule for hidden matrices: ``D = post(Orth(pre(X)))``, stepped as ``W <- (1 - lr wd) W - lr s D``.

    Subclass it, set ``name`` and override :meth:`post` (and :meth:`pre` if the rule changes the
    Newton-Schulz input); pass an instance as ``rules={"hidden": MyRule()}`` to any optimizer. Every
    name a subclass sees is one it may override or declare; the driver (this module's functions and
    ``compiled.py``'s) does the rest in every form (per-tensor, batched, compiled; DDP, FSDP2, tensor
    parallel). ``pre`` and ``post`` get stacks ``(K, m, n)`` of matrices, each stack in one orientation,
    and the per-matrix state of ``state_views`` as stacks in the same order, to update in place.
    """

    defaults = {"ns_steps": F.NS_STEPS, "ns_coefficients": F.NS_COEFFICIENTS, "ns_dtype": None, "ns_method": "quintic"}
    #: May an ``(n, m)`` matrix share the Newton-Schulz stack of ``(m, n)`` matrices, transposed? Exact for
    #: every rule (``pre``/``post`` see each orientation apart); it saves a Newton-Schulz stack and costs a
    #: second ``pre``/``post`` call. Per-row state cannot: its rows would change length.
    transposes: ClassVar[bool] = True
    #: Whether the class overrides :meth:`pre` (set per class; :func:`directions` skips the identity ``pre``,
    #: and the batched form stacks the inputs of a rule that rewrites them in float32). Derived, not declared.
    _rewrites_input: ClassVar[bool] = False
    #: Whether the class overrides :meth:`inputs` / :meth:`step_weights` (derived per class, as above).
    _own_inputs: ClassVar[bool] = False
    _own_step: ClassVar[bool] = False
    #: The form its directions travel back from an owner rank in (``transfer.py``: ``"identity"``, ``"factors"``
    #: or ``"direction"``), derived per class by :func:`.transfer.form_of` from what it overrides, not declared.
    transfer_form: ClassVar[str] = transfer.IDENTITY
    #: Whether :meth:`post_factors`' row factors divide (``(U / row) * col``, NorMuon's division) rather than
    #: multiply; declared by a rule whose factors do.
    factors_divide: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._rewrites_input = cls.pre is not HiddenRule.pre
        cls._own_inputs = cls.inputs is not HiddenRule.inputs
        cls._own_step = cls.step_weights is not HiddenRule.step_weights
        cls.transfer_form = transfer.DIRECTION if cls._own_step else transfer.form_of(cls, HiddenRule)
        if cls.transposes and ("rows" in cls.state_views.values() or cls._own_step):
            raise TypeError(f"{cls.__name__}: per-row state or a step of its own needs transposes = False (rows "
                            "would change length; the weights keep their orientation)")

    def inputs(self, items: Sequence[Item], group: dict) -> list[Tensor]:
        """The direction inputs ``X`` of ``items`` (tensors of any shape: whole parameters, matrices of a view, or
        a DTensor's local pieces), the rule's state updated in place: here the driver's, ``B <- mu B + G`` and
        ``X = G + mu B`` (Nesterov) or ``B``. A rule whose input is another elementwise function of the gradient
        and its state (Muon-VS's variance-stabilised input) overrides it; it runs where the pieces lie, in
        ``torch._foreach_*`` kernels for all of a call's items in the batched forms, item by item per tensor. (The
        driver runs the default itself, from the unchanged momentum, :class:`Inputs`, and writes it with the step's
        other writes, :func:`write_inputs`.)"""
        bufs = [it.state["momentum_buffer"] for it in items]
        grads = grads_like(items, bufs)
        F.momentum_(bufs, grads, group["momentum"])
        return F.direction_input(grads, bufs, group["momentum"], group["nesterov"])

    def step_weights(self, W: Tensor, D: Tensor, scale: float, group: dict) -> None:
        """The step of a stack ``W`` ``(K, m, n)`` of whole matrices from their directions ``D`` (same shape), in
        place: here ``W <- (1 - lr wd) W - lr s D``, which the driver fuses over all of a step's tensors and never
        calls through this hook. A rule whose step reads the weights (MuonH's projection onto the sphere of each
        matrix's norm) overrides it; then its weights' pieces travel to the owner with ``X`` and come back
        stepped, where the matrices are not whole on one rank."""
        F.decay_and_update_(list(W.unbind(0)), list(D.unbind(0)), group["lr"], group["weight_decay"],
                            [scale] * W.shape[0])

    def pre(self, X: Tensor, group: dict, state: dict[str, Tensor] | None = None) -> Tensor:
        """The Newton-Schulz input from the direction input ``X`` ``(K, m, n)``: here ``X`` (the driver then
        skips the call). Must not write into ``X`` (without Nesterov it is the momentum buffer)."""
        return X

    def post(self, U: Tensor, group: dict, state: dict[str, Tensor] | None = None) -> Tensor:
        """The direction ``D`` ``(K, m, n)`` from ``U = Orth(X)``: here ``U``."""
        return U

    def post_all(self, Us: list[Tensor], group: dict, states: list[dict[str, Tensor]]) -> list[Tensor]:
        """:meth:`post` of every stack of a call (one per shape and orientation), called once: here one
        ``post`` each. A rule whose statistics can be taken for all matrices in a fixed number of kernels
        (MeqMuon's eq. 8) overrides it: on a GPU a step is launch-bound."""
        if type(self).post is HiddenRule.post:
            return Us
        return [self.post(U, group, st) if st else self.post(U, group) for U, st in zip(Us, states, strict=True)]

    def post_factors(self, Us: list[Tensor], group: dict,
                     states: list[dict[str, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """:meth:`post_all` as per-row and per-column factors, for a rule whose direction is ``(U * row) * col``
        (MeqMuon's eq. 8): per stack ``(row, col)``, ``(K, m, 1)`` and ``(K, 1, n)``, such that
        :func:`meqmuon.functional.apply_factors` gives ``post_all``'s ``D`` bit for bit, on the whole matrix or
        on any block of its rows or columns (``divide`` where the class sets :attr:`factors_divide`:
        ``(U / row) * col``); the state updated as ``post_all`` updates it. The public hook of ``transfer.py``:
        overriding it lets an owner rank send ``U`` in the Newton-Schulz dtype and the factors instead of ``D``; a
        rule that does not is still exact there, ``D`` travelling in float32."""
        raise NotImplementedError(f"{type(self).__name__} has no post_factors: its post is not (U * row) * col")

    def lr_scale(self, m: int, n: int, group: dict) -> float:
        """A step multiplier ``s`` of an ``m x n`` matrix, applied inside the update (``-lr s D``) instead
        of as a pass over ``D``; 1 here."""
        return 1.0

    def validate(self, group: dict) -> None:
        """``ns_steps`` an integer >= 1, ``ns_dtype`` a floating dtype or ``None``, ``ns_method`` a name of
        :data:`NS_METHODS`, ``ns_coefficients`` a form its schedule takes (the method's ``schedule``)."""
        positive_int("ns_steps", group["ns_steps"])
        float_dtype("ns_dtype", group["ns_dtype"])
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(f"Invalid ns_method: {group['ns_method']!r} (known methods: {', '.join(NS_METHODS)})")
        # the method's reading of ns_coefficients and ns_steps; raises ValueError naming the valid forms
        NS_METHODS[group["ns_method"]].schedule(group["ns_coefficients"], group["ns_steps"])


# ---- what the driver reads of a rule -------------------------------------------------------------


def needs_matrix(rule: Rule) -> bool:
    """The rule sees >=2-D tensors as matrices (every hidden rule; an elementwise or stepping rule that says so)."""
    return isinstance(rule, HiddenRule) or (isinstance(rule, MomentumRule | SteppingRule) and rule.needs_matrix)


def elementwise(rule: Rule) -> bool:
    """Each element's update depends on that element alone (a stepping rule that says so: AdamW)."""
    return isinstance(rule, SteppingRule) and rule.elementwise


def compiles(rule: Rule) -> bool:
    """``compile=True`` has a compiled form of the rule: the momentum rules (stepping rules run eagerly)."""
    return not isinstance(rule, SteppingRule)


def cost(rule: Rule, shape: Sequence[int], group: dict) -> float:
    """Estimated cost of one parameter's update, for balancing owners: the FLOPs of the group's Newton-Schulz
    method (hidden rules; :func:`method_flops`, the method's own record) plus :data:`ELEMENTWISE_COST` per
    element (every momentum rule); a stepping rule's, its size."""
    if isinstance(rule, SteppingRule):
        return float(math.prod(shape))
    ns = method_flops(group, *matrix_shape(shape)) if isinstance(rule, HiddenRule) else 0
    return ns + ELEMENTWISE_COST * math.prod(shape)


def state_elements(rule: Rule, layout: Layout) -> int:
    """Number of state elements (excluding scalar counters) a rule keeps for a parameter of ``layout``."""
    if isinstance(rule, SteppingRule):
        return rule.state_elements(layout)
    rows = sum(math.prod(layout.rows_shape) for how in rule.state_views.values() if how == "rows")
    buffers = sum(how == "param" for how in rule.state_views.values())  # the momentum, and Muon-VS's variance
    return buffers * math.prod(layout.batch) * layout.rows * layout.cols + rows


def init_state(rule: Rule, p: Tensor, state: dict[str, Any], group: dict, layout: Layout) -> None:
    """Create the state of parameter ``p``: a stepping rule's own; a momentum rule's from its
    ``state_views``: the momentum buffer (in the group's ``state_dtype``), per-row state (at least
    float32) and per-matrix counters (int64); ``state["step"]`` counted by the engine."""
    if isinstance(rule, SteppingRule):
        rule.init_state(p, state, group, layout)
        return
    state["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype(p, group), memory_format=torch.preserve_format)
    state["step"] = 0
    for key, how in rule.state_views.items():
        if how == "param" and key not in state:  # another parameter-shaped buffer (Muon-VS's variance)
            state[key] = torch.zeros_like(p, dtype=state_dtype(p, group), memory_format=torch.preserve_format)
        elif how == "rows":
            state[key] = state_like(p, layout.rows_shape, torch.promote_types(p.dtype, torch.float32),
                                    aligned=not layout.folded and (bool(layout.batch) or not layout.transposed))
        elif how == "counter":  # a whole matrix's counter is a plain tensor even under FSDP2
            state[key] = (state_like(p, layout.counter_shape, torch.int64, aligned=not layout.folded)
                          if layout.batch else torch.zeros(layout.counter_shape, dtype=torch.int64, device=p.device))


def cut_items(rule: Rule, layout: Layout, param: Tensor, grad: Tensor, state: dict[str, Any], name: str, kind: str,
              labels: Sequence[str], units: Sequence[int] | None = None) -> list[Item]:
    """One item per matrix of ``layout``'s view of ``param`` (:meth:`Layout.matrices`), with its gradient's and
    state's views (``rule.state_views`` says how each state tensor divides), named ``name + labels[j]``, each with
    its exchange unit (``units[j]``, ``placement.OWNERS``)."""
    pieces = {"param": layout.matrices, "rows": layout.row_pieces, "counter": layout.counters}
    per_key = {k: pieces[how](state[k]) for k, how in rule.state_views.items() if how in pieces}
    units = units or [-1] * len(labels)
    return [Item(p, g, {"step": state["step"], **{k: v[j] for k, v in per_key.items()}}, name + label, p.shape, kind,
                 units[j])
            for j, (p, g, label) in enumerate(zip(layout.matrices(param), layout.matrices(grad), labels, strict=True))]


def stack_items(rule: Rule, param: Tensor, grad: Tensor, state: dict[str, Any], name: str, kind: str,
                shape: Sequence[int], units: Sequence[int], held: tuple[int, int]) -> list[Item]:
    """One item per matrix of a stack, ``e`` of its ``len(units)`` (``placement.by_matrix``), named ``name[e]``, of
    global ``shape``, with its exchange unit ``units[e]``. This rank holds matrices ``[a, b)`` (``held``; all of them
    where no placement shards dimension 0): of those its local ``param[e - a]`` and its gradient's, of the others
    empty pieces, so that every rank steps every unit of the plan alike (the exchange's buckets pair up). Every state
    tensor of a stack leads with its matrices: sharded like the stack (the momentum), its local ``[e - a]`` or empty;
    whole on every rank (a per-matrix counter, ``distributed.state_like``: the owner reads its own), its ``[e]``."""
    keys = [k for k, how in rule.state_views.items() if how in ("param", "rows", "counter")]
    a, b = held
    whole = {k for k in keys if state[k].shape[0] == len(units)}
    # one empty piece of each tensor serves every matrix this rank does not hold (writes into it write nothing)
    none = {k: t.new_empty((0, *t.shape[2:])) for k, t in (("param", param), ("grad", grad), *state.items())
            if k in ("param", "grad") or (k in keys and k not in whole)} if (a, b) != (0, len(units)) else {}

    def piece(k: str, t: Tensor, e: int) -> Tensor:  # matrix e of a tensor sharded like the stack
        return t[e - a] if a <= e < b else none[k]

    return [Item(piece("param", param, e), piece("grad", grad, e),
                 {"step": state["step"], **{k: state[k][e] if k in whole else piece(k, state[k], e) for k in keys}},
                 f"{name}[{e}]", tuple(shape), kind, u) for e, u in enumerate(units)]


# ---- stacks: shape buckets and kept buffers ---------------------------------------------------------


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix an optimizer sees for a tensor of ``shape``: ``(shape[0], prod(rest))``."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))


class Bucket(NamedTuple):
    """Same-shape members of one rule call, stacked as ``(len(items), *shape)``: ``items[:plain]`` as they
    are, ``items[plain:]`` transposed. ``shape``: one member's (local) matrix view for matrix rules, else
    its own shape; ``global_shape`` the same unsharded; ``key`` what it was grouped by (stable across
    steps and ranks: workspaces use it)."""

    items: list[Item]
    plain: int
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    key: tuple


def make_buckets(items: Sequence[Item], *, matrix: bool, transpose: bool, by_shape: bool = True) -> list[Bucket]:
    """Group ``items`` into buckets in first-appearance order: the one place that groups by shape.

    The batched step works on stacks of same-shape tensors, so that momentum, Newton-Schulz, statistics
    and the update are a few kernels per bucket instead of per parameter (on a GPU a step is
    launch-bound; karpathy/nanochat, modded-nanogpt and microsoft/dion's megabatch group by shape too).

    Args:
        matrix: stack matrix views ``(shape[0], prod(rest))`` (matrix rules); else the tensors' shapes.
        transpose: let an ``(n, m)`` member join an ``(m, n)`` bucket transposed (Llama's ``down_proj``
            with ``gate_proj``); the first member of a key fixes the orientation (the parameter order,
            identical on every rank).
        by_shape: ``False`` groups by dtype and device only (AdamW's ``torch._foreach_*`` step).
    """
    found: dict[tuple, list[Item]] = {}
    flipped: dict[tuple, list[Item]] = {}
    orientation: dict[tuple, tuple[int, ...]] = {}
    for it in items:
        gshape = matrix_shape(it.shape) if matrix else tuple(it.shape)
        key = (it.param.dtype, it.param.device)
        if by_shape:
            key += (tuple(sorted(gshape)) if transpose else gshape,)
        first = orientation.setdefault(key, gshape)
        (found if not by_shape or gshape == first else flipped).setdefault(key, []).append(it)
    return [Bucket(members + flipped.get(key, []), len(members), *(
        matrix_shape(s) if matrix else tuple(s) for s in (members[0].param.shape, members[0].shape)), key)
        for key, members in found.items()]


def unstack(bucket: Bucket, stacks: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """The members' rows of a stack (or consecutive stacks) of directions, each row one member's
    direction in its own orientation, as views in the members' shapes (contiguous rows)."""
    rows = [r for s in ([stacks] if isinstance(stacks, Tensor) else stacks) for r in s.unbind(0)]
    return [t.view(it.param.shape) for t, it in zip(rows, bucket.items, strict=True)]


def buffer(scratch: dict[tuple, Tensor], role: str, shape: Sequence[int], dtype: torch.dtype = torch.float32,
           device: torch.device | None = None) -> Tensor:
    """A tensor for ``role`` kept in ``scratch`` (a step's, or the optimizer's workspace) and reused."""
    key = (role, tuple(shape), dtype, device)
    t = scratch.get(key)
    if t is None:
        t = scratch[key] = torch.empty(shape, dtype=dtype, device=device)
    return t


def drop_buffers(scratch: dict, role: Any) -> None:
    """Let go of the tensors :func:`buffer` keeps in ``scratch`` for ``role`` (a bucket's, once it is done)."""
    for key in [k for k in scratch if isinstance(k, tuple) and k and k[0] == role]:
        del scratch[key]


# ---- the seam ---------------------------------------------------------------------------------------


def resolve_dtype(group: dict, x: Tensor, ctx: Any) -> torch.dtype:
    """The Newton-Schulz dtype of ``x`` under ``group``'s ``ns_dtype`` (:func:`resolve_ns_dtype`: ``None``
    follows the device's native bf16), resolved once per optimizer and kept in its workspace."""
    key = ("ns_dtype", group["ns_dtype"], x.device)
    dtype = ctx.workspace.get(key)
    if dtype is None:
        dtype = ctx.workspace[key] = resolve_ns_dtype(group["ns_dtype"], x.device)
    return dtype


#: One stack for :func:`directions`: direction inputs ``(K, m, n)`` in the bucket's orientation, the
#: number of members stored as they are (the rest transposed), and the members' state stacks.
Stack = tuple[Tensor, int, dict[str, Tensor]]


def directions(rule: HiddenRule, stacks: list[Stack], group: dict, ctx: Any, *, batched: bool,
               scratch: dict | None = None, dtype: torch.dtype | None = None, ns_dtype: torch.dtype | None = None,
               release: bool = False, consume: bool = False, factored: bool = False,
               fresh: bool = False, ns: Callable[..., Tensor] | None = None) -> list[list[Any]]:
    """``pre -> Newton-Schulz -> post`` of stacks of direction inputs: the body of every form (``rule``, and ``ctx``).

    Per stack ``X`` ``(K, m, n)``: ``Y = rule.pre(X)`` (skipped where the rule keeps the identity), ``U =
    NS_METHODS[group["ns_method"]].function(Y)`` in the Newton-Schulz dtype, then for all ``D = rule.post_all(U)``.

    ``pre`` and ``post`` see each side of a stack (members as they are, members transposed) in its own
    orientation, a transposed view, no copy; Newton-Schulz runs whole stacks, ``batched`` as one
    batched call (the batched form; ``X`` is scratch) or matrix by matrix with fused ``addmm`` (the
    per-tensor form and the distributed owners: a matrix's bits never depend on its neighbours, which
    the bit-exact DDP split relies on); ``post`` runs once, after every stack's Newton-Schulz
    (:meth:`HiddenRule.post_all`). State stacks are handed over as views per side and updated in place.
    ``scratch``: the per-tensor form's buffers. ``dtype``: the parameters' dtype, to which a narrower
    (bf16) direction is cast. ``ns_dtype``: given by compiled graphs, which have no ``ctx``. ``release``: an
    owner's whole matrices, the step's only ones of their shape: Newton-Schulz's iteration buffers are let go
    before ``post`` instead of kept in ``scratch``, so that they and ``post``'s output are never alive at once.
    ``consume``: the stacks' ``X`` are scratch that nothing reads after Newton-Schulz starts (an owner's received
    whole matrices): where the rule keeps the identity ``pre``, matrix-by-matrix Newton-Schulz iterates each
    contiguous matrix already in its dtype in place (``inplace``: the first iterate is ``X``'s own buffer), so
    that the received bytes are not alive beside Newton-Schulz's copy of them; the same ops on the same values.
    The caller hands them over (keeps no reference): each entry of ``stacks`` loses its ``X`` once Newton-Schulz
    has run, so that the spent bytes are let go before ``post``. ``fresh``: the result in tensors of its own, not
    in ``scratch``'s buffers (the per-tensor form keeps every matrix's direction until the step's writes).
    ``factored`` (directions that travel as factors, ``transfer.FACTORS``): per side ``(U, row, col)``, ``U`` in its
    dtype with :meth:`~HiddenRule.post_factors`. ``ns``: in the method's place (a block's, ``shared_ns.SharedNS``).

    Args:
        rule: the ``HiddenRule``.
        stacks: per stack ``(X, plain, state)``: ``X`` ``(K, m, n)`` direction inputs in the bucket's
            orientation (scratch when ``batched``), ``plain`` how many lead as they are (the rest are
            transposed ``(n, m)`` members), ``state`` ``{key: (K, m) per-row or (K,) per-matrix}``.
        group: the param group (``ns_method``, ``ns_steps``, ``ns_coefficients``, ``ns_dtype``, the rule's keys).
        ctx: the call's ``StepContext`` (its workspace keeps the resolved dtype), or ``None`` with ``ns_dtype``.

    Returns:
        per stack, one contiguous stack per side, each member's direction in its own orientation:
        ``(plain, m, n)`` then ``(K - plain, n, m)``, in ``post_all``'s dtype, cast to ``dtype`` if that is wider.
    """
    us, states, owner = [], [], []
    iteration = {} if release else scratch  # Newton-Schulz's iterates and Gram buffers
    for i, (X, plain, state) in enumerate(stacks):
        k = X.shape[0]
        sides = [(s, flip) for s, flip in ((slice(0, plain), False), (slice(plain, k), True)) if s.stop > s.start]
        views = [{key: v[s] for key, v in state.items()} for s, _ in sides]
        if rule._rewrites_input:
            ys = [rule.pre(X[s].mT if flip else X[s], group, *([st] if st else []))
                  for (s, flip), st in zip(sides, views, strict=True)]
            ys = [y.mT if flip else y for y, (_, flip) in zip(ys, sides, strict=True)]
            X = torch.cat(ys) if len(ys) > 1 else ys[0]
        dt = ns_dtype or resolve_dtype(group, X, ctx)
        orthogonalize = ns or NS_METHODS[group["ns_method"]].function  # the one look-up of the method
        if batched:
            U = orthogonalize(X, group["ns_steps"], group["ns_coefficients"], dt, batched=True, inplace=True)
        else:
            out = None if scratch is None or fresh else buffer(scratch, "ns", X.shape, dt, X.device)
            # a pre's output may be any tensor the rule holds: only the handed-over X is iterated in place
            U = orthogonalize(X, group["ns_steps"], group["ns_coefficients"], dt, workspace=iteration, out=out,
                              inplace=consume and not rule._rewrites_input)
        if consume:  # spent: the stack's last reference goes, so that post never meets it
            stacks[i] = (None, plain, state)
            X = ys = None
        us += [U[s].mT if flip else U[s] for s, flip in sides]
        states += views
        owner += [i] * len(sides)
    del iteration
    if factored:  # per side (U, row, col): the factors of post_factors, each side in its members' orientation
        result = [[] for _ in stacks]
        for i, u, f in zip(owner, us, rule.post_factors(us, group, states), strict=True):
            result[i].append((u, *f))
        return result
    ds = rule.post_all(us, group, states)
    # One copy at most per side: the cast of a narrower direction and the transposed side's layout.
    narrower = dtype is not None and ds[0].dtype.itemsize < dtype.itemsize
    result: list[list[Tensor]] = [[] for _ in stacks]
    for i, d in zip(owner, ds, strict=True):
        result[i].append(d.to(dtype, memory_format=torch.contiguous_format) if narrower else d.contiguous())
    return result


# ---- the one body of a hidden rule's step -----------------------------------------------------------------

#: How an owner's compiled graph turns one stack into directions (``compiled.owner_directions``):
#: ``orth(rule, [X], state, group, ctx, batched=..., factored=...)`` -> ``(U, row, col)`` or ``(D, None, None)``.
Orth = Callable[..., tuple[Tensor, Tensor | None, Tensor | None]]


class Found(NamedTuple):
    """What :func:`bucket_directions` found, nothing of it written: per bucket, per member, its direction (or
    ``(U, row, col)``); the stacks that hold the directions (``bases``: a skipped step zeroes them, one kernel each,
    ``commit.update_``); and per key of the rule's per-matrix state ``(targets, news)``, the members' state
    tensors and their new values, which the caller writes (``commit.copy_``)."""

    directions: list[list[Any]]
    bases: list[Tensor]
    writes: list[tuple[list[Tensor], list[Tensor]]]


def bucket_directions(rule: HiddenRule, buckets: Sequence[Bucket], group: dict, ctx: StepContext, *, batched: bool,
                      inputs: Callable[[Sequence[Item]], list[Tensor]], dtype: torch.dtype | None = None,
                      orth: Orth | None = None, factored: bool = False, handed: list[Tensor] | None = None,
                      workspace: dict | None = None, ns: Callable[..., Tensor] | None = None) -> Found:
    """The one body of a hidden rule's step, wherever its matrices are whole: one process's, and an owner rank's
    (``exchange.py``: DDP's shared matrices, the whole matrices of FSDP2's and tensor parallelism's pieces).

    Per bucket the stack of its members' direction inputs ``inputs(bucket.items)`` in the bucket's orientation
    (members ``[:plain]`` as they are, the rest transposed; made a bucket at a time and let go once stacked), in
    the Newton-Schulz dtype (at least float32 for a rule with its own ``pre``), and of copies of their per-matrix
    state; then ``pre``, Newton-Schulz and ``post`` of all stacks at once (:func:`directions`: ``post_all`` once, a
    fixed number of kernels; ``batched``: one batched Newton-Schulz per stack), or ``orth`` stack by stack (the
    owners' compiled graphs). Writes nothing: returns per bucket, per member, its direction in its own orientation
    (cast to ``dtype`` where that is wider), or with ``factored`` ``(U, row, col)``: its ``U``, its ``(m,)`` row and
    ``(n,)`` column factors; and the new per-matrix state (:class:`Found`).

    At an owner (``exchange.py``) the stacks may be ``handed`` over, one per bucket, already made (the received
    whole matrices, put together in place): then nothing is copied, Newton-Schulz iterates in them and lets them
    go before ``post``, and its buffers are this call's (``directions``' ``consume`` and ``release``), so that an
    owner holds each whole matrix once and nothing of a bucket it is done with; ``workspace``: where the stacks
    are made otherwise (default the call's, kept to the step's end); ``ns``: :func:`directions`'."""
    members = [it for b in buckets for it in b.items]
    device = members[0].param.device
    workspace = ctx.workspace if workspace is None else workspace
    scalars = {k: F.on_device([it.state[k] for it in members], device) if how == "step" else
               torch.stack([it.state[k] for it in members]) for k, how in rule.state_views.items()
               if how in ("counter", "step")}
    stacks, o = [], 0
    for b in buckets:
        k = len(b.items)
        dt = F.stat_dtype(b.items[0].param) if rule._rewrites_input else resolve_dtype(group, b.items[0].param, ctx)
        state = {key: torch.stack([it.state[key] for it in b.items]) for key, how in rule.state_views.items()
                 if how == "rows"}
        state.update({key: v[o : o + k] for key, v in scalars.items()})
        if handed:
            X = handed.pop(0)
        else:
            xs = inputs(b.items)
            X = stack_inputs(workspace, (rule.name, ctx.call), b, xs, dt)
            del xs
        stacks.append((X, b.plain, state))
        del X
        o += k
    if orth is None:
        found = directions(rule, stacks, group, ctx, batched=batched, dtype=dtype, factored=factored, ns=ns,
                           **({"scratch": {}, "release": True, "consume": True} if handed is not None else {}))
    else:  # one graph per stack; the stack handed over (the graph's scratch)
        found = []
        for i, (X, plain, state) in enumerate(stacks):
            if plain != X.shape[0]:
                raise NotImplementedError("an owner's compiled graph takes one orientation: the exchange stacks "
                                          "each apart")
            stacks[i] = (None, 0, state)
            u, row, col = orth(rule, [X], state, group, ctx, batched=batched, factored=factored)
            del X
            found.append([(u, row, col) if factored else u])
    writes = []
    for key in rule._owner_state:
        targets = [it.state[key] for it in members]
        writes.append((targets, [row for _, _, state in stacks for row in state[key].unbind(0)]))
    if not factored:
        return Found([unstack(b, sides) for b, sides in zip(buckets, found, strict=True)],
                     [side for sides in found for side in sides], writes)
    return Found([[(u, r[:, 0], c[0]) for U, row, col in sides
                   for u, r, c in zip(U.unbind(0), row.unbind(0), col.unbind(0), strict=True)] for sides in found],
                 [], writes)


# ---- what every form uses --------------------------------------------------------------------------


def grads_like(items: Sequence[Item], like: Sequence[Tensor]) -> list[Tensor]:
    """The items' gradients in the dtypes of ``like`` (their momentum buffers, say)."""
    return [it.grad if it.grad.dtype == b.dtype else it.grad.to(b.dtype) for it, b in zip(items, like, strict=True)]


def direction_input(it: Item, group: dict, rows: slice = slice(None), out: Tensor | None = None) -> Tensor:
    """Rows ``rows`` of one item's direction input (:func:`F.direction_input`), into ``out`` if given:
    made on demand, so that no model-sized temporary exists and DDP owners make only their own."""
    b, g = it.state["momentum_buffer"], it.grad
    if rows != slice(None):  # a 0-D parameter (a vector of one element) cannot be sliced
        b, g = b[rows], g[rows]
    g = g if g.dtype == b.dtype else g.to(b.dtype)
    return F.direction_input([g], [b], group["momentum"], group["nesterov"], None if out is None else [out])[0]


def stack_inputs(workspace: dict, role: tuple, bucket: Bucket, xs: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """The members' direction inputs ``xs`` stacked (cast to ``dtype``) in a buffer of ``workspace`` (a call's:
    ``role`` names it, with the bucket's key), in the bucket's orientation: one ``stack`` reads the transposed
    members as strided views."""
    if len(bucket.shape) == 2:
        xs = [x.reshape(x.shape[0], -1) if x.ndim > 2 else x for x in xs]
    out = buffer(workspace, (*role, "inputs", bucket.key), (len(xs), *bucket.shape), dtype,
                 bucket.items[0].param.device)
    return torch.stack([*xs[: bucket.plain], *(x.mT for x in xs[bucket.plain :])], out=out)


def stack_tensors(ctx: StepContext, name: str, bucket: Bucket, tensors: Sequence[Tensor]) -> Tensor:
    """``tensors`` (one per member, not transposed) stacked in the bucket's workspace, at least float32."""
    t0 = tensors[0]
    out = buffer(ctx.workspace, (name, "inputs", ctx.call, bucket.key), (len(tensors), *bucket.shape),
                 torch.promote_types(t0.dtype, torch.float32), t0.device)
    return torch.stack([t.reshape(bucket.shape) for t in tensors], out=out)


def apply_update(items: Sequence[Item], directions: Sequence[Tensor], scales: Sequence[float], group: dict,
                 scratch: dict | None = None, gate: Gate | None = None) -> None:
    """``W <- (1 - lr wd) W - lr s D`` for each item (:func:`F.decay_and_update_`), mixed dtypes in the wider
    one as torch.optim.Muon's bf16 update of float32 weights; a narrower direction goes through a buffer
    of ``scratch``, since ``p.add_(d)`` would cast it through a fresh parameter-sized temporary. Same bits.
    ``gate``: the step's skip flag (``commit.update_``), which the writes of a step read: an elementwise rule's
    per-tensor ``update`` passes its context's, ``ctx.gate``."""
    for it, d, s in zip(items, directions, scales, strict=True):
        p = it.param
        d = d.reshape(p.shape)
        if scratch is not None and d.dtype != p.dtype and torch.promote_types(d.dtype, p.dtype) == p.dtype:
            d = buffer(scratch, "direction", p.shape, p.dtype, p.device).copy_(d)
        commit.update_([p], [d], group["lr"], group["weight_decay"], [s], gate=gate)


def cast(tensors: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """``tensors`` (on one device) in ``dtype``, as views of one new buffer, by one foreach copy: a kernel per chunk on
    a GPU, not one a tensor (a stack's experts as exchange units are thousands); the bits of ``.to(dtype)``."""
    buf = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    outs = [o.view(t.shape) for o, t in zip(buf.split([t.numel() for t in tensors]), tensors, strict=True)]
    torch._foreach_copy_(outs, list(tensors))
    return outs


@functools.cache
def _widens(narrow: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether ``narrow`` promotes to ``dtype`` (worked out once per pair, not once per direction: experts)."""
    return torch.promote_types(narrow, dtype) == dtype


def apply_pending(pending: Sequence[tuple[Tensor, Tensor, float]], group: dict, *, gate: Gate | None = None) -> None:
    """``W <- (1 - lr wd) W - lr s D`` for every ``(W, D, s)`` of one group's call, a narrower ``D`` (bf16 from an
    owner) widened first, as :func:`apply_update` does: one decay kernel and one add per distinct ``s``; a write
    of the step's commit (``gate``: its skip flag). Every ``D`` is the exchange's transient (views of what was
    received, or results made for this step), so a skipped step zeroes each storage they lie in, whole, once."""
    if pending:
        params, dirs, scales = zip(*pending, strict=True)
        dirs = [d.reshape(p.shape) for p, d in zip(params, dirs, strict=True)]
        wide: dict[tuple, list[int]] = {}
        for i, (p, d) in enumerate(zip(params, dirs, strict=True)):
            if d.dtype != p.dtype and _widens(d.dtype, p.dtype):
                wide.setdefault((p.dtype, d.device), []).append(i)
        for (dtype, _), idx in wide.items():  # one buffer, which a skipped step then zeroes in one kernel too
            for i, o in zip(idx, cast([dirs[i] for i in idx], dtype), strict=True):
                dirs[i] = o
        whole: dict[int, Tensor] = {}  # the storages they lie in (most in one receive buffer), each whole as bytes
        for d in dirs if gate is not None else ():
            storage = d.untyped_storage()
            if storage._cdata not in whole:  # the storage's own identity (a fresh wrapper each call)
                whole[storage._cdata] = d.new_empty(0, dtype=torch.uint8).set_(storage)
        commit.update_(list(params), dirs, group["lr"], group["weight_decay"], list(scales),
                       list(whole.values()) if gate is not None else None, gate=gate)
