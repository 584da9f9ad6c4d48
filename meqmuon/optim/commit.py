"""A step's writes, made once all of its directions exist: a step is all or nothing, and a skipped one changes nothing.

A step runs in two phases (``engine.RoleOptimizer.step``). First every rule computes what it would write (direction
inputs from the unchanged momentum, Newton-Schulz, ``pre`` / ``post``, statistics and every collective) without
writing a parameter or a state tensor; what it will write is queued here (:class:`Commit`). Only then are the
writes made, in the order queued, each a fixed number of elementwise kernels: momentum, per-matrix state, the
parameters' steps and the stepping rules' (AdamW, SCALE) own steps. Whatever raises in the first phase (a rule, a
shape it did not expect, an out-of-memory on a bucket) leaves parameters and state as they were.

The writes take the step's :class:`Gate`, the device flag that says the step is skipped (a non-finite gradient
under ``nonfinite="skip"``, a ``GradScaler``'s ``found_inf``, an error on another rank). It is never read on the host:
it is folded into the writes, as torch's fused optimizers take ``found_inf``. A NaN survives any arithmetic (``NaN *
0`` is NaN; ``clamp``, ``maximum`` and ``lerp`` propagate it, and torch has no ``_foreach_`` ``where``), so a write
that reads the gradient computes its new values into a transient copy and selects, ``where(skip, old, new)``, over
one flat buffer per chunk of tensors (:func:`write_back`: a fixed number of kernels, flat in the model's depth);
a parameter's step instead zeroes its direction (one kernel per stack of directions) and multiplies by a decay
factor that is 1 on a skipped step (:func:`update_`). Without a gate every write is the one it always was, in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from .calls import Item

__all__ = ["CHUNKS", "Commit", "Gate", "constant", "copy_", "decay_", "flat_copy", "guarded", "lerp_", "momentum_",
           "name_error", "sanitized", "select_", "shadow_items", "stepping_", "update_", "write_back"]

#: A gated write goes through flat copies of at most ``1 / CHUNKS`` of its tensors' bytes (or one tensor, where
#: that is larger) at a time, so that the copies of one write stay within the step's transient bound; a constant, so
#: that the number of kernels does not grow with the model's depth.
CHUNKS = 2


def constant(store: dict, c: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``c`` as a 0-D ``dtype`` tensor on ``device``, made once and kept in ``store`` (the optimizer's, across steps;
    at most 64: a schedule's decay factors change every step)."""
    key = (c, dtype, device)
    t = store.get(key)
    if t is None:
        if len(store) >= 64:
            store.clear()
        t = store[key] = torch.full((), c, dtype=dtype, device=device)
    return t


