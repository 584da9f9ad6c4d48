"""Where each parameter steps: the one table of paths, decided once per parameter when the step is planned.

- ``PLAIN``: plain tensors: one process, or DDP (every rank holds the whole tensor and its all-reduced
  gradient; owner ranks compute and broadcast, ``distributed.ReplicatedSplit``).
- ``LOCAL``: a DTensor this rank steps alone, with no exchange: held whole by every rank (``Replicate()``
  norms under TP), an elementwise rule's piece of any layout (AdamW), or FSDP2's whole local matrices of a
  stacked view (experts ``Shard(0)``: expert parallelism's layout too).
- ``ROWS``: FSDP2's / HSDP's row shards (``Shard(0)``, ``(Replicate(), Shard(0))``) of whole matrices: the row
  exchange of Newton-Schulz inputs per shape bucket (``sharded.py``), sums over shards for statistics; and
  whole-row pieces of any other placements for a rule without Newton-Schulz whose statistics are sums over
  rows (MeqMuon's eq. 9 and 10, SCALE: FSDP2 over TP's vocabulary-parallel embedding and head, its norms):
  one small all-reduce per statistic (``distributed.RowPieceSplit``), no piece of the tensor travels.
- ``PIECES``: every other DTensor layout (TP ``Shard(0)``/``Shard(1)``, FSDP2 over TP, vocabulary-parallel
  embeddings, FSDP2 rows of split, transposed or folded views): direction inputs to owners, directions back
  (``owners.py``; a stepping rule that is not elementwise: whole tensors, its documented fallback).

``ROWS`` is the ``PIECES`` exchange's simplest case (each piece is whole rows of each matrix): the same
uneven byte exchange (``distributed.exchange_flat``: each rank sends an owner only its pieces of that owner's
matrices, the owner sends back only their directions, nothing padded) and the same owner assignment
(``distributed.assign_owners``, longest first, one load per step shared with ``PIECES`` where both run on all
ranks: ``distributed.share_loads``). What stays its own is the bookkeeping of whole rows: a shape bucket's
stack goes out as one block per rank (no descriptors), and its owners are planned per step for the buckets
of the matrices with gradients; its collectives (one pair per shape bucket) are the fingerprints of FSDP2
users. Read in code, as microsoft/dion's ``_get_shard_info``: the engine asks
:func:`path_of` once per parameter and keeps the answer on its entry; each rule call's context carries its
entries' path (``calls.StepContext.path``), which the forms read (``ROWS``: whole matrices at owners), and the
path picks the call's splitter. Row shards on a shard group of one rank are whole there: ``LOCAL``.
"""

from __future__ import annotations

import torch

from . import driver
from .calls import Path
from .distributed import SHARDED_LAYOUTS, is_dtensor
from .owners import is_replicated
from .rule import MomentumRule, Rule, SteppingRule
from .views import Layout

__all__ = ["Path", "cuts", "path_of", "whole_rows"]


def cuts(rule: Rule, layout: Layout) -> bool:
    """A rule sees the matrices of a view; a vector rule whole tensors, or each vector of a "vectors"
    view unless its update is elementwise (then any view gives the same update)."""
    return not layout.whole and (driver.needs_matrix(rule)
                                 or (layout.view == "vectors" and not driver.elementwise(rule)))


def whole_rows(p: torch.Tensor) -> bool:
    """Every rank's piece of DTensor ``p`` is whole rows of its matrix view: only dim 0 is sharded."""
    return all(q.is_replicate() or getattr(q, "dim", None) == 0 for q in p.placements)


def path_of(p: torch.Tensor, rule: Rule, layout: Layout, compiled_batched: bool = False) -> Path:
    """The path of parameter ``p`` (see the module's table). Under ``compiled_batched`` (``compile=True`` with
    the batched step) row shards of the elementwise momentum rules go to ``PIECES`` too: their statistics
    would need sums over shards inside a graph, and at the owner the rule sees whole tensors."""
    if not is_dtensor(p):
        return Path.PLAIN
    if is_replicated(p):
        return Path.LOCAL
    rows = tuple(p.placements) in SHARDED_LAYOUTS
    if rows and p.device_mesh.size(p.device_mesh.ndim - 1) == 1:  # row shards of one: whole on every rank
        return Path.LOCAL
    cut = cuts(rule, layout)
    if driver.elementwise(rule):
        return Path.LOCAL if cut or not rows else Path.ROWS
    if rows and compiled_batched and isinstance(rule, MomentumRule):
        return Path.PIECES
    if not rows:
        sums = isinstance(rule, MomentumRule) and not compiled_batched or isinstance(rule, SteppingRule)
        spans = p.device_mesh.size() == torch.distributed.get_world_size()  # the sums run over the default group
        return Path.ROWS if sums and layout.whole and spans and whole_rows(p) else Path.PIECES
    if cut:  # whole local matrices of a stack, unless the view needs rows of several shards
        return Path.PIECES if not layout.batch or layout.folded else Path.LOCAL
    return Path.ROWS
