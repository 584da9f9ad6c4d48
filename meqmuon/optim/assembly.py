"""An owner's whole tensors put together from every rank's pieces (the exchange's way out, ``exchange.py``).

What a rank receives in the exchange's one ``all_to_all_single`` is every sender's pieces, rank ``0``'s first, each
sender's in the order of the units this rank owns. Copied one piece at a time, an owner of ``U`` units of ``W``
ranks' pieces pays ``U * W`` copies: a kernel launch each on a GPU, 30,000 a step at an owner of DeepSeek-V3's
experts as units of their own on 1,024 ranks (``placement.by_matrix``). A *run* -- owned units next to one another
in that order that travel as one tensor each, in one dtype, with one descriptor (so one box layout per sender) --
is received into rows of one tensor instead, and each sender's pieces of it land in one copy per box: ``W`` copies a
run. The bits are the same: each piece's bytes are copied to the same elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .distributed import received_as

__all__ = ["Run", "put_together", "runs"]


class Run:
    """Owned units whose wholes are rows of ``stack`` (``(len(members), *shape)``), or one unit's wholes as they are
    (``stack`` None: several tensors travel for it, or it is alone): ``members`` the units' indices in the call,
    ``where`` per travelling tensor, per sender, its ``(boxes, local shape)`` (``exchange.Exchange._where``)."""

    __slots__ = ("members", "stack", "wholes", "where")

    def __init__(self, members: list[int], stack: Tensor | None, wholes: list[list[Tensor]], where: list[dict]) -> None:
        self.members, self.stack, self.wholes, self.where = members, stack, wholes, where


def runs(units: Sequence[Any], pieces: Sequence[Sequence[Tensor]], keys: Sequence[Sequence[str]],
         into: tuple[Tensor, list[int]] | None, where_of: Callable[[Any, str], dict]) -> list[Run]:
    """The owned units of a call (``units[j].mine``; ``pieces[j]`` this rank's, in ``keys[j]``'s layouts) in runs, their
    wholes made: maximal stretches, in the order their pieces arrive, of units that travel one tensor each, of one
    descriptor, dtype and owner, all in the handed stack or none (``into = (stack, js)``: unit ``js[k]``'s first
    whole in row ``k``), received as rows of one tensor (the stack's, or one made here); any other unit alone, its
    tensors made one by one (the first in the stack where it is handed one). ``where_of(unit, key)``: per sender,
    the boxes of its piece (``exchange.Exchange._where``)."""
    stack, rows = into if into is not None else (None, [])
    row = {j: k for k, j in enumerate(rows)}
    out: list[list[int]] = []
    last = None
    for j, (u, ks) in enumerate(zip(units, keys, strict=True)):
        if not u.mine:
            continue
        # alike: one tensor each, of one descriptor, dtype and owner, all in the handed stack or none
        key = None if len(ks) != 1 else (id(u.descriptor(ks[0])), u.assigned, pieces[j][0].dtype, j in row)
        if key is not None and out and key == last:
            out[-1].append(j)
        else:
            out.append([j])
        last = key
    made = []
    for members in out:
        u, ps, ks = units[members[0]], pieces[members[0]], keys[members[0]]
        where = [where_of(u, k) for k in ks]
        if len(ks) != 1:
            made.append(Run(members, None, [[
                stack[row[members[0]]].view(u.descriptor(k).shape) if n == 0 and members[0] in row else
                torch.empty(u.descriptor(k).shape, dtype=p.dtype, device=p.device)
                for n, (p, k) in enumerate(zip(ps, ks, strict=True))]], where))
            continue
        shape = u.descriptor(ks[0]).shape
        whole = (stack[row[members[0]] : row[members[-1]] + 1].view(len(members), *shape) if members[0] in row else
                 torch.empty((len(members), *shape), dtype=ps[0].dtype, device=ps[0].device))
        made.append(Run(members, whole, [[w] for w in whole.unbind(0)], where))
    return made


def put_together(done: Sequence[Run], out: Tensor, world: int) -> None:
    """:func:`runs`' received bytes ``out`` (rank ``0``'s first, each sender's in the runs' order) copied into their
    wholes by their boxes: a run's per sender and box in one copy, a lone unit's per sender, tensor and box."""
    start = 0
    for r in range(world):
        for run in done:
            if r not in run.where[0]:
                continue
            if run.stack is not None:
                boxes, shape = run.where[0][r]
                n = len(run.members) * math.prod(shape) * run.stack.element_size()
                piece = received_as(out[start : start + n], run.stack.dtype, (len(run.members), *shape))
                for g, loc in boxes:
                    run.stack[(slice(None), *g)].copy_(piece[(slice(None), *loc)])
                start += n
                continue
            for t, w in zip(run.wholes[0], run.where, strict=True):
                boxes, shape = w[r]
                n = math.prod(shape) * t.element_size()
                piece = received_as(out[start : start + n], t.dtype, shape)
                for g, loc in boxes:
                    t[g].copy_(piece[loc])
                start += n
