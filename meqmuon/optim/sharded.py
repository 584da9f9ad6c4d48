"""FSDP2 at the Newton-Schulz seam: a hidden rule's row shards meet as whole matrices at owner ranks.

Under FSDP2 every rank holds a row shard of each matrix; Newton-Schulz and a hidden rule's ``pre`` and
``post`` need whole matrices. :func:`hidden_at_owners` sends a bucket's row shards to owner ranks by one
uneven ``all_to_all_single`` (:meth:`ShardedSplit.at_owners`; each rank sends an owner only its rows of that
owner's matrices: the owner path's byte exchange, ``distributed.exchange_flat``), runs the driver's body there
(an :data:`Orth`: :func:`meqmuon.optim.driver.directions`, eager or in a compiled graph), and brings each rank
its rows of the directions back by a second one (microsoft/dion ``megabatch_base.py`` does the same for
Newton-Schulz), so a rule never needs a sum over shards. Owners are planned for all buckets of a step at once
(``ShardedSplit.bucket_owners``, longest first, the load carried). Per-row state travels as extra columns of
the rows, per-matrix state as a column of all rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .calls import StepContext
from .newton_schulz import batched_ns
from .rule import MomentumBase

__all__ = ["Orth", "hidden_at_owners"]

#: How an owner turns whole matrices into directions: ``orth(rule, [W], state, group, ctx, batched=...)``
#: with ``W`` ``(j, m, n)`` contiguous, the received matrices handed over in a one-element list (which ``orth``
#: empties: they are scratch, read by nothing after Newton-Schulz, which may iterate in them and let them go
#: before ``post``) and ``state`` ``{key: (j, m) or (j,)}``, updated in place; returns ``D`` ``(j, m, n)``.
#: The driver's form picks it: ``driver.eager_directions``, or the compiled graph (``compiled.owner_directions``).
#: Given, not imported: this module sits below the driver, which calls it.
Orth = Callable[..., Tensor]


def hidden_at_owners(rule: MomentumBase, stack: list[Tensor], state: dict[str, Tensor], m: int, group: dict,
                     ctx: StepContext, orth: Orth, ns_dtype: torch.dtype, owners: Sequence[int]) -> list[Tensor]:
    """Row shards ``X`` ``(k, rows, n)`` of ``k`` matrices with ``m`` rows of a hidden rule's bucket -> whole
    matrices at their ``owners`` (ranks of the splitter's group, ``ShardedSplit.bucket_owners``) -> ``orth``
    there (:data:`Orth`) -> the rows of ``D`` back; ``state`` is updated in place. ``ns_dtype``: the group's
    Newton-Schulz dtype (what travels when no state does).

    ``X`` is handed over as ``stack == [X]`` and the list emptied: ``X``, once in the send buffer, and the send
    buffer, once sent, are let go before ``orth`` runs (neither is read again; alive beside an owner's
    Newton-Schulz they were a tenth of the step's transient peak, docs/benchmarks.md)."""
    X = stack.pop()
    k, rows, n = X.shape
    keys = list(state)
    per_row = [rule.state_views[key] == "rows" for key in keys]
    dtype = X.dtype if keys else ns_dtype
    out_dtype = torch.promote_types(dtype, torch.float32)

    def columns(st: dict[str, Tensor], j: int, length: int, dt: torch.dtype) -> list[Tensor]:
        return [st[key].to(dt)[..., None] if row else st[key].to(dt)[:, None, None].expand(j, length, 1)
                for key, row in zip(keys, per_row, strict=True)]

    def whole(parts: list[Tensor]) -> Tensor:
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
        D = orth(rule, handed, st, group, ctx, batched=batched_ns(device))
        return torch.cat([D[0].reshape(j, m, n).to(out_dtype), *columns(st, j, m, out_dtype)], dim=-1)

    send = [torch.cat([X.to(dtype), *columns(state, k, rows, dtype)], dim=-1)]
    del X
    back = ctx.split.at_owners(send, whole, m, n, n + len(keys), out_dtype, owners)
    for i, (key, row) in enumerate(zip(keys, per_row, strict=True)):
        state[key].copy_(_column(back[:, :rows] if row else back, n + i, row, state[key].dtype))
    return [back[:, :rows, :n]]


def _column(W: Tensor, c: int, per_row: bool, dtype: torch.dtype) -> Tensor:
    """State carried as column ``c`` of row stacks ``W`` ``(k, rows, width)``: per row, or per matrix (row 0)."""
    v = W[..., c] if per_row else W[:, 0, c]
    return v.to(dtype) if dtype.is_floating_point else v.round().to(dtype)
