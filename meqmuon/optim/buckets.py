"""Shape buckets: the one place that groups parameters for the batched (``foreach``) step.

The batched step works on a *stack* ``(K, *shape)`` of same-shape tensors, so that momentum,
Newton-Schulz, statistics and the update are a few kernels per bucket instead of a few per
parameter (on a GPU an optimizer step is launch-bound before it is FLOP-bound; karpathy/nanochat's
``MuonAdamW``, modded-nanogpt's parameter banks and microsoft/dion's ``megabatch_base.py`` all
group by shape for this reason).

A bucket holds the parameters of one rule call with the same (matrix) shape, dtype and device.
For rules where it stays exact (Newton-Schulz commutes with transposition; MeqMuon's statistics
are then taken along each member's original rows), an ``(n, m)`` matrix (a 2-D parameter, or the
matrix view of a 3-D+ one) joins the bucket of ``(m, n)`` transposed: Llama's ``down_proj``
(d x f) is orthogonalised in one batched call with ``gate_proj`` and ``up_proj`` (f x d). The
orientation of a bucket is that of its first member, so it depends only on the parameter order
(identical on every rank). Members stored as they are come first, transposed members after them,
so each kind is one contiguous slice of the stack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["Bucket", "make_buckets", "matrix_shape"]


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix an optimizer sees for a tensor of ``shape``: ``(shape[0], prod(rest))``."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))


class Bucket:
    """Same-shape members of one rule call, stacked as ``(len(items), *shape)``.

    Attributes:
        items: the members (``rules.Item``); ``items[:plain]`` are stacked as they are,
            ``items[plain:]`` transposed.
        shape: the shape of one member in the stack: its (local) matrix view for matrix rules,
            else its own shape.
        global_shape: the same for the full (unsharded) tensor, as the maths sees it.
        key: what the bucket was grouped by; stable across steps and ranks (workspaces use it).
    """

    __slots__ = ("items", "plain", "shape", "global_shape", "key")

    def __init__(self, items: list[Any], plain: int, shape: tuple[int, ...], global_shape: tuple[int, ...],
                 key: tuple) -> None:
        self.items = items
        self.plain = plain
        self.shape = shape
        self.global_shape = global_shape
        self.key = key

    def __len__(self) -> int:
        return len(self.items)

    @property
    def transposed(self) -> int:
        """Number of members stored transposed (the last ones)."""
        return len(self.items) - self.plain

    def members(self, values: Sequence[Tensor], start: int = 0) -> tuple[list[Tensor], list[Tensor]]:
        """``values`` (one per member from ``start`` on) split into the plain and the transposed
        ones, the latter as transposed views, ready to be stacked into the bucket's orientation."""
        cut = max(0, self.plain - start)
        return list(values[:cut]), [v.mT for v in values[cut:]]

    def stack_into(self, out: Tensor, values: Sequence[Tensor], start: int = 0) -> Tensor:
        """Stack ``values`` (members ``start..start+len(values)`` in their own shapes) into ``out``
        ``(len(values), *shape)`` in the bucket's orientation, casting to ``out.dtype`` on the way:
        one ``stack`` for both orientations (it reads the transposed members through strided views)."""
        matrix = len(self.shape) == 2  # a matrix bucket stacks matrix views; others the tensors as they are
        plain, flipped = self.members([v.reshape(v.shape[0], -1) if matrix and v.ndim > 2 else v for v in values],
                                      start)
        return torch.stack(plain + flipped, out=out)

    def unstack(self, stacks: Tensor | Sequence[Tensor], start: int = 0) -> list[Tensor]:
        """Members ``start..`` of a stack (or consecutive stacks) of directions, each row one member's
        direction in its own orientation (any shape with its number of elements), as views in the
        members' shapes."""
        rows = [r for s in ([stacks] if isinstance(stacks, Tensor) else stacks) for r in s.unbind(0)]
        return [t.view(it.param.shape) for t, it in zip(rows, self.items[start:], strict=True)]  # contiguous rows


def make_buckets(items: Sequence[Any], *, matrix: bool, transpose: bool, by_shape: bool = True) -> list[Bucket]:
    """Group ``items`` (``rules.Item``) into buckets, in first-appearance order.

    Args:
        matrix: stack matrix views ``(shape[0], prod(rest))`` (matrix rules); else the tensors'
            own shapes.
        transpose: let an ``(n, m)`` member (its matrix view) join an ``(m, n)`` bucket transposed.
        by_shape: group by shape at all; ``False`` groups by dtype and device only (for rules
            that never stack, such as AdamW's ``torch._foreach_*`` step).
    """
    found: dict[tuple, list[Any]] = {}
    flipped: dict[tuple, list[Any]] = {}
    orientation: dict[tuple, tuple[int, ...]] = {}
    for it in items:
        gshape = matrix_shape(it.shape) if matrix else tuple(it.shape)
        base = (it.param.dtype, it.param.device)
        if not by_shape:
            found.setdefault(base, []).append(it)
            continue
        key = (*base, tuple(sorted(gshape)) if transpose else gshape)
        first = orientation.setdefault(key, gshape)
        (found if gshape == first else flipped).setdefault(key, []).append(it)
    buckets = []
    for key, members in found.items():  # the first member of a key fixes its orientation: never all flipped
        first = members[0]
        lshape = matrix_shape(first.param.shape) if matrix else tuple(first.param.shape)
        gshape = matrix_shape(first.shape) if matrix else tuple(first.shape)
        buckets.append(Bucket(members + flipped.get(key, []), len(members), lshape, gshape, key))
    return buckets
