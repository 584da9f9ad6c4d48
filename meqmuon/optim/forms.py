"""The eager forms of a step: per tensor and batched, as torch's ``_single_tensor_adam`` / ``_multi_tensor_adam``.

Both take a sequence of a step's rule calls ``(rule, items, group, ctx)`` and run them in two phases (issue 56: every
step all or nothing): first every direction, from direction inputs made from the unchanged momentum
(:class:`Inputs`), through the seam of ``driver.py`` (:func:`driver.bucket_directions`), writing nothing; then the
writes, queued on the step's commit (``commit.py``): the momentum (:func:`write_inputs`), the per-matrix state and
the parameters' steps, each folded with the step's skip flag.

- :func:`per_tensor` (``foreach=False``): each matrix a stack of one, made just before its Newton-Schulz, its
  direction kept (as ``U`` with its factors where that is fewer bytes, :func:`held_factored`);
- :func:`batched` (``foreach=True``): the inputs a shape bucket at a time in ``torch._foreach_*`` kernels, one
  batched Newton-Schulz per bucket, ``post`` once for all stacks, one update for all calls.

``compiled.py`` has the same two forms with graphs inside, and ``exchange.py`` the forms of matrices that are not
whole on one rank; both make their inputs with :class:`Inputs` and their writes with :func:`write_inputs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from . import commit, transfer
from .calls import Item, StepContext
from .commit import Gate
from .driver import (
    Call,
    HiddenRule,
    bucket_directions,
    buffer,
    direction_input,
    directions,
    grads_like,
    make_buckets,
    needs_matrix,
    resolve_dtype,
    stack_inputs,
    unstack,
)
from .rule import MomentumRule, Rule

__all__ = ["Inputs", "batched", "keep_directions", "naming", "per_tensor", "step_weights", "stepped_weights",
           "write_inputs"]


# ---- the first phase: direction inputs from the unchanged momentum, and the momentum's write ----------------


class Inputs:
    """The direction inputs ``X`` of one call's items in a step's first phase, from the gradients and the state as
    they are: nothing is written here (the momentum is written with the step's other writes, :func:`write_inputs`).

    ``inputs(items)``: the items' inputs in ``torch._foreach_*`` kernels (the batched forms call it per shape
    bucket, so that at most one bucket's inputs and their new momentum are alive at once); ``inputs.one(item,
    out)``: one item's, into ``out`` where given (the per-tensor forms). The default inputs compute the new momentum
    ``B' = mu B + G`` (paper eq. 6) into a transient, with the kernels that write it later (the same bits: batched
    two ``_foreach`` kernels, per tensor one fused pass, ``F.momentum_``), and ``X = G + mu B'`` (Nesterov) or ``B'``.
    A rule with inputs of its own (:meth:`HiddenRule.inputs`, Muon-VS's) runs them on copies of its state.
    ``emit``: hand every input to the call's capture hook (``ctx.capture``), as they are made."""

    def __init__(self, rule: Rule, group: dict, ctx: StepContext | None = None, emit: bool = False) -> None:
        self.rule, self.group, self.ctx = rule, group, ctx
        self.own = getattr(rule, "_own_inputs", False)
        self.emit = emit and ctx is not None and ctx.capture is not None

    def _keys(self, it: Item) -> list[str]:
        return [k for k, how in self.rule.state_views.items() if how == "param"]

    def __call__(self, items: Sequence[Item]) -> list[Tensor]:
        if not items:
            return []
        if self.own:
            copies, _ = commit.shadow_items([(it, None) for it in items], self._keys, with_param=False)
            xs = self.rule.inputs(copies, self.group)
        else:
            mu, nesterov = self.group["momentum"], self.group["nesterov"]
            bufs = [it.state["momentum_buffer"] for it in items]
            grads = grads_like(items, bufs)
            new = torch._foreach_mul(bufs, mu)
            torch._foreach_add_(new, grads)
            xs = F.direction_input(grads, new, mu, nesterov)
        if self.emit:
            self.ctx.emit(items, xs, "momentum_input")
        return xs

    def one(self, it: Item, out: Tensor | None = None) -> Tensor:
        if self.own:
            copies, _ = commit.shadow_items([(it, None)], self._keys, with_param=False)
            x = self.rule.inputs(copies, self.group)[0]
        else:
            mu, nesterov = self.group["momentum"], self.group["nesterov"]
            b = it.state["momentum_buffer"]
            g = it.grad.to(b.dtype)
            if not nesterov:
                x = torch.add(g, b, alpha=mu, out=out)
            else:  # the new momentum a transient of this input's making alone (not kept beside Newton-Schulz)
                new = torch.add(g, b, alpha=mu)
                x = torch.add(g, new, alpha=mu, out=out)
                del new
        if self.emit:
            self.ctx.emit([it], [x], "momentum_input")
        return x


def write_inputs(calls: Sequence[Call], *, batched: bool, gate: Gate | None) -> None:
    """The momentum of ``calls``' items, ``B <- mu B + G`` (``commit.momentum_``: batched two ``_foreach`` kernels
    per distinct ``mu``, per tensor one fused pass), or the state a rule with inputs of its own updates (its
    :meth:`HiddenRule.inputs` run again, on copies where the step may be skipped): a write of the step's commit."""
    by_mu: dict[tuple, tuple[list[Tensor], list[Tensor], Any]] = {}
    for rule, items, group, _ in calls:
        if not items:
            continue
        if getattr(rule, "_own_inputs", False):
            _write_own_inputs(rule, items, group, batched=batched, gate=gate)
            continue
        mu = group["momentum"]
        bufs, grads, _ = by_mu.setdefault((id(mu) if isinstance(mu, Tensor) else mu,), ([], [], mu))
        for it in items:
            b = it.state["momentum_buffer"]
            bufs.append(b)
            grads.append(it.grad if it.grad.dtype == b.dtype else it.grad.to(b.dtype))
    for bufs, grads, mu in by_mu.values():
        commit.momentum_(bufs, grads, mu, fused=not batched, gate=gate)


def _write_own_inputs(rule: HiddenRule, items: Sequence[Item], group: dict, *, batched: bool,
                      gate: Gate | None) -> None:
    """The state updates of a rule's own :meth:`HiddenRule.inputs` (its inputs themselves let go): in place where the
    step cannot be skipped, else on copies written back (``commit.write_back``), a chunk of items (batched) or an
    item (per tensor) at a time."""
    keys = [k for k, how in rule.state_views.items() if how == "param"]
    if gate is None:
        for chunk in ([items] if batched else [[it] for it in items]):
            rule.inputs(chunk, group)
        return
    if batched:  # a chunk's copies of its state and the rule's own temporaries (Muon-VS: 3 more) at a time
        bufs = [it.state["momentum_buffer"] for it in items]
        chunks = [[items[i] for i in idx] for idx in commit.chunks(bufs, parts=4)]
    else:
        chunks = [[it] for it in items]
    for chunk in chunks:
        copies, flats = commit.shadow_items([(it, None) for it in chunk], lambda it: keys, with_param=False)
        rule.inputs(copies, group)
        del copies
        for targets, flat, views in flats:
            commit.write_back(targets, flat, views, gate)


# ---- the per-tensor form ------------------------------------------------------------------------------


def per_tensor(calls: Sequence[Call], hidden: Callable[..., None] | None = None) -> None:
    """The per-tensor form (``foreach=False``): each hidden matrix's direction (``hidden``, default
    :func:`_hidden_eager`) from its direction input made from the unchanged momentum (:class:`Inputs`), all kept;
    then the step's writes, queued on the call's commit: the momentum (one fused pass per tensor), the per-matrix
    state, an elementwise rule's own per-tensor :meth:`MomentumRule.update` (which reads the written momentum) and
    the hidden matrices' updates."""
    if not calls:
        return
    step = calls[0][3].commit
    step.later(write_inputs, list(calls), batched=False)
    hidden = hidden or _hidden_eager
    for rule, items, group, ctx in calls:
        if isinstance(rule, HiddenRule):
            hidden(rule, items, group, ctx, Inputs(rule, group, ctx, emit=True))
        else:
            step.later(_elementwise_update, rule, items, group, ctx)


def _elementwise_update(rule: MomentumRule, items: Sequence[Item], group: dict, ctx: StepContext, *,
                        gate: Gate | None) -> None:
    """An elementwise rule's per-tensor form, a write of the commit (its momentum already written): its own
    :meth:`MomentumRule.update`, which reads the step's skip flag from ``ctx.gate``."""
    if ctx.capture is not None:
        ctx.emit(items, [direction_input(it, group) for it in items], "momentum_input")
    ctx.gate = gate
    try:
        with naming(rule, items):
            rule.update(items, group, ctx)
    finally:
        ctx.gate = None


def _hidden_eager(rule: HiddenRule, items: Sequence[Item], group: dict, ctx: StepContext, x_of: Inputs) -> None:
    """A hidden rule's per-tensor directions: every matrix a stack of one, made just before its Newton-Schulz; its
    direction (or, for a rule with a step of its own, its stepped weights) and its new per-matrix state kept for
    the step's writes (:func:`keep_directions`): as ``U`` with its factors where that is fewer bytes
    (:func:`held_factored`)."""
    scratch: dict[tuple, Tensor] = {}
    per_matrix = [(k, how) for k, how in rule.state_views.items() if how in ("rows", "counter", "step")]
    kept = []
    for it in items:
        with naming(rule, [it]):
            b, shape = it.state["momentum_buffer"], it.shape
            x = x_of.one(it, out=buffer(scratch, "nesterov", b.shape, b.dtype, b.device))
            X = x.reshape(x.shape[0], -1) if x.ndim > 2 else x
            state = {k: F.on_device([it.state[k]], b.device) if how == "step" else it.state[k][None].clone()
                     for k, how in per_matrix}
            factored = held_factored(rule, group, ctx, X)
            ((D,),) = directions(rule, [(X[None], 1, state)], group, ctx, batched=False, scratch=scratch, fresh=True,
                                 factored=factored)
            for k in rule._owner_state:
                ctx.commit.later(commit.copy_, [it.state[k]], [state[k][0]])
            kept.append((it.param, D, rule.lr_scale(shape[0], math.prod(shape[1:]), group)))
    keep_directions(rule, kept, group, ctx)


def held_factored(rule: HiddenRule, group: dict, ctx: StepContext, X: Tensor) -> bool:
    """Whether the per-tensor forms keep a matrix's direction until the step's writes as ``U`` in the Newton-Schulz
    dtype with its row and column factors (:meth:`HiddenRule.post_factors`, ``transfer.FACTORS``: MeqMuon's eq. 8,
    NorMuon's) instead of ``D``: where that is fewer bytes (``transfer.pays``: bf16 ``U``, a float32 ``D``); the
    writes make ``D`` from them bit for bit (``transfer.apply``)."""
    if rule.transfer_form != transfer.FACTORS:
        return False
    ns = resolve_dtype(group, X, ctx)
    return transfer.pays(transfer.FACTORS, X.shape[-2], X.shape[-1], ns, torch.promote_types(ns, torch.float32))


def keep_directions(rule: HiddenRule, kept: Sequence[tuple[Tensor, Any, float]], group: dict,
                    ctx: StepContext) -> None:
    """Queue the per-tensor forms' steps of ``kept`` (``(param, D, scale)``: ``D`` a stack ``(1, m, n)``, or ``(U, row,
    col)`` with its factors): each ``W <- (1 - lr wd) W - lr s D`` in the commit; a rule with a step of its own
    (:meth:`HiddenRule.step_weights`) steps a copy of each weight now and the commit writes it."""
    if rule._own_step:
        for p, D, s in kept:
            ctx.commit.later(commit.copy_, [p], stepped_weights(rule, [p], D, s, group))
        return
    ctx.commit.later(_apply_each, [p for p, _, _ in kept], [D for _, D, _ in kept], [s for _, _, s in kept], group,
                     rule.factors_divide)


def _apply_each(params: Sequence[Tensor], dirs: Sequence[Any], scales: Sequence[float], group: dict,
                divide: bool, *, gate: Gate | None) -> None:
    """The per-tensor form's updates, one parameter at a time (:func:`apply_update`'s kernels), a direction kept as
    factors made first (``transfer.apply``, the bits of ``post``)."""
    scratch: dict = {}
    for p, D, s in zip(params, dirs, scales, strict=True):
        if isinstance(D, tuple):
            U, row, col = D
            if row.ndim == 1:  # one matrix's (m,) and (n,) factors (bucket_directions')
                row, col = row[:, None], col[None, :]
            D = transfer.apply(U, row, col, divide)
        d = D.reshape(p.shape)
        if d.dtype != p.dtype and torch.promote_types(d.dtype, p.dtype) == p.dtype:
            d = buffer(scratch, "direction", p.shape, p.dtype, p.device).copy_(d)
        commit.update_([p], [d], group["lr"], group["weight_decay"], [s], gate=gate)


def stepped_weights(rule: HiddenRule, params: Sequence[Tensor], D: Tensor, scale: float, group: dict) -> list[Tensor]:
    """A rule's own step (:meth:`HiddenRule.step_weights`) of ``params`` (whole matrices, or one tensor's matrix
    view) from their directions, the stack ``D`` ``(K, m, n)``, on a stack of copies of the weights: the stepped
    weights, in the parameters' shapes, for the step's writes."""
    W = torch.stack([p.reshape(D.shape[1:]) for p in params])
    rule.step_weights(W, D.to(W.dtype), scale, group)
    return [w.view(p.shape) for w, p in zip(W.unbind(0), params, strict=True)]


def step_weights(rule: HiddenRule, params: Sequence[Tensor], D: Tensor, scale: float, group: dict,
                 scratch: dict | None = None) -> None:
    """The step of ``params`` in place (an owner's whole matrices, transients of the exchange): ``W <- (1 - lr wd)
    W - lr s D`` (:func:`apply_update`), or the rule's own :meth:`HiddenRule.step_weights` on a stack of the weights,
    copied back."""
    if not rule._own_step:
        for p, d in zip(params, D.unbind(0), strict=True):
            d = d.reshape(p.shape)
            if scratch is not None and d.dtype != p.dtype and torch.promote_types(d.dtype, p.dtype) == p.dtype:
                d = buffer(scratch, "direction", p.shape, p.dtype, p.device).copy_(d)  # as apply_update does
            F.decay_and_update_([p], [d], group["lr"], group["weight_decay"], [scale])
        return
    torch._foreach_copy_(list(params), stepped_weights(rule, params, D, scale, group))


# ---- the batched form -------------------------------------------------------------------------------


def batched(calls: Sequence[Call]) -> None:
    """The batched form (``foreach=True``) of several momentum rule calls of one optimizer step.

    Each call computes its directions a shape bucket at a time (:func:`_pending`: the bucket's direction inputs from
    the unchanged momentum in a few ``torch._foreach_*`` kernels, :class:`Inputs`, stacked and let go), then the
    step's writes are queued on the commit: all updates together (one decay kernel per distinct ``1 - lr wd`` and
    one add per distinct ``lr s``), then the momentum of every call (two kernels per distinct ``mu``), the
    per-matrix state, and a rule with a step of its own its stepped weights. Directions depend on gradients and
    momentum only, so computing them all before any parameter changes gives the bits of stepping the calls one by
    one.
    """
    if not calls:
        return
    params, dirs, lrs, wds, scales, bases = [], [], [], [], [], []
    for rule, items, group, ctx in calls:
        ps, ds, ss, bs = _pending(rule, items, group, ctx, Inputs(rule, group, ctx, emit=True))
        params += ps
        dirs += ds
        scales += ss
        bases += bs
        lrs += [group["lr"]] * len(ps)
        wds += [group["weight_decay"]] * len(ps)
    step = calls[0][3].commit
    step.later(commit.update_, params, dirs, lrs, wds, scales, bases)
    del params, dirs, bases
    step.later(write_inputs, list(calls), batched=True)


def _pending(rule: Rule, items: Sequence[Item], group: dict, ctx: StepContext,
             x_of: Inputs) -> tuple[list, list, list, list]:
    """The batched directions of one call's ``items``, not applied: per shape bucket one stack of direction inputs
    (``x_of``, a bucket at a time). Returns ``(params, directions, scales, bases)`` (``bases``: the stacks holding the
    directions); the new per-matrix state, and the stepped weights of a rule with a step of its own
    (:func:`stepped_weights`), are queued on the commit."""
    hidden = isinstance(rule, HiddenRule)
    buckets = make_buckets(items, matrix=hidden or needs_matrix(rule), transpose=hidden and rule.transposes)
    params, dirs, scales, bases = [], [], [], []
    with naming(rule, items):
        if hidden:
            share = ctx.split.ns_for  # whole matrices a block holds alike: its share (shared_ns.ReplicaShare)
            found = bucket_directions(rule, buckets, group, ctx, batched=True, inputs=x_of,
                                      dtype=items[0].param.dtype, ns=share(group, ctx) if share else None)
            for targets, news in found.writes:
                ctx.commit.later(commit.copy_, targets, news, parts=1)
            per_bucket, bases = found.directions, found.bases
        else:
            per_bucket = []
            for b in buckets:
                D = rule.direction(stack_inputs(ctx.workspace, (rule.name, ctx.call), b, x_of(b.items),
                                                F.stat_dtype(b.items[0].param)),
                                   group, ctx.split.psum, b.global_shape)
                per_bucket.append(unstack(b, D))
                bases.append(D)
    for b, ds in zip(buckets, per_bucket, strict=True):
        # A hidden rule's step multiplier (:meth:`HiddenRule.lr_scale`); the elementwise rules fold theirs in.
        scale = rule.lr_scale(*b.global_shape, group) if hidden else 1.0
        if hidden and rule._own_step:
            ps = [it.param for it in b.items]
            with naming(rule, b.items):
                news = stepped_weights(rule, ps, torch.stack([d.reshape(b.shape) for d in ds]), scale, group)
            ctx.commit.later(commit.copy_, ps, news)
            continue
        params += [it.param for it in b.items]
        dirs += ds
        scales += [scale] * len(b.items)
    return params, dirs, scales, bases if params else []


@contextmanager
def naming(rule: Rule, items: Sequence[Item]) -> Iterator[None]:
    """Name ``rule`` and the parameters of ``items`` in an exception raised inside (``commit.name_error``)."""
    try:
        yield
    except Exception as e:
        raise commit.name_error(e, rule, list(dict.fromkeys(it.name for it in items))) from None
