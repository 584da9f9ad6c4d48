"""The Newton-Schulz seam: what a hidden rule is (:class:`HiddenRule`: ``pre``, ``post``, ``lr_scale``, its
Newton-Schulz hyperparameters), ``pre -> Newton-Schulz -> post`` of stacks of matrices (:func:`directions`),
the one body of every form of every hidden rule, and the table of Newton-Schulz methods it looks up.

A method is one entry of :data:`NS_METHODS` (a group's ``ns_method``, validated by ``HiddenRule``), as
optax's ``ns_iterators`` and microsoft/dion's ``newton_schulz_func``: a function of ``functional.py`` with
:func:`meqmuon.functional.orthogonalize`'s signature. Adding one is that function and its entry here.
Besides: its cost (:func:`ns_flops`, for balancing DDP owners) and the devices where a shape bucket
runs as one batched call (:data:`BATCHED_NS_DEVICES`, FSDP2's owners). The driver (``driver.py``), its
compiled graphs (``compiled.py``) and the FSDP2 owners (``sharded.py``) call :func:`directions`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import functional as F
from ..precision import resolve_ns_dtype
from .calls import Item
from .inputs import float_dtype, positive_int
from .rule import MomentumBase

__all__ = ["BATCHED_NS_DEVICES", "NS_METHODS", "Bucket", "HiddenRule", "Stack", "batched_ns", "buffer", "directions",
           "make_buckets", "matrix_shape", "ns_flops", "resolve_dtype", "unstack"]

#: Newton-Schulz methods by name, a group's ``ns_method`` (default ``"quintic"``). Each is called as
#: ``f(X, steps, coefficients, dtype, *, batched, inplace, workspace, out)`` with ``X`` a stack ``(K, m, n)``
#: (:func:`meqmuon.functional.orthogonalize`'s signature) and returns ``Orth(X)`` ``(K, m, n)`` in ``dtype``:
#: ``batched`` one batched call for the stack (``X`` scratch if ``inplace``), else matrix by matrix into
#: ``out`` with buffers kept in ``workspace``.
#: ``"quintic"``: paper eq. 3, fixed coefficients (Jordan et al.) or Polar Express's schedule (``ns_coefficients``).
#: ``"gram"``: the same iteration on the Gram matrix with a restart (:func:`meqmuon.functional.gram_orthogonalize`).
#: ``"aol"``: AOL-preconditioned, ``ns_steps - 1`` iterations (:func:`meqmuon.functional.aol_orthogonalize`).
NS_METHODS: dict[str, Callable[..., Tensor]] = {"quintic": F.orthogonalize, "gram": F.gram_orthogonalize,
                                                "aol": F.aol_orthogonalize}

#: Device types on which same-shape matrices are orthogonalised as one batched call (a stack per
#: shape bucket; ``functional.orthogonalize(batched=True)``). GPUs: one matmul kernel per matrix is
#: launch-bound for small models (Llama-60M has 56 hidden matrices, so 840 matmul launches per
#: step), and GPU Muon implementations batch by shape (microsoft/dion's megabatch, modded-nanogpt, nanochat); not yet
#: timed on a GPU. CPU: one ``addmm`` per matrix is faster (docs/benchmarks.md), and it makes a
#: matrix's bits independent of the batch it travels in, which the bit-exact DDP split relies on.
BATCHED_NS_DEVICES: frozenset[str] = frozenset({"cuda"})


def batched_ns(device: torch.device) -> bool:
    """Whether Newton-Schulz runs a shape bucket as one batched call on ``device``."""
    return device.type in BATCHED_NS_DEVICES


def ns_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` quintic Newton-Schulz iterations on an ``m x n`` matrix (wide orientation).

    Per iteration with ``a = min(m, n)``, ``b = max(m, n)``: ``A = X X^T`` (``2 a^2 b``),
    ``A A`` (``2 a^3``) and ``B X`` (``2 a^2 b``).
    """
    a, b = min(m, n), max(m, n)
    return steps * (4 * a * a * b + 2 * a**3)


# ---- the protocol of a hidden rule -------------------------------------------------------------


