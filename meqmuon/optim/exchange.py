"""The owner path's step (``placement.PIECES``): what travels, what the owner computes, what each rank applies.

Momentum rules (:func:`directions_at_owners`): every rank updates the momentum of its piece where it lies
and sends its piece of the direction input ``X`` to the owner (``owners.OwnerPlan.to_owners``); the owner
runs the one-process body on the whole matrix (:func:`_whole_direction`) and returns every rank its piece of
``D`` (in the Newton-Schulz dtype where ``D`` is its output unscaled: :func:`returns_orth`; for MeqMuon's eq. 8
on a plain matrix, ``U`` in the Newton-Schulz dtype with the row and column factors of its piece, where fewer
bytes: :func:`factors_pay`) with the small per-matrix state the rule changed (``from_owners``); each rank
applies ``W <- (1 - lr wd) W - lr s D`` to its piece. A stepping rule that is not elementwise (SCALE's column rule on
pieces that are not whole rows) keeps the whole-tensor fallback (:func:`gather_whole`, :func:`scatter_whole`):
its parameter, gradient and state made whole at the owner for the step and freed after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from .calls import Item
from .distributed import is_dtensor
from .driver import HiddenRule, apply_update, directions, matrix_shape, needs_matrix, resolve_dtype
from .owners import AXES, OwnerPlan

__all__ = ["Job", "directions_at_owners", "factors_pay", "gather_whole", "returns_orth", "scatter_whole"]


class Job:
    """One parameter with a gradient on the owner path in this step: its plan index, tensors, rule, layout,
    its param group (with the step's float hyperparameters), whether the rule sees each matrix of its view
    (``cut``), whether its group takes the per-tensor form (``fused`` momentum), its call's context."""

    __slots__ = ("index", "param", "grad", "state", "rule", "layout", "group", "cut", "fused", "ctx", "name")

    def __init__(self, index, param, grad, state, rule, layout, group, cut, fused, ctx, name) -> None:
        self.index, self.param, self.grad, self.state, self.rule, self.layout = index, param, grad, state, rule, layout
        self.group, self.cut, self.fused, self.ctx, self.name = group, cut, fused, ctx, name


def _local_grad(job: Job) -> Tensor:
    g = job.grad
    if is_dtensor(g) and tuple(g.placements) != tuple(job.param.placements):  # Partial() under TP
        g = g.redistribute(g.device_mesh, job.param.placements)
    return g.to_local() if is_dtensor(g) else g


def _scales(job: Job) -> list[float]:
    """A hidden rule's step multiplier of every matrix of the view; the elementwise rules fold theirs in."""
    if not isinstance(job.rule, HiddenRule):
        return [1.0]
    return [job.rule.lr_scale(r, c, job.group) for r, c in job.layout.shapes()]


def returns_orth(rule: Any) -> bool:
    """Whether a rule's direction is Newton-Schulz's output itself: a ``HiddenRule`` that keeps the identity
    ``post`` (and ``post_all``), as Muon (Moonlight's), MuonEq and Aurora do. Its ``D`` then has the Newton-Schulz
    dtype's values, so that it travels back in that dtype: widening bf16 to float32 is exact, and each rank adds
    what one process adds (:func:`driver.apply_update`). The row path's reading of the same fact:
    ``HiddenRule._direction_form`` (``sharded.py``)."""
    return isinstance(rule, HiddenRule) and rule._direction_form == "identity"


def _dtypes(job: Job) -> tuple[torch.dtype, torch.dtype]:
    """What travels: the direction input (the Newton-Schulz dtype where the rule keeps the default ``pre``,
    else at least float32, as ``pre`` and the elementwise rules compute) and the direction: the Newton-Schulz
    dtype where ``D`` is its output unscaled (:func:`returns_orth`, no step multipliers folded in:
    :func:`_folds`), else at least the parameter's dtype, so that the update adds what one process adds (a
    ``post`` or a fold computes in float32: its bf16 rounding would change the bits)."""
    p = job.param.to_local()
    hidden = isinstance(job.rule, HiddenRule)
    out = resolve_dtype(job.group, p, job.ctx) if hidden and not job.rule._rewrites_input else F._stat_dtype(p)
    if returns_orth(job.rule) and not _folds(job):
        return out, resolve_dtype(job.group, p, job.ctx)
    return out, torch.promote_types(out, p.dtype)


def factors_pay(plan: OwnerPlan, job: Job, d_dtype: torch.dtype) -> bool:
    """Whether the owner sends eq. 8's factored form (``HiddenRule._direction_form == "factors"``, MeqMuon) of a
    plain matrix (the parameter is its one matrix: no split, transposed, folded or stacked view, so no fold)
    instead of ``D`` in ``d_dtype`` (:func:`_dtypes`): each rank's piece of ``U`` in the Newton-Schulz dtype, the
    row factors of the rows and the column factors of the columns it covers (their dtype, ``post_factors``':
    float32 for a bf16 ``U``), from which it makes ``D = (U * row) * col`` (``F.apply_factors``, the owner's
    ``post_all`` bit for bit on any block). Where the rule's ``HiddenRule._factors_pay`` (the row path's rule too)
    holds for every rank's (non-empty) piece: with bf16 ``U`` and float32 ``D``, pieces with ``2 (m + n) < m n``;
    never with a float32 ``U`` or a float64 ``D``. Read from shapes and placements alone (the plan's
    :class:`~.owners.Pieces`), so that every rank decides it alike, knowing what it will receive, with no
    collective. A rank whose piece is empty (uneven shards) still receives the factors of the dimension it
    covers: a few bytes."""
    rule, p = job.rule, job.param
    if not (isinstance(rule, HiddenRule) and job.layout.whole and not job.cut and p.ndim == 2 and not _folds(job)):
        return False
    ns = resolve_dtype(job.group, p.to_local(), job.ctx)
    return all(rule._factors_pay(m, n, ns, d_dtype) for m, n in plan.owned[job.index].pieces.local_shapes() if m * n)


def _folds(job: Job) -> bool:
    """Whether the owner folds the step multipliers into ``D``: a view whose matrices have different ones."""
    return len(set(_scales(job))) > 1


def directions_at_owners(plan: OwnerPlan, jobs: Sequence[Job]) -> None:
    """The momentum rules' step on the owner path: momentum where it lies, ``X`` out, whole-matrix
    directions at owners (:func:`_whole_direction`), ``D`` and the per-matrix state back, each rank's update."""
    if not jobs:
        return
    keys, pieces, wholes, backs = [], [], [], []
    for job in jobs:
        b = job.state["momentum_buffer"].to_local()
        g = _local_grad(job)
        g = g if g.dtype == b.dtype else g.to(b.dtype)
        F.momentum_([b], [g], job.group["momentum"], fused=job.fused)
        x_dtype, d_dtype = _dtypes(job)
        X = F.direction_input([g], [b], job.group["momentum"], job.group["nesterov"])[0].to(x_dtype)
        o = plan.owned[job.index]
        sharded = [k for k in job.rule._owner_state if k in o.state_pieces]
        keys.append(["param", *sharded])
        pieces.append([X, *(job.state[k].to_local() for k in sharded)])
        mine = plan.mine(job.index)
        wholes.append([torch.empty(job.param.shape, dtype=x_dtype, device=X.device),
                       *(torch.empty(job.state[k].shape, dtype=job.state[k].dtype, device=X.device) for k in sharded)]
                      if mine else [None] * len(keys[-1]))
        backs.append((d_dtype, factors_pay(plan, job, d_dtype)))
    plan.to_owners([j.index for j in jobs], pieces, wholes, keys)
    del pieces  # X's pieces, in the wholes now
    out_wholes, out_keys, into = [], [], []
    for job, ws, ks, (d_dtype, factored) in zip(jobs, wholes, keys, backs, strict=True):
        owner_keys = job.rule._owner_state
        state = {k: (ws[ks.index(k)] if k in ks else _whole_state(job.state[k])) for k in owner_keys}
        # D, or (U, row, col) where factored; lets X (ws[0]) go
        D = _whole_direction(job, ws, state, d_dtype, factored) if ws[0] is not None else None
        parts = (list(D) if D is not None else [None] * 3) if factored else [D]
        out_wholes.append([*parts, *(state[k] for k in owner_keys)])
        out_keys.append([*(["param", *AXES] if factored else ["param"]), *(k if k in ks else None for k in owner_keys)])
        into.append([*_direction_pieces(job, d_dtype, factored),
                     *(job.state[k].to_local() if is_dtensor(job.state[k]) else job.state[k] for k in owner_keys)])
    plan.from_owners([j.index for j in jobs], out_wholes, out_keys, into)
    del out_wholes
    scratch: dict = {}  # one float32 buffer per shape for the bf16 directions, as one process's update
    for job, (_, factored), got in zip(jobs, backs, into, strict=True):
        # eq. 8 on this rank's piece: (U * row) * col, the owner's post_all bit for bit (F.apply_factors)
        D = (F.apply_factors(got[0], got[1][:, None], got[2][None, :], divide=job.rule._row_factors_divide)
             if factored else got[0])
        s = 1.0 if _folds(job) else _scales(job)[0]
        apply_update([Item(job.param.to_local(), None, {}, job.name)], [D], [s], job.group, scratch)
        got.clear()  # this piece's U or D goes before the next job's D is made


def _direction_pieces(job: Job, d_dtype: torch.dtype, factored: bool) -> list[Tensor]:
    """Where this rank receives its piece of the direction: ``D`` in ``d_dtype``, or (``factored``) ``U`` in
    the Newton-Schulz dtype with the factors of its piece's rows and columns (in ``d_dtype``: :func:`factors_pay`)."""
    local = job.param.to_local()
    if not factored:
        return [torch.empty(local.shape, dtype=d_dtype, device=local.device)]
    ns = resolve_dtype(job.group, local, job.ctx)
    return [torch.empty(local.shape, dtype=ns, device=local.device),
            *(torch.empty(local.shape[d], dtype=d_dtype, device=local.device) for d in AXES.values())]


def _whole_state(t: Any) -> Any:
    return t.to_local() if is_dtensor(t) else t


def _whole_direction(job: Job, wholes: list[Tensor | None], state: dict[str, Tensor], dtype: torch.dtype,
                     factored: bool = False) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """At the owner: the direction of the whole ``X`` (the parameter's global shape) by the one-process body,
    matrix by matrix of the view as the per-tensor form (``driver._hidden_eager``); ``state`` (whole per-matrix
    state) updated in place. A view whose matrices have different step multipliers gets them folded in. ``X`` is
    ``wholes[0]``, handed over (set to ``None`` here): scratch, which Newton-Schulz overwrites where it iterates
    in place and lets go, matrix by matrix, before ``post`` (``driver.directions``' ``consume``). ``factored``
    (a plain matrix, :func:`factors_pay`): ``(U, row, col)`` instead, ``U`` in the Newton-Schulz dtype and eq. 8's
    factors ``(m,)`` and ``(n,)`` (``driver.directions``' ``factored``; the per-matrix state updated alike)."""
    X, wholes[0] = wholes[0], None
    rule, layout, group = job.rule, job.layout, job.group
    if job.ctx.capture is not None:
        job.ctx.capture(job.name, job.ctx.kind, "momentum_input", X)
    if not isinstance(rule, HiddenRule):
        D = torch.empty(X.shape, dtype=dtype, device=X.device)
        xs, ds = (layout.matrices(X), layout.matrices(D)) if job.cut else ([X], [D])
        for x, d in zip(xs, ds, strict=True):
            x = x.reshape(matrix_shape(x.shape)) if needs_matrix(rule) else x
            y = rule.direction(x.contiguous().to(F._stat_dtype(x))[None], group, None, tuple(x.shape))
            d.copy_(y[0].reshape(d.shape))
        return D
    scales, fold = _scales(job), _folds(job)
    cut = {"rows": layout.row_pieces, "counter": layout.counters}
    per_key = {k: cut[how](state[k]) for k, how in rule.state_views.items() if how in cut}
    steps = [k for k, how in rule.state_views.items() if how == "step"]
    scratch: dict = {}
    D = ds = None
    xs, shape, device = layout.matrices(X), X.shape, X.device
    # a plain matrix: its direction is D itself where it has D's dtype (a copy into D was exact, and beside it)
    whole = len(xs) == 1 and xs[0].shape == shape and xs[0].stride() == X.stride() and not fold
    del X  # its matrices (disjoint views) are read by nothing after their Newton-Schulz
    for j in range(len(xs)):
        st = {k: v[j][None] for k, v in per_key.items()}
        st.update({k: F.on_device([job.state["step"]], device) for k in steps})
        # handed over: Newton-Schulz iterates in the received matrix where it can, not beside a copy of it, and
        # lets it go before post (consume; X's storage goes with its last matrix)
        stack, xs[j] = [(xs[j].contiguous()[None], 1, st)], None
        ((u,),) = directions(rule, stack, group, job.ctx, batched=False, scratch=scratch, release=True,
                             consume=True, factored=factored)
        if factored:  # one matrix, the parameter itself
            u, row, col = u
            return u[0], row[0, :, 0], col[0, 0]
        if whole and u.dtype == dtype:
            return u[0]
        if D is None:  # made once the first direction exists: not alive during Newton-Schulz (the step's peak)
            D = torch.empty(shape, dtype=dtype, device=device)
            ds = layout.matrices(D)
        ds[j].copy_(u[0] * scales[j] if fold else u[0])
    return D


def gather_whole(plan: OwnerPlan, jobs: Sequence[Job]) -> list[tuple[Tensor, Tensor, dict[str, Any]] | None]:
    """The whole-tensor fallback (a stepping rule that is not elementwise: SCALE's column and row rules): the
    parameter, gradient and sharded state pieces to the owner, into whole tensors made for this step. Returns
    per job, at its owner, ``(param, grad, state)`` whole (the state's other tensors are whole already)."""
    keys, pieces, wholes = [], [], []
    for job in jobs:
        o = plan.owned[job.index]
        g = _local_grad(job)
        sharded = list(o.state_pieces)
        keys.append(["param", "param", *sharded])
        pieces.append([job.param.to_local(), g, *(job.state[k].to_local() for k in sharded)])
        like = [job.param.to_local(), g, *(job.state[k].to_local() for k in sharded)]
        shapes = [job.param.shape, job.param.shape, *(job.state[k].shape for k in sharded)]
        wholes.append([torch.empty(s, dtype=t.dtype, device=t.device) for s, t in zip(shapes, like, strict=True)]
                      if plan.mine(job.index) else [None] * len(keys[-1]))
    plan.to_owners([j.index for j in jobs], pieces, wholes, keys)
    out = []
    for job, ws, ks in zip(jobs, wholes, keys, strict=True):
        if ws[0] is None:
            out.append(None)
            continue
        state = {k: (ws[ks.index(k)] if k in ks[2:] else _whole_state(v)) for k, v in job.state.items()}
        out.append((ws[0], ws[1], state))
    return out


def scatter_whole(plan: OwnerPlan, jobs: Sequence[Job], wholes: Sequence[tuple | None]) -> None:
    """The fallback's way back: every rank's piece of the new parameter and of the state tensors."""
    out_wholes, out_keys, into = [], [], []
    for job, w in zip(jobs, wholes, strict=True):
        o = plan.owned[job.index]
        names = [k for k in sorted(job.state) if isinstance(job.state[k], Tensor)]
        out_keys.append(["param", *(k if k in o.state_pieces else None for k in names)])
        out_wholes.append([w[0], *(w[2][k] for k in names)] if w is not None else [None] * (1 + len(names)))
        into.append([job.param.to_local(), *(_whole_state(job.state[k]) for k in names)])
    plan.from_owners([j.index for j in jobs], out_wholes, out_keys, into)
