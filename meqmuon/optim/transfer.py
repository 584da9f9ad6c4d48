"""What travels back from an owner rank: a hidden matrix's direction, in the fewest bytes that keep its bits.

Wherever a matrix's Newton-Schulz runs at an owner (``placement.OWNERS``: DDP's shared work, FSDP2's row shards,
tensor parallelism's pieces), every other rank that holds the matrix, or a piece of it, needs its direction
``D = post(U)``, ``U = Orth(pre(X))``. Three forms, decided per rule class by :func:`form_of`:

- ``IDENTITY``: ``post`` is the identity (Muon in Moonlight's form, MuonEq, Aurora): ``U`` itself travels, in
  the Newton-Schulz dtype. Widening bf16 to float32 is exact, so each rank adds what one process adds.
- ``FACTORS``: the rule gives its ``post`` as per-row and per-column factors,
  ``D = (U * row) * col`` (MeqMuon's eq. 8) or ``(U / row) * col`` (NorMuon's division), through the public hook
  :meth:`HiddenRule.post_factors <meqmuon.optim.driver.HiddenRule.post_factors>`: ``U`` travels in the
  Newton-Schulz dtype with the factors of the rows and columns a rank covers, in ``D``'s dtype, and
  :func:`apply` makes each rank's block of ``D``, the owner's own product bit for bit on any block of rows or
  columns. Used only where it is fewer bytes than ``D`` (:func:`pays`): with bf16 ``U`` and a float32 ``D``,
  where ``2 (m + n) < m n`` for the piece; never with a float32 ``U``.
- ``DIRECTION``: any other ``post`` (or a subclass that overrides ``post`` but not ``post_factors``): ``D``
  itself, at least in the parameter's dtype.

Each rank decides the form from shapes and dtypes alone, identically, knowing what it will receive: no
collective. The factors travel in float32 (``D``'s dtype), since exact bits need them; measured: bf16 MeqMuon
and NorMuon move 1.01x the floor on 2-4 gloo ranks (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import functional as F

__all__ = ["DIRECTION", "FACTORS", "IDENTITY", "Factors", "apply", "apply_received", "form_of", "pays"]

IDENTITY, FACTORS, DIRECTION = "identity", "factors", "direction"


class Factors(NamedTuple):
    """A stack's ``post`` as factors (:meth:`HiddenRule.post_factors`): ``row`` ``(K, m, 1)``, ``col`` ``(K, 1, n)``,
    and whether the row factors divide (NorMuon: ``(U / row) * col``) rather than multiply."""

    row: Tensor
    col: Tensor
    divide: bool = False


def _defined_by(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose body defines ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c))


def form_of(cls: type, base: type) -> str:
    """The form the directions of ``cls``, a subclass of the protocol ``base`` (``driver.HiddenRule``), travel in
    (see the module): derived from which of ``post``, ``post_all`` and ``post_factors`` the class defines, so that a
    subclass that overrides ``post`` without ``post_factors`` falls back to ``DIRECTION``, exact."""
    post, post_all, factors = (_defined_by(cls, name) for name in ("post", "post_all", "post_factors"))
    if post is post_all is base:
        return IDENTITY
    if factors is not base and issubclass(factors, post) and issubclass(factors, post_all):
        return FACTORS
    return DIRECTION


def pays(form: str, rows: int, cols: int, ns_dtype: torch.dtype, d_dtype: torch.dtype) -> bool:
    """Whether a ``rows x cols`` piece travels as ``U`` in ``ns_dtype`` with its factors instead of ``D`` in
    ``d_dtype``: the rule has the form, the factors have ``D``'s dtype (a float64 ``D`` from factors computed in
    float32 would round otherwise than one process), and they are fewer bytes,
    ``rows cols |U| + (rows + cols) |D| < rows cols |D|`` (never with ``U`` as wide as ``D``)."""
    if form != FACTORS or torch.promote_types(ns_dtype, torch.float32) != d_dtype:
        return False
    return rows * cols * ns_dtype.itemsize + (rows + cols) * d_dtype.itemsize < rows * cols * d_dtype.itemsize


def apply(U: Tensor, row: Tensor, col: Tensor, divide: bool, out: Tensor | None = None) -> Tensor:
    """A block of ``D`` from its block of ``U`` and the factors of its rows and columns (``F.apply_factors``:
    each element times its row's factor, rounded, then times its column's), the owner's product bit for bit;
    into ``out`` (``U``'s shape, the factors' dtype) where given."""
    return F.apply_factors(U, row, col, divide=divide, out=out)


def apply_received(got: list[list[Tensor]], divide: bool, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """A rank's blocks of ``D`` from what came back (per unit ``U``, ``row``, ``col`` first, ``exchange.Exchange.
    from_owners``), into one buffer, which a skipped step zeroes in one kernel (``driver.apply_pending``): a stretch of
    alike units from one owner (``assembly.Received.runs``) by one :func:`apply` on its stacks, any other unit by one
    of its own. The same products, so the same bits, either way."""
    runs = [(ms, st) for ms, st in getattr(got, "runs", ()) if len(ms) > 1 and None not in st[:3]]
    done = {j for ms, _ in runs for j in ms}
    runs += [([j], None) for j in range(len(got)) if j not in done]
    into = torch.empty(sum(parts[0].numel() for parts in got), dtype=dtype, device=device)
    out: list[Tensor] = [into] * len(got)
    start = 0
    for members, stacks in runs:
        U, row, col = stacks[:3] if stacks is not None else got[members[0]][:3]
        d = into[start : start + U.numel()].view(U.shape)
        start += U.numel()
        apply(U, row.unsqueeze(-1), col.unsqueeze(-2), divide, d)
        for j, dj in zip(members, d if stacks is not None else [d], strict=True):
            out[j] = dj
    return out
