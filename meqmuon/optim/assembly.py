"""An owner's whole tensors put together from every rank's pieces (the exchange's way out, ``exchange.py``).

What a rank receives in the exchange's one ``all_to_all_single`` is every sender's pieces, rank ``0``'s first, each
sender's in the order of the units this rank owns. Copied one piece at a time, an owner of ``U`` units of ``W``
ranks' pieces pays ``U * W`` copies: a kernel launch each on a GPU, 30,000 a step at an owner of DeepSeek-V3's
experts as units of their own on 1,024 ranks (``placement.by_matrix``). A *run* -- owned units next to one another
in that order that travel as one tensor each, in one dtype, with one descriptor (so one box layout per sender) --
is received into rows of one tensor instead, and each sender's pieces of it land in one copy per box: ``W`` copies a
run, or one where the senders' pieces tile the matrices (:func:`_tiled`: the received bytes are then the stack at a
stride). The bits are the same: each piece's bytes are copied to the same elements.

The way back (:func:`cut_out`, :func:`in_runs`, :func:`received_back`) mirrors it: an owner sends a rank its
pieces of alike units part by part (every unit's first part, then every unit's second, ...), so that the rank
receives each part of a stretch as one ``(k, ...)`` tensor, and eq. 8's factors are applied to a stretch in two
kernels, not two per unit (``transfer.apply_received``). The same bytes travel, in another order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from .distributed import offsets, received_as

__all__ = ["Received", "Run", "alike", "aligned", "cut_out", "in_runs", "put_together", "received_back", "runs"]


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
    mine = [j for j, u in enumerate(units) if u.mine]
    # alike: one tensor each, of one descriptor, dtype and owner, all in the handed stack or none (else alone)
    out = [[mine[i] for i in stretch] for stretch in alike([
        (id(units[j].descriptor(keys[j][0])), units[j].assigned, pieces[j][0].dtype, j in row) if len(keys[j]) == 1
        else object() for j in mine])]
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


def put_together(done: Sequence[Run], out: Tensor, world: int, memo: dict | None = None) -> None:
    """:func:`runs`' received bytes ``out`` (rank ``0``'s first, each sender's in the runs' order) copied into their
    wholes by their boxes: a run's in one copy where its senders' pieces tile its matrices (:func:`_tiled`; ``memo``
    keeps what the boxes say, by unit, for the exchange's life), else per sender and box; a lone unit's per sender,
    tensor and box."""
    start = 0
    at: dict[int, dict[int, int]] = {}  # per run, where each sender's pieces of it start in ``out``
    for r in range(world):
        for run in done:
            if r not in run.where[0]:
                continue
            if run.stack is not None:
                at.setdefault(id(run), {})[r] = start
                start += len(run.members) * math.prod(run.where[0][r][1]) * run.stack.element_size()
                continue
            for t, w in zip(run.wholes[0], run.where, strict=True):
                boxes, shape = w[r]
                n = math.prod(shape) * t.element_size()
                piece = received_as(out[start : start + n], t.dtype, shape)
                for g, loc in boxes:
                    t[g].copy_(piece[loc])
                start += n
    for run in done:
        if run.stack is None:
            continue
        if _tiled(run, at[id(run)], out, {} if memo is None else memo):
            continue
        for r, a in at[id(run)].items():
            boxes, shape = run.where[0][r]
            n = len(run.members) * math.prod(shape) * run.stack.element_size()
            piece = received_as(out[a : a + n], run.stack.dtype, (len(run.members), *shape))
            for g, loc in boxes:
                run.stack[(slice(None), *g)].copy_(piece[(slice(None), *loc)])


def _tiled(run: Run, at: dict[int, int], out: Tensor, memo: dict) -> bool:
    """A run's pieces copied into its stack in one copy, where they tile its matrices (:func:`_grid`, worked out once
    per layout and kept in ``memo``) and the senders' bytes lie at equal, aligned strides in ``out``: then ``out``
    holds ``(*digits, k, *piece)`` at a stride, which is the stack with each split dimension's blocks split into its
    digits, moved first. Whether it was done."""
    ranks, stack = sorted(at), run.stack
    assert stack is not None
    item, k = stack.element_size(), len(run.members)
    key = (id(run.where[0]), tuple(stack.shape[1:]))  # the unit's boxes, kept as long as the exchange (Unit.where)
    if key not in memo:
        memo[key] = _grid(run.where[0], ranks, tuple(stack.shape[1:]))
    grid = memo[key]
    step = at[ranks[1]] - at[ranks[0]] if len(ranks) > 1 else 0
    if (grid is None or out.storage_offset() % item or step % item or at[ranks[0]] % item
            or any(at[r] != at[ranks[0]] + i * step for i, r in enumerate(ranks))):
        return False
    shape, sizes, unflat, moved = grid
    typed = out[: out.numel() - out.numel() % item].view(stack.dtype)
    inner = [math.prod(shape[e:]) for e in range(len(shape) + 1)]  # (k, *shape)'s contiguous strides
    src = typed.as_strided((*sizes, k, *shape), (*(step // item * math.prod(sizes[j + 1 :]) for j in range(len(sizes))),
                                                 *inner), typed.storage_offset() + at[ranks[0]] // item)
    dst = stack
    for d, parts in unflat:
        dst = dst.unflatten(1 + d, parts)
    dst.movedim(moved, list(range(len(sizes)))).copy_(src)
    return True


def _grid(where: dict, ranks: list[int], whole: tuple[int, ...]) -> tuple | None:
    """Whether the pieces of ``ranks`` (their boxes in ``where``, ``exchange.Exchange._where``) tile a matrix of shape
    ``whole``: each one box, a block of an equal grid over the dimensions they split, the senders in rank order walking
    the blocks' indices as the digits of a mixed-radix number (:func:`_digits`: FSDP2's even rows, torchtitan's experts'
    even slices, FSDP2 x TP's rows by columns, its strided rows). Returns the piece's shape, the digits' sizes, how to
    split the stack's dimensions into them (``(dimension, sizes)``, the last first) and where they then lie; None."""
    if len(ranks) < 2 or any(len(where[r][0]) != 1 for r in ranks):
        return None
    shape = where[ranks[0]][1]
    split = [d for d in range(len(whole)) if shape[d] != whole[d]]
    if not all(shape):  # an empty piece: the shards are uneven
        return None
    count = {d: whole[d] // shape[d] for d in split}
    if not split or any(whole[d] % shape[d] for d in split) or math.prod(count.values()) != len(ranks):
        return None
    blocks = []
    for r in ranks:
        [(g, _)], piece = where[r]
        index = {d: g[d].start // shape[d] for d in split}
        if (piece != shape or any(g[d] != slice(index[d] * shape[d], (index[d] + 1) * shape[d]) for d in split)
                or any(g[e] != slice(0, whole[e]) for e in range(len(whole)) if e not in count)):
            return None
        blocks.append(index)
    digits = _digits(blocks, count)
    if digits is None:
        return None
    unflat, at = [], {}
    for d in sorted(split, reverse=True):  # each split dimension's blocks as its digits, most significant first
        mine = sorted((j for j, (e, _, _) in enumerate(digits) if e == d), key=lambda j: -digits[j][2])
        unflat.append((d, (*(digits[j][1] for j in mine), shape[d])))
        at.update({j: (d, n) for n, j in enumerate(mine)})
    # where each digit's dimension then lies: after k, the dimensions before its own, each split one grown by its digits
    grown = {d: sum(e == d for e, _, _ in digits) for d in split}
    moved = [1 + d + sum(grown[e] for e in split if e < d) + n for d, n in (at[j] for j in range(len(digits)))]
    return shape, [n for _, n, _ in digits], unflat, moved


def _digits(blocks: Sequence[dict[int, int]], count: dict[int, int]) -> list[tuple[int, int, int]] | None:
    """How the ``i``-th sender's block indices (``blocks[i]``, per split dimension ``d`` of ``count[d]`` blocks) follow
    from ``i``: as ``(dimension, size, weight)`` digits of ``i``, most significant first, each adding ``weight`` times
    its value to its dimension's index. Tried: the dimensions in any order (a grid walked row-major), and one
    dimension's blocks as ``b`` blocks of ``a`` walked ``a`` first (strided shards: ``i = x b + y`` holds block
    ``y a + x``). None where neither fits."""
    split = list(count)
    candidates = [[(d, count[d], 1) for d in o] for o in itertools.permutations(split)]
    if len(split) == 1:
        c = count[split[0]]
        candidates += [[(split[0], c // b, 1), (split[0], b, c // b)] for b in range(2, c) if c % b == 0]
    for digits in candidates:
        sizes = [n for _, n, _ in digits]
        if all(all(sum(w * (i // math.prod(sizes[j + 1 :]) % n) for j, (e, n, w) in enumerate(digits) if e == d) == b[d]
                   for d in split) for i, b in enumerate(blocks)):
            return digits
    return None


def alike(keys: Sequence[Hashable]) -> list[list[int]]:
    """The positions of ``keys`` in maximal stretches of equal keys, in order."""
    out: list[list[int]] = []
    for i, k in enumerate(keys):
        if out and keys[out[-1][0]] == k:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def cut_out(units: Sequence[Any], wholes: Sequence[Sequence[Tensor] | None], keys: Sequence[Sequence[str | None]],
            where_of: Callable[[Any, str], dict], world: int) -> list[list[Tensor]]:
    """The way back at an owner: per rank, what it sends there (:func:`in_runs`' order) of its units' ``wholes[j]``
    (``None`` where it owns none), each tensor cut by ``keys[j]`` (``where_of(unit, key)``: per rank, its boxes;
    ``None``, or a DDP unit: the tensor whole) for every rank of the unit's group."""
    per_rank: list[list[list[Tensor]]] = [[] for _ in range(world)]  # per rank, per unit its pieces
    for u, ws, ks in zip(units, wholes, keys, strict=True):
        if ws is None:
            continue
        where = [None if u.replicas or k is None else where_of(u, k) for k in ks]
        for r in u.group:
            parts = []
            for t, w in zip(ws, where, strict=True):
                if w is None:
                    parts.append(t)
                    continue
                boxes, shape = w[r]
                if len(boxes) == 1:
                    parts.append(t[boxes[0][0]])
                    continue
                piece = torch.empty(shape, dtype=t.dtype, device=t.device)
                for g, loc in boxes:
                    piece[loc].copy_(t[g])
                parts.append(piece)
            per_rank[r].append(parts)
    return [in_runs(ps) for ps in per_rank]


def in_runs(per_unit: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """An owner's pieces for one rank (per unit, in the call's order, its parts) in the order they travel: each
    stretch of units whose parts are alike (elements and dtype, part by part) part by part, every unit's first part,
    then every unit's second, ... (:func:`received_back` reads them so)."""
    out: list[Tensor] = []
    for run in alike([tuple((p.numel(), p.dtype) for p in ps) for ps in per_unit]):
        for k in range(len(per_unit[run[0]])):
            out += [per_unit[j][k] for j in run]
    return out


class Received(list):
    """Per unit its received parts (views of the one receive buffer), and :attr:`runs`: per stretch of alike units
    from one owner (:func:`in_runs`), ``(members, stacks)``: the units' positions and per part the stretch's parts as
    one ``(k, *shape)`` tensor (``None`` where the units' shapes differ)."""

    runs: list[tuple[list[int], list[Tensor | None]]]


def received_back(specs: Sequence[list[tuple[Sequence[int], torch.dtype]] | None], owners: Sequence[int],
                  kept: Sequence[list[Tensor] | None], flat: Tensor, sizes: Sequence[int]) -> Received:
    """The way back's received bytes ``flat`` (rank ``0``'s first, ``sizes[o]`` of them from owner ``o``) as per unit
    its parts in the shapes and dtypes of ``specs[j]`` from owner ``owners[j]`` (``None``: the unit's ``kept`` parts,
    a DDP owner's own), read in :func:`in_runs`' order: a stretch's part as one tensor (:func:`aligned`), each unit's
    a view of it."""
    mine: list[list[int]] = [[] for _ in sizes]
    for j, spec in enumerate(specs):
        if spec is not None:
            mine[owners[j]].append(j)
    starts = offsets(sizes)
    blocks: list[tuple[int, Tensor, torch.dtype, list[tuple[int, ...]]]] = []  # per part: its run, bytes, shapes
    runs: list[list[int]] = []
    for o, js in enumerate(mine):
        start = starts[o]
        for run in alike([tuple((math.prod(s), dt) for s, dt in specs[j]) for j in js]):  # type: ignore[union-attr]
            members = [js[i] for i in run]
            for k, (_, dtype) in enumerate(specs[members[0]]):  # type: ignore[union-attr]
                shapes = [tuple(specs[j][k][0]) for j in members]  # type: ignore[index]
                n = len(members) * math.prod(shapes[0]) * dtype.itemsize
                blocks.append((len(runs), flat[start : start + n], dtype, shapes))
                start += n
            runs.append(members)
    got = Received(ws if spec is None else [] for spec, ws in zip(specs, kept, strict=True))
    got.runs = [(members, []) for members in runs]
    for (r, _, _, shapes), block in zip(blocks, aligned([b[1] for b in blocks], [b[2] for b in blocks]), strict=True):
        members, stacks = got.runs[r]
        n = math.prod(shapes[0])
        for i, (j, shape) in enumerate(zip(members, shapes, strict=True)):
            got[j].append(block[i * n : (i + 1) * n].view(shape))
        stacks.append(block.view(len(members), *shapes[0]) if len(set(shapes)) == 1 else None)
    return got


def aligned(raw: Sequence[Tensor], dtypes: Sequence[torch.dtype]) -> list[Tensor]:
    """Received bytes ``raw[i]`` (1-D ``uint8`` views) as ``dtypes[i]``: a view where they lie aligned for it, else
    a copy, all such copies made by one ``cat`` (a kernel, not one a block), each at an offset its dtype aligns."""
    late = [i for i, (r, dt) in enumerate(zip(raw, dtypes, strict=True)) if r.storage_offset() % dt.itemsize]
    out = list(raw)
    if late:
        pad = torch.empty(16, dtype=torch.uint8, device=raw[0].device)  # never read: only moves the next block on
        parts, at, pos = [], [], 0
        for i in late:
            gap = -pos % dtypes[i].itemsize
            parts += [pad[:gap], raw[i]]
            at.append(pos + gap)
            pos += gap + raw[i].numel()
        buf = torch.cat(parts)
        for i, a in zip(late, at, strict=True):
            out[i] = buf[a : a + raw[i].numel()]
    return [o.view(dt) for o, dt in zip(out, dtypes, strict=True)]
