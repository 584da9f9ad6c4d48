"""Matrix views: the matrices an optimizer sees in a parameter, declared per parameter, not guessed.

Every rule that works on matrices (Newton-Schulz, MeqMuon's row/column choice and normalisations,
NorMuon's row statistics, MuonEq's equilibration, SCALE's row/column rules, Moonlight's
``sqrt(max(m, n))``) sees a parameter through one *view*. Rows are always output features.

``"matrix"``              one ``(shape[0], prod(rest))`` matrix: 2-D weights and convolution kernels
                          ``(out, in, k...)``.
``"stacked"``             a batch of ``(shape[-2], shape[-1])`` matrices over the leading dims, e.g.
                          MoE experts ``(E, out, in)``: each handled as if it were its own parameter.
``"transposed"``          a 2-D weight stored ``(in, out)`` (GPT-2's ``Conv1D``): the matrix is ``W^T``.
``"stacked-transposed"``  a batch of such ``(in, out)`` matrices.
``"vectors"``             a batch of vectors over the leading dims, e.g. per-expert biases ``(E, k)``: each
                          updated as its own 1-D parameter by the vector rule (``vector`` kind only).

A 2-D ``(E * rows, cols)`` tensor may hold ``E`` matrices stacked along its rows (DBRX's experts
``w1``, ``v1``, ``w2``): ``folds=E`` with a stacked view reads it as ``(E, rows, cols)``, the expert
matrices themselves (``"stacked"`` for ``(out, in)`` blocks, ``"stacked-transposed"`` for ``(in, out)``
blocks), without a copy.

A *split* cuts each matrix along its rows into blocks (a fused projection's q/k/v sizes, gate/up
halves), each then handled as its own matrix, so a fused model trains as its unfused twin would. An
*interleaved* split takes its ``k`` equal blocks row by row instead (block ``j`` holds rows ``j, j + k,
...``: GPT-OSS's gate and up, ``gate_up[..., ::2]`` and ``gate_up[..., 1::2]``), as strided views.

Views, splits, folds and interleaving live in param groups as lists parallel to ``params`` (``views``,
``splits``, ``folds``, ``interleaved``; plain strings, tuples, ints and bools, so ``state_dict()``
loads with ``torch.load(weights_only=True)``); :func:`meqmuon.param_groups` writes them from the
model's module types, and a group may override them (``docs/algorithm.md``, "Routing"). A parameter
whose view is one whole matrix is updated as it always was; any other is handed to the rules as its
matrices, each a view sharing the parameter's storage, so the rules need no knowledge of views and
each matrix's update is exactly that of a 2-D parameter holding it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["VIEWS", "Layout", "layout_of", "normalise_group_views"]

VIEWS = ("matrix", "stacked", "transposed", "stacked-transposed", "vectors")


@dataclass(frozen=True)
class Layout:
    """The matrices of one parameter: ``batch`` leading dims, each a ``rows x cols`` matrix (after
    any transposition) cut into row ``blocks``.

    Attributes:
        view: one of :data:`VIEWS`.
        batch: leading dims of a stacked view (``()`` otherwise).
        rows, cols: the matrix, rows being output features.
        blocks: row-block sizes (``(rows,)`` when not split).
        split: whether the parameter was split (``blocks`` came from a split).
        folded: a 2-D parameter whose rows hold the ``batch[0]`` matrices one after another.
        interleaved: the split's (equal) blocks take the rows in turn rather than in runs.
    """

    view: str
    batch: tuple[int, ...]
    rows: int
    cols: int
    blocks: tuple[int, ...]
    split: bool
    folded: bool = False
    interleaved: bool = False

    @property
    def whole(self) -> bool:
        """One matrix, the parameter itself: updated as a 2-D parameter always was."""
        return self.view == "matrix" and not self.split

    @property
    def transposed(self) -> bool:
        return self.view.endswith("transposed")

    @property
    def count(self) -> int:
        """Number of matrices the rules see."""
        return math.prod(self.batch) * len(self.blocks)

    def shapes(self) -> list[tuple[int, int]]:
        """The ``(rows, cols)`` of every matrix, in the order of :meth:`matrices`."""
        return [(b, self.cols) for _ in range(math.prod(self.batch)) for b in self.blocks]

    @property
    def counter_shape(self) -> tuple[int, ...]:
        """Shape of a per-matrix counter (MeqMuon's ``rows_chosen``): ``()`` for one whole matrix."""
        return self.batch + ((len(self.blocks),) if self.split else ())

    @property
    def rows_shape(self) -> tuple[int, ...]:
        """Shape of per-row state (NorMuon's second moment): one value per row of every matrix."""
        return (*self.batch, self.rows)

    def one(self) -> Layout | None:
        """The layout of one matrix of a stack over one leading dim (an expert of ``(E, out, in)``), as a parameter of
        that matrix's shape would have it: its transposition and split kept; ``None`` where that is one whole
        matrix. The exchange's unit of one expert (``placement.by_matrix``) is cut by it at its owner."""
        view = "transposed" if self.transposed else "matrix"
        one = Layout(view, (), self.rows, self.cols, self.blocks, self.split, False, self.interleaved)
        return None if one.whole else one

    def labels(self, first: slice | None = None) -> list[str]:
        """Suffixes naming each matrix: ``[e]`` for a stacked index, ``#j`` for a row block;
        ``first`` restricts the first batch dim (the stacks an FSDP2 rank holds)."""
        ranges = [range(n) for n in self.batch]
        if first is not None and ranges:
            ranges[0] = ranges[0][first]
        idx = [f"[{','.join(map(str, i))}]" for i in itertools.product(*ranges)]
        blocks = [f"#{j}" for j in range(len(self.blocks))] if self.split else [""]
        return [i + b for i in idx for b in blocks]

    def matrices(self, t: Tensor) -> list[Tensor]:
        """The matrices of ``t`` (shaped like the parameter, or its local dim-0 shard under FSDP2),
        each a view sharing ``t``'s storage, in the order of :meth:`labels`."""
        if self.folded:  # splitting dim 0 is always a view
            t = t.unflatten(0, (self.batch[0], -1))
        mats = _unbind(t, len(self.batch)) if self.batch else [t.reshape(t.shape[0], -1) if t.ndim > 2 else t]
        if self.transposed:
            mats = [m.mT for m in mats]
        return [blk for m in mats for blk in self._cut(m)]

    def row_pieces(self, t: Tensor) -> list[Tensor]:
        """Per-row state ``t`` (shaped :attr:`rows_shape`, or its local shard) cut like :meth:`matrices`."""
        vecs = _unbind(t, len(self.batch)) if self.batch else [t]
        return [blk for v in vecs for blk in self._cut(v)]

    def counters(self, t: Tensor) -> list[Tensor]:
        """A per-matrix counter ``t`` (shaped :attr:`counter_shape`) as one 0-D view per matrix."""
        return [t] if t.ndim == 0 else list(t.reshape(-1).unbind(0))

    def _cut(self, m: Tensor) -> list[Tensor]:
        if not self.split:
            return [m]
        if self.interleaved:
            k = len(self.blocks)
            return [m[j::k] for j in range(k)]
        out, start = [], 0
        for b in self.blocks:
            out.append(m[start : start + b])
            start += b
        return out


def _unbind(t: Tensor, depth: int) -> list[Tensor]:
    """``t``'s sub-tensors over its first ``depth`` dims, as views (``unbind`` never copies, unlike a
    ``reshape`` of a non-contiguous tensor)."""
    parts = [t]
    for _ in range(depth):
        parts = [s for p in parts for s in p.unbind(0)]
    return parts


def layout_of(shape: Sequence[int], view: str = "matrix", split: Sequence[int] | None = None,
              name: str = "parameter", folds: int | None = None, interleaved: bool = False) -> Layout:
    """The :class:`Layout` of a parameter of ``shape`` under ``view``, ``split``, ``folds`` and
    ``interleaved``.

    Raises:
        ValueError: naming the parameter, for a view its shape cannot have, a split whose blocks
            do not add up to the matrix's rows, or ``folds`` that do not divide a 2-D tensor's rows.
    """
    shape = tuple(int(s) for s in shape)
    if view not in VIEWS:
        raise ValueError(f"{name}: unknown matrix view {view!r}; valid views: {', '.join(VIEWS)}")
    if len(shape) < 2:
        if view != "matrix" or split is not None or folds is not None:
            raise ValueError(f"{name} of shape {shape} has no matrix to view as {view!r}, split or fold")
        return Layout("matrix", (), 1, math.prod(shape), (1,), False)
    folded = folds is not None
    if folded:
        if (isinstance(folds, bool) or not isinstance(folds, int) or folds < 1 or len(shape) != 2
                or shape[0] % folds or view not in ("stacked", "stacked-transposed")):
            raise ValueError(f"{name}: folds={folds!r} needs a 2-D (E * rows, cols) tensor whose rows E divides, "
                             f"viewed 'stacked' or 'stacked-transposed'; got shape {shape}, view {view!r}")
        shape = (folds, shape[0] // folds, shape[1])
    if view == "vectors":
        if split is not None:
            raise ValueError(f"{name}: view 'vectors' cannot be split")
        return Layout(view, shape[:-1], 1, shape[-1], (1,), False)
    if view == "matrix":
        batch, rows, cols = (), shape[0], math.prod(shape[1:])
    elif view == "transposed":
        if len(shape) != 2:
            raise ValueError(f"{name}: view 'transposed' needs a 2-D (in, out) weight, got shape {shape}")
        batch, rows, cols = (), shape[1], shape[0]
    else:
        if len(shape) < 3:
            raise ValueError(f"{name}: view {view!r} needs a >=3-D stack of matrices (or folds), got shape {shape}")
        batch = shape[:-2]
        rows, cols = (shape[-1], shape[-2]) if view == "stacked-transposed" else (shape[-2], shape[-1])
    if split is None:
        if interleaved:
            raise ValueError(f"{name}: interleaved=True needs a split into equal blocks")
        return Layout(view, batch, rows, cols, (rows,), False, folded)
    blocks = tuple(split)
    if (not blocks or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks)
            or sum(blocks) != rows):
        raise ValueError(f"{name}: split {blocks} must be positive integers adding up to the matrix's "
                         f"{rows} rows (view {view!r} of shape {shape})")
    if interleaved and len(set(blocks)) != 1:
        raise ValueError(f"{name}: an interleaved split needs equal blocks, got {blocks}")
    return Layout(view, batch, rows, cols, blocks, True, folded, bool(interleaved))


def normalise_group_views(group: dict[str, Any], names: Sequence[str]) -> None:
    """Check a param group's ``views`` / ``splits`` / ``folds`` and store them as per-parameter lists.

    A group may give one view (a string), one split (``None``: no parameter is split) or one fold
    count (an int, or ``None``) for all its parameters, the per-group override;
    :func:`meqmuon.param_groups` writes lists.
    """
    n = len(group["params"])
    for key, single in (("views", lambda v: isinstance(v, str)), ("splits", lambda v: v is None),
                        ("folds", lambda v: v is None or isinstance(v, int)),
                        ("interleaved", lambda v: isinstance(v, bool))):
        if key not in group:
            continue
        value = group[key]
        if single(value):
            group[key] = [value] * n
        elif not isinstance(value, list | tuple) or len(value) != n:
            raise ValueError(f"param group '{key}' must be one value or a list with one entry per parameter "
                             f"({n}); got {value!r}")
        else:
            group[key] = [tuple(v) if key == "splits" and v is not None else v for v in value]
    views = group.get("views", ["matrix"] * n)
    splits = group.get("splits", [None] * n)
    folds = group.get("folds", [None] * n)
    inter = group.get("interleaved", [False] * n)
    for p, name, view, split, fold, il in zip(group["params"], names, views, splits, folds, inter, strict=True):
        layout_of(p.shape, view, split, name, fold, il)  # raises naming the parameter


def group_layout(group: dict[str, Any], i: int, shape: Sequence[int], name: str = "parameter") -> Layout:
    """The layout of parameter ``i`` of ``group`` (global ``shape``)."""
    views, splits, folds, inter = (group.get(k) for k in ("views", "splits", "folds", "interleaved"))
    return layout_of(shape, views[i] if views else "matrix", splits[i] if splits else None, name,
                     folds[i] if folds else None, inter[i] if inter else False)
