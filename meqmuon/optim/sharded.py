"""FSDP2 at the Newton-Schulz seam: a hidden rule's row shards meet as whole matrices at owner ranks.

Under FSDP2 every rank holds a row shard of each matrix; Newton-Schulz and a hidden rule's ``pre`` and
``post`` need whole matrices. :func:`hidden_at_owners` sends a bucket's row shards to owner ranks by one
uneven ``all_to_all_single`` (:meth:`ShardedSplit.at_owners`; each rank sends an owner only its rows of that
owner's matrices: the owner path's byte exchange, ``distributed.exchange_flat``), runs the driver's body there
(an :data:`Orth`: :func:`meqmuon.optim.driver.directions`, eager or in a compiled graph), and brings each rank
its rows of the directions back by a second one (microsoft/dion ``megabatch_base.py`` does the same for
Newton-Schulz), so a rule never needs a sum over shards. Owners are planned for all buckets of a step at once
(``ShardedSplit.bucket_owners``, longest first, the load carried). The rows travel in the Newton-Schulz dtype;
per-row state as extra columns of the rows and per-matrix state as a column of all rows, in the statistics'
dtype, apart from them; the directions come back in the Newton-Schulz dtype where the rule allows it exactly
(:func:`hidden_at_owners`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .. import functional as F
from .calls import StepContext
from .newton_schulz import batched_ns
from .rule import MomentumBase

__all__ = ["Orth", "hidden_at_owners"]

#: How an owner turns whole matrices into directions: ``orth(rule, [W], state, group, ctx, batched=...)``
#: with ``W`` ``(j, m, n)`` contiguous, the received matrices handed over in a one-element list (which ``orth``
#: empties: they are scratch, read by nothing after Newton-Schulz, which may iterate in them and let them go
#: before ``post``) and ``state`` ``{key: (j, m) or (j,)}``, updated in place; returns ``(U, row, col)``, the
#: directions as ``factored`` asks (``driver.directions``: ``U`` and the factors the rule's ``_direction_form``
#: allows, or ``(D, None, None)``).
#: The driver's form picks it: ``driver.eager_directions``, or the compiled graph (``compiled.owner_directions``).
#: Given, not imported: this module sits below the driver, which calls it.
Orth = Callable[..., tuple[Tensor, Tensor | None, Tensor | None]]


def hidden_at_owners(rule: MomentumBase, stack: list[Tensor], state: dict[str, Tensor], m: int, group: dict,
                     ctx: StepContext, orth: Orth, ns_dtype: torch.dtype, stat_dtype: torch.dtype,
                     owners: Sequence[int]) -> list[Tensor]:
    """Row shards ``X`` ``(k, rows, n)`` of ``k`` matrices with ``m`` rows of a hidden rule's bucket -> whole
    matrices at their ``owners`` (ranks of the splitter's group, ``ShardedSplit.bucket_owners``) -> ``orth``
    there (:data:`Orth`) -> the rows of ``D`` back; ``state`` is updated in place. ``X`` is in the Newton-Schulz
    dtype ``ns_dtype`` (float32 for a rule with its own ``pre``); the state travels as extra columns in the
    statistics' dtype ``stat_dtype``, apart from ``X``, so that ``X`` never widens to carry it.

    What comes back follows the rule's ``_direction_form`` (``driver.HiddenRule``): where ``post`` is the
    identity, ``U`` in the Newton-Schulz dtype; where the rule gives its ``post`` as factors (MeqMuon's eq. 8),
    ``U`` in the Newton-Schulz dtype, each row's factor and the matrix's column factors, which every rank
    applies to its rows (``F.apply_factors``: the same products as the owner's ``post_all``, bit for bit);
    otherwise ``D`` in ``stat_dtype``. With bf16 Newton-Schulz the way back is then bf16, not float32, but for
    the factors: ``n`` column factors per matrix per rank, ``2 / rows`` of a bf16 piece of ``rows`` rows, so
    where they would be as many bytes as ``D`` (float32 Newton-Schulz, or 2 rows a rank) ``D`` travels.

    ``X`` is handed over as ``stack == [X]`` and the list emptied: ``X``, once in the send buffer, and the send
    buffer, once sent, are let go before ``orth`` runs (neither is read again; alive beside an owner's
    Newton-Schulz they were a tenth of the step's transient peak, docs/benchmarks.md)."""
    X = stack.pop()
    k, rows, n = X.shape
    keys = list(state)
    per_row = [rule.state_views[key] == "rows" for key in keys]
    # factors where they pay for a rank's piece of FSDP2's even share of rows (not with float32 U, nor 2 rows a rank)
    form = rule._direction_form
    if form == "factors" and not rule._factors_pay(-(-m // ctx.split.world_size), n, ns_dtype, stat_dtype):
        form = "direction"
    factors = form == "factors"
    u_dtype = stat_dtype if form == "direction" else ns_dtype
    extra = int(factors) + len(keys)  # per-row columns back: the row factor, then the state

    def columns(st: dict[str, Tensor], j: int, length: int) -> list[Tensor]:
        return [st[key].to(stat_dtype)[..., None] if row else
                st[key].to(stat_dtype)[:, None, None].expand(j, length, 1)
                for key, row in zip(keys, per_row, strict=True)]

    def whole(parts: list[Tensor]) -> list[Tensor]:
        # parts == [W, C], handed over (ShardedSplit.at_owners): the whole matrices, contiguous, and their state
        # columns; W is read by nothing after orth, which may iterate Newton-Schulz in it and let it go before
        # post (driver.directions' consume)
        W, C = parts
        parts.clear()
        j, device = W.shape[0], W.device
        # copies, not views of C: a compiled orth's inputs then do not alias (AOTAutograd's synthetic base of a
        # view and its own base failed at run time, "wrong number of dimensions")
        st = {key: _column(C, i, row, state[key].dtype).clone()
              for i, (key, row) in enumerate(zip(keys, per_row, strict=True))}
        handed = [W]
        del W, C
        U, row_f, col_f = orth(rule, handed, st, group, ctx, batched=batched_ns(device), factored=form != "direction")
        cols = ([row_f.reshape(j, m, 1).to(stat_dtype)] if factors else []) + columns(st, j, m)
        return [U.reshape(j, m, n).to(u_dtype),
                torch.cat(cols, dim=-1) if cols else U.new_empty((j, m, 0), dtype=stat_dtype),
                col_f.reshape(j, n).to(stat_dtype) if factors else U.new_empty((j, 0), dtype=stat_dtype)]

    C = torch.cat(columns(state, k, rows), dim=-1) if keys else X.new_empty((k, rows, 0), dtype=stat_dtype)
    back = [(u_dtype, n, True), (stat_dtype, extra, True), (stat_dtype, n if factors else 0, False)]
    send = [X, C]
    del X, C
    U, E, V = ctx.split.at_owners(send, whole, m, back, owners)
    for i, (key, row) in enumerate(zip(keys, per_row, strict=True)):
        state[key].copy_(_column(E[:, :rows] if row else E, int(factors) + i, row, state[key].dtype))
    U = U[:, :rows]
    if factors:
        return [F.apply_factors(U, E[:, :rows, :1], V[:, None, :], divide=rule._row_factors_divide)]
    return [U.to(torch.promote_types(u_dtype, stat_dtype))]


def _column(W: Tensor, c: int, per_row: bool, dtype: torch.dtype) -> Tensor:
    """State carried as column ``c`` of row stacks ``W`` ``(k, rows, width)``: per row, or per matrix (row 0)."""
    v = W[..., c] if per_row else W[:, 0, c]
    return v.to(dtype) if dtype.is_floating_point else v.round().to(dtype)