class HiddenRule(MomentumBase):
    """A rule for hidden matrices: ``D = post(Orth(pre(X)))``, stepped as ``W <- (1 - lr wd) W - lr s D``.

    Subclass it, set ``name`` and override :meth:`post` (and :meth:`pre` if the rule changes the
    Newton-Schulz input); pass an instance as ``rules={"hidden": MyRule()}`` to any optimizer. Every
    name a subclass sees is one it may override or declare; the driver (``driver.py``) does the rest in
    every form (per-tensor, batched, compiled; DDP, FSDP2, tensor parallel). ``pre`` and ``post`` get
    stacks ``(K, m, n)`` of matrices, each stack in one orientation, and the per-matrix state of
    ``state_views`` as stacks in the same order, to update in place.
    """

    defaults = {"ns_steps": F.NS_STEPS, "ns_coefficients": F.NS_COEFFICIENTS, "ns_dtype": None, "ns_method": "quintic"}
    #: May an ``(n, m)`` matrix share the Newton-Schulz stack of ``(m, n)`` matrices, transposed? Exact for
    #: every rule (``pre``/``post`` see each orientation apart); it saves a Newton-Schulz stack and costs a
    #: second ``pre``/``post`` call. Per-row state cannot: its rows would change length.
    transposes: ClassVar[bool] = True
    #: Whether the class overrides :meth:`pre` (set per class; :func:`directions` skips the identity ``pre``,
    #: and the batched form stacks the inputs of a rule that rewrites them in float32). Derived, not declared.
    _rewrites_input: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._rewrites_input = cls.pre is not HiddenRule.pre
        if cls.transposes and "rows" in cls.state_views.values():
            raise TypeError(f"{cls.__name__}: per-row state needs transposes = False (rows would change length)")

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

    def lr_scale(self, m: int, n: int, group: dict) -> float:
        """A step multiplier ``s`` of an ``m x n`` matrix, applied inside the update (``-lr s D``) instead
        of as a pass over ``D``; 1 here."""
        return 1.0

    def validate(self, group: dict) -> None:
        """``ns_steps`` an integer >= 1, ``ns_coefficients`` a form :func:`F.ns_schedule` takes, ``ns_dtype``
        a floating dtype or ``None``, ``ns_method`` a name of :data:`NS_METHODS`."""
        positive_int("ns_steps", group["ns_steps"])
        F.ns_schedule(group["ns_coefficients"], group["ns_steps"])  # raises ValueError naming the valid forms
        float_dtype("ns_dtype", group["ns_dtype"])
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(f"Invalid ns_method: {group['ns_method']!r} (known methods: {', '.join(NS_METHODS)})")


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
               scratch: dict | None = None, dtype: torch.dtype | None = None,
               ns_dtype: torch.dtype | None = None) -> list[list[Tensor]]:
    """``pre -> Newton-Schulz -> post`` of stacks of direction inputs: the body of every form, for a
    ``HiddenRule`` ``rule`` (``driver.py``) and the ``StepContext`` ``ctx`` of its call.

    Per stack ``X`` ``(K, m, n)``: ``Y = rule.pre(X)`` (skipped where the rule keeps the default, the
    identity), ``U = NS_METHODS[group["ns_method"]](Y)`` in the Newton-Schulz dtype, then once for all
    stacks ``D = rule.post_all(U)``.

    ``pre`` and ``post`` see each side of a stack (members as they are, members transposed) in its own
    orientation, a transposed view, no copy; Newton-Schulz runs whole stacks, ``batched`` as one
    batched call (the batched form; ``X`` is scratch) or matrix by matrix with fused ``addmm`` (the
    per-tensor form and the distributed owners: a matrix's bits never depend on its neighbours, which
    the bit-exact DDP split relies on); ``post`` runs once, after every stack's Newton-Schulz
    (:meth:`HiddenRule.post_all`). State stacks are handed over as views per side and updated in place.
    ``scratch``: the per-tensor form's buffers. ``dtype``: the parameters' dtype, to which a narrower
    (bf16) direction is cast. ``ns_dtype``: given by compiled graphs, which have no ``ctx``.

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
        orthogonalize = NS_METHODS[group["ns_method"]]  # the one look-up of the method
        if batched:
            U = orthogonalize(X, group["ns_steps"], group["ns_coefficients"], dt, batched=True, inplace=True)
        else:
            out = None if scratch is None else buffer(scratch, "ns", X.shape, dt, X.device)
            U = orthogonalize(X, group["ns_steps"], group["ns_coefficients"], dt, workspace=scratch, out=out)
        us += [U[s].mT if flip else U[s] for s, flip in sides]
        states += views
        owner += [i] * len(sides)
    ds = rule.post_all(us, group, states)
    # One copy at most per side: the cast of a narrower direction and the transposed side's layout.
    narrower = dtype is not None and ds[0].dtype.itemsize < dtype.itemsize
    result: list[list[Tensor]] = [[] for _ in stacks]
    for i, d in zip(owner, ds, strict=True):
        result[i].append(d.to(dtype, memory_format=torch.contiguous_format) if narrower else d.contiguous())
    return result