class Gate:
    """The step's skip flag on the device (``flag``, 0-D float32: 1 where the step is skipped, else 0), and the
    forms the writes read it in, each made once per step and device: a 0-D bool (``where``), a 0/1 tensor of any dtype
    (exact in every dtype) and a decay factor ``where(skip, 1, c)``. Nothing here reads it on the host."""

    def __init__(self, flag: Tensor, constants: dict | None = None) -> None:
        self.flag = flag
        self._made: dict[tuple, Tensor] = {}
        #: 0-D constants kept across steps (the optimizer's: ``mu``, ``beta2``, 0 and 1 made once, not per step).
        self._constants = {} if constants is None else constants

    def constant(self, c: float, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``c`` as a kept 0-D tensor (:func:`constant`)."""
        return constant(self._constants, c, dtype, device)

    def skip(self, device: torch.device) -> Tensor:
        """The flag as a 0-D bool tensor on ``device``."""
        key = ("skip", device)
        if key not in self._made:
            self._made[key] = self.flag.to(device, non_blocking=True) > 0
        return self._made[key]

    def value(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The flag as a 0-D ``dtype`` tensor on ``device`` (0 or 1, exact in every dtype)."""
        key = ("value", dtype, device)
        if key not in self._made:
            self._made[key] = self.skip(device).to(dtype)
        return self._made[key]

    def weight(self, c: float, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``0`` on a skipped step, else ``c``: a 0-D ``dtype`` tensor (a ``lerp`` weight; float32 and float64, in
        which a kernel given the Python number ``c`` multiplies by the same value)."""
        key = ("weight", c, dtype, device)
        if key not in self._made:
            self._made[key] = torch.where(self.skip(device), self.constant(0.0, dtype, device),
                                          self.constant(c, dtype, device))
        return self._made[key]

    def factor(self, c: float | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``1`` on a skipped step, else ``c``: a 0-D ``dtype`` tensor (a decay factor ``1 - lr wd``). ``c`` in
        ``dtype`` is what a kernel given the Python number ``c`` multiplies by (float32 or float64 parameters; a
        narrower one is multiplied per tensor, :func:`decay_`)."""
        key = ("factor", c if not isinstance(c, Tensor) else id(c), dtype, device)
        if key not in self._made:
            value = c.to(dtype) if isinstance(c, Tensor) else self.constant(c, dtype, device)
            self._made[key] = torch.where(self.skip(device), self.constant(1.0, dtype, device), value)
        return self._made[key]


class Commit:
    """The writes of one step, queued while its directions are computed and made by :meth:`run`, in order.

    ``gate``: the step's :class:`Gate` (``None``: nothing can skip the step, every write is made as it always
    was). ``tolerant``: under ``torch.distributed``, an error inside a rank's part of the first phase is kept
    (:meth:`fail`) rather than raised there, so that the rank still takes part in every collective of the step
    (its results are placeholders), and the step is skipped on every rank (the engine folds the error into the
    gate before one all-reduce of it); the rank raises it once the skipped step is done."""

    def __init__(self, gate: Gate | None = None, tolerant: bool = False) -> None:
        self.gate = gate
        self.tolerant = tolerant
        self.error: BaseException | None = None
        #: Known on the host to be skipped (``decision.settle``): :meth:`run` makes no write.
        self.skipped = False
        self._writes: list[tuple[Callable[..., None], tuple, dict]] = []
        self._last: list[tuple[Callable[..., None], tuple, dict]] = []
        #: Called once the momentum rules' writes are made, before the stepping rules' (the engine lets go of the
        #: momentum rules' workspaces there).
        self.between: Callable[[], None] | None = None

    def later(self, write: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Queue ``write(*args, **kwargs, gate=...)`` for :meth:`run`."""
        self._writes.append((write, args, kwargs))

    def last(self, write: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Queue ``write`` after every :meth:`later` one (the stepping rules' steps: by then the momentum rules'
        directions are let go, and their copies have that memory)."""
        self._last.append((write, args, kwargs))

    def fail(self, error: BaseException) -> None:
        """Keep the first error of a tolerant step (see the class)."""
        if self.error is None:
            self.error = error

    def run(self) -> None:
        """Make the queued writes, in order, each let go once made (its transients with it); none where the step is
        known to be skipped (:attr:`skipped`)."""
        for writes in self._take(), self._take(last=True):
            if self.skipped:
                writes.clear()
            while writes:
                write, args, kwargs = writes.pop()
                write(*args, **kwargs, gate=self.gate)
                del write, args, kwargs
            if self.between is not None:
                self.between()
                self.between = None

    def _take(self, last: bool = False) -> list[tuple[Callable[..., None], tuple, dict]]:
        writes = self._last if last else self._writes
        if last:
            self._last = []
        else:
            self._writes = []
        writes.reverse()
        return writes


def name_error(error: BaseException, rule: Any, names: Sequence[str]) -> BaseException:
    """``error`` with the rule and the parameters it was computing named at the front of its message (its type and
    traceback kept, so that ``except torch.OutOfMemoryError`` still catches it), once."""
    if getattr(error, "_meqmuon_named", False):
        return error
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    what = f"rule {getattr(rule, 'name', type(rule).__name__)!r} on parameter{'s' if len(names) > 1 else ''} {shown}"
    if error.args and isinstance(error.args[0], str):
        error.args = (f"{what}: {error.args[0]}", *error.args[1:])
    else:
        error.add_note(f"(raised by {what}; the step changed no parameter and no state)")
    error._meqmuon_named = True  # type: ignore[attr-defined]
    return error


def guarded(step: Commit, rule: Any, items: list[Item], run: Callable, *args: Any) -> None:
    """``run(*args)``, an error in it naming ``rule`` and ``items``' parameters where a form has not named them;
    kept on ``step`` where it is tolerant (``engine.RoleOptimizer._run``)."""
    try:
        run(*args)
    except Exception as e:
        e = name_error(e, rule, list(dict.fromkeys(it.name for it in items)))
        if not step.tolerant:
            raise e from None
        step.fail(e)


# ---- flat copies ------------------------------------------------------------------------------------------------


def flat_copy(tensors: Sequence[Tensor], dtype: torch.dtype | None = None) -> tuple[Tensor, list[Tensor]]:
    """One flat buffer holding ``tensors`` (one device; cast to ``dtype``, default the first's) and its views in
    their shapes: one ``_foreach_copy_``, whatever their strides."""
    dtype = dtype or tensors[0].dtype
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    views, o = [], 0
    for t in tensors:
        views.append(flat[o : o + t.numel()].view(t.shape))
        o += t.numel()
    torch._foreach_copy_(views, list(tensors))
    return flat, views


def sanitized(tensors: Sequence[Tensor], gate: Gate, dtype: torch.dtype) -> tuple[Tensor, list[Tensor]]:
    """``tensors`` (gradients) in one flat buffer of ``dtype`` and its views, every entry ``-0.0`` on a skipped step
    (one ``_foreach_copy_``, one ``masked_fill_``): what a gated write reads in place of the gradient. ``x + -0.0`` is
    ``x`` bit for bit (``+0.0`` too), so that a write ``B <- f B + G'`` with ``f`` 1 on a skipped step
    (:meth:`Gate.factor`) leaves ``B`` as it was, in the kernels of the ungated write."""
    flat, views = flat_copy(tensors, dtype)
    flat.masked_fill_(gate.skip(flat.device), -0.0)
    return flat, views


def select_(flat: Tensor, views: Sequence[Tensor], olds: Sequence[Tensor], gate: Gate) -> None:
    """``views`` (of ``flat``) become ``olds`` on a skipped step, through flat copies of ``olds`` in chunks of at most
    half of ``flat``'s bytes (the step's transient stays within one and a half of it): a copy and a ``where`` each."""
    skip = gate.skip(flat.device)
    for idx in chunks(olds):
        old, _ = flat_copy([olds[i] for i in idx], flat.dtype)
        start = views[idx[0]].data_ptr() - flat.data_ptr()
        part = flat[start // flat.element_size():][: old.numel()]
        torch.where(skip, old, part, out=part)
        del old


def write_back(targets: Sequence[Tensor], flat: Tensor, views: Sequence[Tensor], gate: Gate) -> None:
    """``targets <- views`` (the new values, held in ``flat``), unless the step is skipped: ``flat`` becomes
    ``where(skip, targets, flat)`` first (a flat copy of the targets' values, one ``where``), then one copy back."""
    old, _ = flat_copy(targets, flat.dtype)
    torch.where(gate.skip(flat.device), old, flat, out=flat)
    del old
    torch._foreach_copy_(list(targets), list(views))


def chunks(tensors: Sequence[Tensor], parts: int = CHUNKS) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype and device, each group cut in consecutive chunks of at most
    ``max(largest, total / parts)`` bytes."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    out = []
    for idx in groups.values():
        sizes = [tensors[i].numel() * tensors[i].element_size() for i in idx]
        limit = max(max(sizes), -(-sum(sizes) // parts))
        chunk, held = [], 0
        for i, n in zip(idx, sizes, strict=True):
            if chunk and held + n > limit:
                out.append(chunk)
                chunk, held = [], 0
            chunk.append(i)
            held += n
        out.append(chunk)
    return out


# ---- the writes ----------------------------------------------------------------------------------------------------


def copy_(targets: Sequence[Tensor], news: Sequence[Tensor], *, gate: Gate | None, parts: int = CHUNKS) -> None:
    """``targets <- news`` (per-matrix state, stepped weights; ``news`` cast to the targets' dtypes). Gated, through
    flat copies of about ``1 / parts`` of the bytes at a time (:func:`chunks`; ``parts=1`` for per-row and
    per-matrix state, a vector per matrix: one flat copy per dtype, four kernels)."""
    if not targets:
        return
    if gate is None:
        torch._foreach_copy_(list(targets), list(news))
        return
    if len(targets) == 1:  # the per-tensor forms
        t, n = targets[0], news[0]
        torch.where(gate.skip(t.device), t, n.to(t.dtype), out=t)
        return
    for idx in chunks(targets, parts):
        ts = [targets[i] for i in idx]
        flat, views = flat_copy([news[i] for i in idx], ts[0].dtype)
        write_back(ts, flat, views, gate)


def momentum_(bufs: Sequence[Tensor], grads: Sequence[Tensor], mu: float | Tensor, *, fused: bool,
              gate: Gate | None) -> None:
    """``B <- mu B + G`` (paper eq. 6; :func:`F.momentum_`, the same kernels and rounding), the gradients already in
    the buffers' dtypes. Gated: per tensor (``fused``) into a transient and ``where``; batched into flat copies of a
    chunk of buffers, then :func:`write_back`."""
    if not bufs:
        return
    if gate is None:
        F.momentum_(bufs, grads, mu, fused=fused)
        return
    if fused:  # by row blocks: a block's transient, whatever the tensor's size
        for b, g in zip(bufs, grads, strict=True):
            for rows in _blocks(b):
                bb, gg = (b, g) if rows is None else (b[rows], g[rows])
                torch.where(gate.skip(b.device), bb, torch.add(gg, bb, alpha=mu), out=bb)
        return
    if not isinstance(mu, Tensor) and all(b.dtype in (torch.float32, torch.float64) for b in bufs):
        # The gradients sanitised (-0.0 on a skipped step) and mu gated (1): F.momentum_'s two kernels, its bits.
        for idx in chunks(bufs, parts=1):
            bs = [bufs[i] for i in idx]
            flat, views = sanitized([grads[i] for i in idx], gate, bs[0].dtype)
            torch._foreach_mul_(bs, gate.factor(mu, bs[0].dtype, bs[0].device))
            torch._foreach_add_(bs, views)
            del flat, views
        return
    for idx in chunks(bufs):
        bs = [bufs[i] for i in idx]
        flat, views = flat_copy(bs)
        F.momentum_(views, [grads[i] for i in idx], mu)
        write_back(bs, flat, views, gate)


def lerp_(targets: Sequence[Tensor], ends: Sequence[Tensor], weight: float, *, fused: bool,
          gate: Gate | None) -> None:
    """``T <- lerp(T, E, weight)`` (an EMA: SCALE's head momentum), per tensor (``fused``) or in one
    ``_foreach_lerp_``; gated, as :func:`momentum_`: per tensor by row blocks and ``where``, batched on flat copies of
    a chunk written back."""
    if not targets:
        return
    if gate is None:
        if fused:
            for t, e in zip(targets, ends, strict=True):
                t.lerp_(e, weight)
        else:
            torch._foreach_lerp_(list(targets), list(ends), weight)
        return
    if fused:
        for t, e in zip(targets, ends, strict=True):
            for rows in _blocks(t):
                tt, ee = (t, e) if rows is None else (t[rows], e[rows])
                torch.where(gate.skip(t.device), tt, torch.lerp(tt, ee, weight), out=tt)
        return
    for idx in chunks(targets):
        ts = [targets[i] for i in idx]
        flat, views = flat_copy(ts)
        torch._foreach_lerp_(views, [ends[i] for i in idx], weight)
        write_back(ts, flat, views, gate)


def decay_(params: Sequence[Tensor], factor: float | Tensor, gate: Gate | None) -> None:
    """``W <- factor W`` (:func:`F.decay_`), by 1 on a skipped step: float32 and float64 parameters by the gate's
    factor tensor (one ``_foreach_mul_`` per dtype and device, the bits of the Python number's kernel), narrower ones
    per tensor by ``where`` (as :func:`F.decay_` multiplies them per tensor)."""
    if gate is None:
        F.decay_(params, factor)
        return
    groups: dict[tuple, list[Tensor]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), ps in groups.items():
        if isinstance(factor, Tensor):  # cuda_graph=True's device factor, in its own dtype as F.decay_ takes it
            torch._foreach_mul_(ps, gate.factor(factor, factor.dtype, factor.device))
        elif dtype in (torch.float32, torch.float64):
            torch._foreach_mul_(ps, gate.factor(factor, dtype, device))
        else:
            for p in ps:
                torch.where(gate.skip(device), p, torch.mul(p, factor), out=p)


def update_(params: Sequence[Tensor], dirs: Sequence[Tensor], lrs: float | Sequence[Any], wds: float | Sequence[Any],
            scales: Sequence[float], bases: Sequence[Tensor] | None = None, *, gate: Gate | None) -> None:
    """``W <- (1 - lr wd) W - lr s D`` (:func:`F.decay_and_update_`: one decay per distinct factor, one add per
    distinct ``lr s``). Gated: the directions zeroed on a skipped step (``bases``: the stacks that hold them, one
    kernel each; else each direction) and the decay factor 1, so that the add adds zeros."""
    if not params:
        return
    if gate is None:
        F.decay_and_update_(params, dirs, lrs, wds, scales)
        return
    for b in (bases if bases is not None else dirs):
        b.masked_fill_(gate.skip(b.device), 0)
    n = len(params)
    lrs = list(lrs) if isinstance(lrs, Sequence) else [lrs] * n
    wds = list(wds) if isinstance(wds, Sequence) else [wds] * n
    decays: dict[Any, tuple[Any, list[Tensor]]] = {}
    adds: dict[Any, tuple[Any, list[Tensor], list[Tensor]]] = {}
    for p, d, lr, wd, s in zip(params, dirs, lrs, wds, scales, strict=True):
        if isinstance(lr, Tensor):  # cuda_graph=True: one 0-D device tensor per group (F._decay_and_update_on_device)
            if isinstance(wd, Tensor) or wd != 0:
                decays.setdefault((id(lr), id(wd)), (1 - lr * wd, []))[1].append(p)
            entry = adds.setdefault((id(lr), s), (-(lr * s), [], []))
        else:
            if wd != 0:
                decays.setdefault(1.0 - lr * wd, (1.0 - lr * wd, []))[1].append(p)
            entry = adds.setdefault(-lr * s, (-lr * s, [], []))
        entry[1].append(p)
        entry[2].append(d)
    for factor, ps in decays.values():
        decay_(ps, factor, gate)
    for alpha, ps, ds in adds.values():
        if isinstance(alpha, Tensor):
            torch._foreach_add_(ps, torch._foreach_mul(ds, alpha))
        else:
            torch._foreach_add_(ps, ds, alpha=alpha)


def shadow_items(pieces: Sequence[tuple[Item, slice | None]], keys: Callable[[Item], Sequence[str]],
                 with_param: bool) -> tuple[list[Item], list[tuple[list[Tensor], Tensor, list[Tensor]]]]:
    """Copies of the items of ``pieces`` (``(item, rows)``: rows ``rows`` of it, or all of it with ``None``) whose
    parameter (``with_param``) and state tensors ``keys(item)`` are views of flat copies, one per key, dtype and
    device for all the pieces, for a rule to update in place; the gradient (the same rows) is the item's own, only
    read. Returns the copies and, per flat copy, ``(targets, flat, views)`` (:func:`write_back`)."""
    wanted: list[tuple[int, str, Tensor]] = []
    for j, (it, rows) in enumerate(pieces):
        if with_param:
            wanted.append((j, "", it.param if rows is None else it.param[rows]))
        for k in keys(it):
            t = it.state[k]
            wanted.append((j, k, t if rows is None else t[rows]))
    groups: dict[tuple, list[int]] = {}
    for n, (_, k, t) in enumerate(wanted):
        groups.setdefault((k, t.dtype, t.device), []).append(n)
    made: dict[int, Tensor] = {}
    flats = []
    for idx in groups.values():
        targets = [wanted[n][2] for n in idx]
        flat, views = flat_copy(targets)
        made.update(zip(idx, views, strict=True))
        flats.append((targets, flat, views))
    copies = []
    by_piece: dict[int, list[int]] = {}
    for n, (j, _, _) in enumerate(wanted):
        by_piece.setdefault(j, []).append(n)
    for j, (it, rows) in enumerate(pieces):
        state = dict(it.state)
        param = it.param if rows is None else it.param[rows]
        for n in by_piece.get(j, []):
            if wanted[n][1] == "":
                param = made[n]
            else:
                state[wanted[n][1]] = made[n]
        grad = it.grad if rows is None or it.grad is None else it.grad[rows]
        copies.append(Item(param, grad, state, it.name, it.shape if rows is None else param.shape, it.kind, it.index))
    return copies, flats


#: The state key the engine keeps itself (the skipped steps): no rule writes it.
SKIPPED = "skipped_steps"

#: Elements per row block of a per-tensor elementwise stepping rule's gated step (2 MiB of float32, as
#: ``blockwise.BLOCK_ELEMENTS``): its copies stay a few blocks, whatever the parameter's size.
BLOCK_ELEMENTS = 1 << 19


def _blocks(t: Tensor, limit: int = BLOCK_ELEMENTS) -> list[slice | None]:
    """Row ranges of ``t`` of at most ``limit`` elements (one row at least), or ``[None]`` (all of it)."""
    if t.ndim == 0 or t.numel() <= limit:
        return [None]
    step = max(1, limit // max(1, t[:1].numel()))
    return [slice(i, min(i + step, t.shape[0])) for i in range(0, t.shape[0], step)]


def _written(it: Item) -> list[str]:
    """The state tensors a stepping rule may write: every one but the engine's counter."""
    return [k for k, v in it.state.items() if isinstance(v, Tensor) and k != SKIPPED]


def _row_pieces(it: Item, limit: int) -> list[slice | None]:
    """Row ranges of ``it`` of at most ``limit`` elements (an elementwise rule's step of a piece is the piece of its
    step), where its state tensors are shaped like it; else the whole item."""
    if any(it.state[k].shape != it.param.shape for k in _written(it)):
        return [None]
    return _blocks(it.param, limit)


def stepping_(step: Callable[[list[Item]], None], items: Sequence[Item], *, foreach: bool, elementwise: bool,
              gate: Gate | None, parts: int = 4, gated: bool = False) -> None:
    """A stepping rule's own step (``step(items)``, in place: AdamW's, SCALE's) in the commit. Ungated, as it is.
    Gated, on copies (:func:`shadow_items`) then written back unless the step is skipped: batched (``foreach``) a
    chunk of about ``1 / parts`` of the items' bytes at a time (an elementwise rule's large items cut into row
    pieces, so that a chunk's copies stay within the step's transient bound), one ``where`` per flat copy; per
    tensor each item (an elementwise rule's by row blocks), one ``where`` per tensor."""
    items = list(items)
    if gate is None or gated:  # ``gated``: the rule's own writes read the flag (``SteppingRule.gates_itself``)
        step(items)
        return
    if not foreach:
        for it in items:
            for rows in (_row_pieces(it, BLOCK_ELEMENTS) if elementwise else [None]):
                copies, flats = shadow_items([(it, rows)], _written, True)
                step(copies)
                for targets, _, views in flats:
                    for t, v in zip(targets, views, strict=True):
                        torch.where(gate.skip(t.device), t, v, out=t)
        return
    total = sum(it.param.numel() for it in items)
    limit = max(1, -(-total // parts))
    pieces = [(it, rows) for it in items for rows in (_row_pieces(it, limit) if elementwise else [None])]
    chunk: list[tuple[Item, slice | None]] = []
    held = 0
    for n, (it, rows) in enumerate(pieces):
        size = it.param.numel() if rows is None else it.param[rows].numel()
        if chunk and held + size > limit + limit // 4:  # room for small tensors (norms) beside a full piece
            _step_chunk(step, chunk, gate)
            chunk, held = [], 0
        chunk.append((it, rows))
        held += size
        if n == len(pieces) - 1:
            _step_chunk(step, chunk, gate)


def _step_chunk(step: Callable[[list[Item]], None], chunk: list[tuple[Item, slice | None]], gate: Gate) -> None:
    """:func:`stepping_`'s step of one chunk of pieces on their copies, written back unless the step is skipped."""
    copies, flats = shadow_items(chunk, _written, True)
    step(copies)
    del copies
    while flats:
        targets, flat, views = flats.pop()
        write_back(targets, flat, views, gate)
        del targets, flat, views
