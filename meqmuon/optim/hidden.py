"""Hidden matrices: the rule contract at the Newton-Schulz seam, and the one driver of every form.

A hidden rule is two functions over a stack ``X`` / ``U`` of ``K`` matrices ``(K, m, n)``, every
matrix in its own orientation (rows of its matrix view are rows), as microsoft/dion cuts its Muon
into pre- and post-orthogonalisation:

    X = rule.pre(X, group)      the Newton-Schulz input (default: unchanged; MuonEq equilibrates)
    U = Orth(X)                 quintic Newton-Schulz (paper eq. 3), the driver's
    D = rule.post(U, group)     the direction (MeqMuon: eq. 8; NorMuon: its row normalisation)
    W <- (1 - lr wd) W - lr s D with s = rule.lr_scale(m, n, group) (1 unless the rule says otherwise)

Everything else is the driver's (:func:`directions`, called by every form): momentum, stacking the
direction inputs by shape, which members share a Newton-Schulz stack transposed (it hands ``pre``
and ``post`` each orientation separately, so no rule sees a transposed member), the DDP split and
gather, the FSDP2 all-to-all and the update. The forms are the same body:

- per-tensor (``foreach=False``): each matrix is a stack of one, made just before its
  Newton-Schulz (no model-sized temporary), Newton-Schulz matrix by matrix;
- batched (``foreach=True``): one stack per shape bucket, one batched Newton-Schulz call each;
- compiled (``compile=True``): :func:`compiled_step`, momentum to update, under ``torch.compile``,
  one graph per bucket (per shape for the per-tensor form);
- DDP: each rank computes a slice of each bucket (per-tensor: whole matrices it owns) and the
  directions are gathered (per-tensor: the updated parameters broadcast);
- FSDP2: a bucket's row shards go to owner ranks by one all-to-all, the owners run
  ``pre -> Newton-Schulz -> post`` on whole matrices, a second all-to-all brings the rows back
  (:meth:`ShardedSplit.at_owners`), so a rule never needs a sum over shards.

State: a rule that keeps per-matrix state names it in ``state_views`` (``"rows"``: one float per
matrix row, such as NorMuon's second moment; ``"counter"``: one int64 per matrix, such as MeqMuon's
selection count; ``"step"``: the step count, read only) and then receives ``state``, a dict of
stacks ``(K, ...)`` in the order of ``U``, in ``pre(X, group, state)`` and ``post(U, group, state)``;
it updates them in place and the driver stores them.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import functional as F
from . import compiled
from . import newton_schulz as NS
from .buckets import make_buckets, matrix_shape
from .distributed import local, state_like
from .step import (
    MomentumRule,
    _foreach_apply,
    _update_momentum,
    apply_update,
    buffer,
    direction_input,
    stack_inputs,
)

__all__ = ["HiddenRule", "directions"]


class HiddenRule(MomentumRule):
    """A rule for hidden matrices: ``post(Orth(pre(X)))`` (see the module docstring).

    Subclass it, set ``name`` and override :meth:`post` (and :meth:`pre` if the rule changes the
    Newton-Schulz input); pass an instance as ``rules={"hidden": MyRule()}`` to any optimizer.
    """

    needs_matrix = True
    hyperparameters = ("momentum", "nesterov", "rho", "ns_steps", "ns_coefficients", "ns_dtype")
    #: Per-matrix state (see the module docstring); the momentum buffer is the driver's.
    state_views: ClassVar[dict[str, str]] = {"momentum_buffer": "param"}
    #: May an ``(n, m)`` matrix share the Newton-Schulz stack of ``(m, n)`` matrices, transposed? It is
    #: exact for every rule (the driver hands ``pre``/``post`` each orientation apart); it saves a
    #: Newton-Schulz stack and costs a second ``pre``/``post`` call, so rules whose ``pre``/``post``
    #: cost more kernels than the iteration may say no. Per-row state cannot: its rows would change length.
    transposes: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.owner_state = tuple(k for k, how in cls.state_views.items() if how in ("rows", "counter"))
        if cls.transposes and "rows" in cls.state_views.values():
            raise TypeError(f"{cls.__name__}: per-row state needs transposes = False (rows would change length)")

    def pre(self, X: Tensor, group: dict, state: dict[str, Tensor] | None = None) -> Tensor:
        """The Newton-Schulz input from the direction input ``X`` ``(K, m, n)``: here ``X``. Must not
        write into ``X`` (without Nesterov it is the momentum buffer)."""
        return X

    def post(self, U: Tensor, group: dict, state: dict[str, Tensor] | None = None) -> Tensor:
        """The direction ``D`` ``(K, m, n)`` from ``U = Orth(X)``: here ``U``."""
        return U

    def post_all(self, Us: list[Tensor], group: dict, states: list[dict[str, Tensor]]) -> list[Tensor]:
        """:meth:`post` of several stacks (one per shape and orientation of a step), called by the driver
        once per step; here one ``post`` each. A rule whose statistics can be taken for all matrices in
        a fixed number of kernels (MeqMuon's eq. 8) overrides it: on a GPU a step is launch-bound."""
        return [_call(self.post, U, group, st) for U, st in zip(Us, states, strict=True)]

    def lr_scale(self, m: int, n: int, group: dict) -> float:
        """A step multiplier ``s`` of an ``m x n`` matrix, applied inside the update (``-lr s D``) instead
        of as a pass over ``D``; 1 here."""
        return 1.0

    # ---- what the engine asks of every rule ----------------------------------------------------

    def state_elements(self, layout):
        return super().state_elements(layout) + sum(
            math.prod(layout.rows_shape) for how in self.state_views.values() if how == "rows")

    def init_state(self, p, state, group, layout):
        super().init_state(p, state, group, layout)
        for key, how in self.state_views.items():
            if how == "rows":
                state[key] = state_like(p, layout.rows_shape, torch.promote_types(p.dtype, torch.float32))
            elif how == "counter":  # a whole matrix's counter is a plain tensor even under FSDP2
                state[key] = state_like(p, layout.counter_shape, torch.int64) if layout.batch else torch.zeros(
                    layout.counter_shape, dtype=torch.int64, device=p.device)

    def cost(self, shape, group):
        return NS.ns_flops(*matrix_shape(shape), group["ns_steps"]) + super().cost(shape, group)

    def step(self, items, group, ctx):
        if not ctx.split.sharded:
            super().step(items, group, ctx)
            return
        # FSDP2: whole matrices meet at owner ranks, a shape bucket at a time, in both forms
        _update_momentum(items, group)
        _foreach_apply([self.pending_foreach(items, group, ctx)])

    def update(self, items, group, ctx):
        """Per-tensor form: every matrix a stack of one, made just before its Newton-Schulz."""
        if ctx.compile:
            compiled_step(self, items, group, per_tensor=True)
            return
        scratch: dict[tuple, Tensor] = {}
        for it in items:
            b = local(it.state["momentum_buffer"])
            X = F.as_matrix(direction_input(it, group, out=buffer(scratch, "nesterov", b.shape, b.dtype, b.device)))
            ((D,),) = directions(self, [(X[None], 1, self.state_of([it]))], group, batched=False,
                                 workspace=ctx.split.workspace, scratch=scratch)
            apply_update([it], [D[0]], [self.lr_scale(*matrix_shape(it.shape), group)], group, scratch)

    def state_of(self, items, kinds: tuple[str, ...] = ("rows", "counter", "step")) -> dict[str, Tensor]:
        """The per-matrix state of ``items`` as stacks (one item: views of the state itself), of ``kinds``."""
        out = {}
        for key, how in self.state_views.items():
            if how not in kinds:
                continue
            if how == "step":
                out[key] = torch.tensor([it.state[key] for it in items], device=items[0].param.device)
            elif how != "param":
                vals = [local(it.state[key]) for it in items]
                out[key] = vals[0][None] if len(vals) == 1 else torch.stack(vals)
        return out

    def directions_foreach(self, buckets, ranges, group, ctx):
        """Batched form: per bucket the stack of members ``lo..hi``, then :func:`directions` of all."""
        # Per-matrix values (counters, steps): one stack for all buckets, each bucket's a view of it.
        scalars = self.state_of([it for b, (lo, hi) in zip(buckets, ranges, strict=True) for it in b.items[lo:hi]],
                                ("counter", "step"))
        stacks, o = [], 0
        for b, (lo, hi) in zip(buckets, ranges, strict=True):
            p = b.items[0].param
            carry = ctx.split.sharded or type(self).pre is not HiddenRule.pre  # pre works in float32
            X = stack_inputs(ctx, self.name, b, lo, hi, group, F._stat_dtype(p) if carry else NS.ns_dtype_of(group, p))
            state = {**self.state_of(b.items[lo:hi], ("rows",)), **{k: v[o : o + hi - lo] for k, v in scalars.items()}}
            stacks.append((X, max(0, min(b.plain - lo, hi - lo)), state))
            o += hi - lo
        if ctx.split.sharded:
            ds = [_at_owners(self, X, state, b.global_shape[0], group, ctx)
                  for (X, _, state), b in zip(stacks, buckets, strict=True)]
        else:
            ds = directions(self, stacks, group, batched=True, dtype=buckets[0].items[0].param.dtype)
        return [(D, [state[k] for k in self.owner_state]) for D, (_, _, state) in zip(ds, stacks, strict=True)]

    def scale_foreach(self, bucket, group):
        return self.lr_scale(*bucket.global_shape, group)

    def empty_directions(self, bucket):
        p = bucket.items[0].param
        D = torch.empty((0, math.prod(bucket.shape)), dtype=p.dtype, device=p.device)
        return D, [torch.empty((0, *t.shape[1:]), dtype=t.dtype, device=p.device) for t in self.owner_stacks(bucket)]

    def owner_stacks(self, bucket):
        return [local(bucket.items[0].state[k])[None] for k in self.owner_state]

    def store_foreach(self, buckets, extras):
        for j, key in enumerate(self.owner_state):
            states = [local(it.state[key]) for b in buckets for it in b.items]
            torch._foreach_copy_(states, [s for owned in extras for s in owned[j].to(states[0].dtype).unbind(0)])

    def step_compiled(self, items, group, ctx):
        """``compile=True`` with ``foreach=True``: :func:`compiled_step` per bucket (one process)."""
        if ctx.split.world_size > 1:
            raise NotImplementedError(
                "compile=True with foreach=True is one process only (DDP/FSDP2 gather between the directions and "
                "the update); use foreach=True without compile, or compile=True with foreach=False")
        if ctx.capture is not None:
            raise NotImplementedError("the capture hook needs the eager step: build the optimizer without compile=True")
        compiled_step(self, items, group, per_tensor=False)


def _sides(plain: int, k: int) -> list[tuple[slice, bool]]:
    """The members stored as they are (``[:plain]``) and the transposed ones, the empty side left out."""
    return [(s, flip) for s, flip in ((slice(0, plain), False), (slice(plain, k), True)) if s.stop > s.start]


def _call(fn, T: Tensor, group: dict, state: dict[str, Tensor]) -> Tensor:
    """``fn(T, group, state)``, or ``fn(T, group)`` for a rule without state (a variant's two-argument form)."""
    return fn(T, group, state) if state else fn(T, group)


#: One stack for :func:`directions`: direction inputs ``(K, m, n)`` in the bucket's orientation, the
#: number of members stored as they are (the rest transposed), and the members' state stacks.
Stack = tuple[Tensor, int, dict[str, Tensor]]


def directions(rule: HiddenRule, stacks: list[Stack], group: dict, *, batched: bool, workspace: dict | None = None,
               scratch: dict | None = None, dtype: torch.dtype | None = None) -> list[list[Tensor]]:
    """``pre -> Newton-Schulz -> post`` of stacks of direction inputs: the driver of every form.

    ``pre`` and ``post`` see each side of a stack (members stored as they are, members transposed) in
    its own orientation, a transposed view, no copy; Newton-Schulz runs whole stacks
    (:func:`newton_schulz.orthogonalize`); ``post`` runs after every stack's Newton-Schulz, as one
    :meth:`HiddenRule.post_all` call. State stacks are handed over as views (per side) and updated in
    place by the rule. ``dtype``: the parameters' dtype, to which a narrower (bf16) direction is cast.

    Returns:
        per stack, one contiguous stack per side, each member's direction in its own orientation (a
        member's update is a view of it, and ``torch._foreach_*`` keeps to its fast path).
    """
    us, states, owner = [], [], []
    for i, (X, plain, state) in enumerate(stacks):
        sides = _sides(plain, X.shape[0])
        views = [{k: v[s] for k, v in state.items()} for s, _ in sides]
        if type(rule).pre is not HiddenRule.pre:
            ys = [_call(rule.pre, X[s].mT if flip else X[s], group, st)
                  for (s, flip), st in zip(sides, views, strict=True)]
            ys = [y.mT if flip else y for y, (_, flip) in zip(ys, sides, strict=True)]
            X = torch.cat(ys) if len(ys) > 1 else ys[0]
        out = None if scratch is None else buffer(scratch, "ns", X.shape, NS.ns_dtype_of(group, X), X.device)
        U = NS.orthogonalize(X, group, batched=batched, workspace=workspace, out=out)
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


def _at_owners(rule: HiddenRule, X: Tensor, state: dict[str, Tensor], m: int, group: dict, ctx) -> list[Tensor]:
    """FSDP2: row shards ``X`` ``(k, rows, n)`` of ``k`` matrices with ``m`` rows -> whole matrices at
    owner ranks -> :func:`directions` there -> the rows of ``D`` back. Per-row state travels as extra
    columns of the rows, per-matrix state as a column of all rows (a rank with no rows gets it too);
    ``state`` is updated in place."""
    k, rows, n = X.shape
    keys = list(state)
    per_row = [rule.state_views[key] == "rows" for key in keys]
    dtype = X.dtype if keys else NS.ns_dtype_of(group, X)
    out_dtype = torch.promote_types(dtype, torch.float32)

    def columns(st: dict[str, Tensor], j: int, length: int, dt: torch.dtype) -> list[Tensor]:
        return [st[key].to(dt)[..., None] if row else st[key].to(dt)[:, None, None].expand(j, length, 1)
                for key, row in zip(keys, per_row, strict=True)]

    def whole(W: Tensor) -> Tensor:
        j = W.shape[0]
        st = {key: _column(W, n + i, row, state[key].dtype)
              for i, (key, row) in enumerate(zip(keys, per_row, strict=True))}
        if ctx.compile:  # the owners' directions as one graph per stack shape
            static = {k: group[k] for k in rule.hyperparameters if k != "momentum"}
            static["ns_dtype"] = NS.ns_dtype_of(group, W)
            D = compiled.bucket_step(rule.name, _owner_body, (tuple(W.shape), W.dtype, id(rule)), W, st, rule=rule,
                                     n=n, batched=NS.batched_ns(W.device), group=static)
        else:
            (D,) = directions(rule, [(W[..., :n], j, st)], group, batched=NS.batched_ns(W.device),
                              workspace=ctx.split.workspace)
        return torch.cat([D[0].reshape(j, m, n).to(out_dtype), *columns(st, j, m, out_dtype)], dim=-1)

    send = torch.cat([X.to(dtype), *columns(state, k, rows, dtype)], dim=-1)
    back = ctx.split.at_owners(send, whole, m, n + len(keys), out_dtype, NS.ns_flops(m, n, group["ns_steps"]))
    for i, (key, row) in enumerate(zip(keys, per_row, strict=True)):
        state[key].copy_(_column(back[:, :rows] if row else back, n + i, row, state[key].dtype))
    return [back[:, :rows, :n]]


def _column(W: Tensor, c: int, per_row: bool, dtype: torch.dtype) -> Tensor:
    """State carried as column ``c`` of row stacks ``W`` ``(k, rows, width)``: per row, or per matrix (row 0)."""
    v = W[..., c] if per_row else W[:, 0, c]
    return v.to(dtype) if dtype.is_floating_point else v.round().to(dtype)


# ---- compile=True --------------------------------------------------------------------------------


def _owner_body(W, state, *, rule, n, batched, group):
    """FSDP2 owners' :func:`directions` of whole matrices (with their state columns), for ``torch.compile``."""
    (D,) = directions(rule, [(W[..., :n], W.shape[0], state)], group, batched=batched)
    return D


def _bucket_body(params, grads, bufs, states, steps, lr, wd, mu, scale, *, rule, plain, nesterov, batched, group):
    """The driver's step of one bucket, momentum to update, as one function for ``torch.compile``."""
    grads = [g.to(b.dtype) for g, b in zip(grads, bufs, strict=True)]
    if batched:  # the per-tensor form's momentum is updated before (and its buffers are owners' too)
        F.momentum_(bufs, grads, mu)
    inputs = [x.reshape(x.shape[0], -1) for x in F.direction_input(grads, bufs, mu, nesterov)]
    X = torch.stack(inputs[:plain] + [x.mT for x in inputs[plain:]])
    state = {k: torch.stack(v) for k, v in states.items()}
    if steps is not None:
        state["step"] = steps
    (D,) = directions(rule, [(X, plain, state)], group, batched=batched)
    for k, v in states.items():
        torch._foreach_copy_(v, list(state[k].to(v[0].dtype).unbind(0)))
    rows = [r for d in D for r in d.unbind(0)]
    F.decay_and_update_(params, [d.reshape(p.shape) for d, p in zip(rows, params, strict=True)], lr, wd, scale)


def compiled_step(rule: HiddenRule, items, group: dict, *, per_tensor: bool) -> None:
    """:func:`_bucket_body` compiled once per bucket (:func:`compiled.bucket_step`): per shape bucket,
    or with ``per_tensor`` per matrix (momentum already updated; same-shape matrices share a graph), so
    that a matrix's bits do not depend on its neighbours (the DDP owners rely on it)."""
    static = {k: group[k] for k in rule.hyperparameters if k not in ("momentum",)}
    static["ns_dtype"] = NS.ns_dtype_of(group, items[0].param)
    lr, wd, mu = (compiled.scalar(group[k]) for k in ("lr", "weight_decay", "momentum"))
    buckets = [make_buckets([it], matrix=True, transpose=False)[0] for it in items] if per_tensor else make_buckets(
        items, matrix=True, transpose=rule.transposes)
    for b in buckets:
        keys = [k for k, how in rule.state_views.items() if how in ("rows", "counter")]
        states = {k: [local(it.state[k]) for it in b.items] for k in keys}
        steps = rule.state_of(b.items).get("step")
        scale = compiled.scalar(rule.lr_scale(*b.global_shape, group))
        compiled.bucket_step(rule.name, _bucket_body, (b.key, id(rule), tuple(it.param.ndim for it in b.items)),
                             [it.param.detach() for it in b.items],
                             [it.grad for it in b.items], [local(it.state["momentum_buffer"]) for it in b.items],
                             states, steps, lr, wd, mu, scale, rule=rule, plain=b.plain, nesterov=group["nesterov"],
                             batched=not per_tensor, group=static)
