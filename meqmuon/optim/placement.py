"""Where each parameter steps, and what runs it: the one table, read once per parameter when a step is planned.

``LOCAL``: this rank holds what it steps, nothing travels (``LocalSplit``; the driver's forms and ``compiled.py``'s).
    One process's parameters; under DDP every rule's but Newton-Schulz's, run in place on each rank's full copy with
    0 bytes (as torch's AdamW runs under DDP); ``Replicate()`` DTensors; an elementwise rule's piece of any layout
    (AdamW); FSDP2's whole local matrices of a stack (experts ``Shard(0)``, expert parallelism's layout too), which a
    block of ``ns_group`` holding them alike shares (:func:`alike_block`, ``shared_ns.ReplicaShare``).
``ROWS``: whole-row pieces of a rule without Newton-Schulz whose statistics are sums over rows (MeqMuon's eq. 9
    and 10, SCALE): FSDP2's and HSDP's row shards, FSDP2 over TP's vocabulary-parallel embedding and head
    (``RowSums``: one all-reduce per statistic; the same forms).
``OWNERS``: every Newton-Schulz matrix not whole on this rank alone, or whose work the ranks share (DDP), and any
    other rule whose statistics need more than sums over rows (``exchange.Exchange``: pieces of ``X`` to owners,
    whole matrices there, directions back; ``exchange.py``'s forms).

The engine asks :func:`path_of` once per parameter and keeps the answer on its entry; :data:`EXECUTORS` names the
forms that run each path's calls and :func:`splitter` makes their splitter, so no other place reads a path.
Read in code, as microsoft/dion's ``_get_shard_info``: a parameter's layout decides its path, the path its
mechanism.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from . import commit, compiled, driver, exchange, forms, whole_step
from .calls import Item, Path, StepContext
from .distributed import SHARDED_LAYOUTS, LocalSplit, RowSums, is_dtensor
from .driver import HiddenRule
from .owners import is_replicated, spanning
from .rule import MomentumRule, Rule, SteppingRule
from .shared_ns import ReplicaShare
from .views import Layout

__all__ = ["EXECUTORS", "Executor", "Path", "alike_block", "by_matrix", "cuts", "path_of", "splitter", "whole_rows"]

#: A form: runs a sequence of rule calls ``(rule, items, group, ctx)``.
Form = Callable[[list[driver.Call]], None]


def _own_step(form: Callable[..., None], items: list[Item], group: dict, ctx: StepContext) -> None:
    """A stepping rule on tensors it holds (whole, or whole rows with sums over shards): its form (its ``step`` or
    ``step_foreach``), a write of the step's commit, made after the momentum rules' (``commit.stepping_``: on
    copies where the step may be skipped)."""
    rule: SteppingRule = form.__self__  # type: ignore[attr-defined]

    def run(its: list[Item], gate: commit.Gate | None = None) -> None:
        ctx.gate = gate
        try:
            with forms.naming(rule, its):
                form(its, group, ctx)
        finally:
            ctx.gate = None

    ctx.commit.last(_stepping, run, list(items), foreach=form.__name__ == "step_foreach",
                    elementwise=driver.elementwise(rule), gated=rule.gates_itself)


def _stepping(run: Callable[..., None], items: list[Item], *, foreach: bool, elementwise: bool, gated: bool,
              gate: commit.Gate | None) -> None:
    """A stepping rule's write (``commit.stepping_``), its form given the flag where it reads it itself."""
    commit.stepping_(lambda its: run(its, gate if gated else None), items, foreach=foreach, elementwise=elementwise,
                     gated=gated, gate=gate)


class Executor(NamedTuple):
    """What runs a path's calls: the forms of the momentum rules' calls by ``(foreach, compile)``, and how a
    stepping rule's form runs, ``stepping(form, items, group, ctx)`` (``form`` its ``step`` or ``step_foreach``)."""

    forms: dict[tuple[bool, bool], Form]
    stepping: Callable[..., None]


#: The forms where the tensors are whole here (or whole rows): the driver's eager two and ``compiled.py``'s two.
_HERE: dict[tuple[bool, bool], Form] = {
    (False, False): forms.per_tensor,
    (True, False): forms.batched,
    (False, True): compiled.compiled_per_tensor,
    (True, True): compiled.compiled_batched,
}

#: Path -> what runs it (see the module's table).
EXECUTORS: dict[Path, Executor] = {
    Path.LOCAL: Executor(_HERE, _own_step),
    Path.ROWS: Executor(_HERE, _own_step),
    Path.OWNERS: Executor({
        (False, False): partial(exchange.step, batched=False),
        (True, False): partial(exchange.step, batched=True),
        (False, True): partial(exchange.step, batched=False, orth=compiled.owner_directions),
        (True, True): partial(exchange.step, batched=True, orth=compiled.owner_directions),
    }, whole_step.whole_step),
}


def cuts(rule: Rule, layout: Layout) -> bool:
    """A rule sees the matrices of a view; a vector rule whole tensors, or each vector of a "vectors"
    view unless its update is elementwise (then any view gives the same update)."""
    return not layout.whole and (driver.needs_matrix(rule)
                                 or (layout.view == "vectors" and not driver.elementwise(rule)))


def whole_rows(p: torch.Tensor) -> bool:
    """Every rank's piece of DTensor ``p`` is whole rows of its matrix view: only dim 0 is sharded."""
    return all(q.is_replicate() or getattr(q, "dim", None) == 0 for q in p.placements)


def path_of(p: torch.Tensor, rule: Rule, layout: Layout, world: int, compiled_batched: bool = False) -> Path:
    """The path of parameter ``p`` (see the module's table) on ``world`` ranks. Under ``compiled_batched``
    (``compile=True`` with the batched step) the elementwise momentum rules' row shards take ``OWNERS``: their
    statistics would need sums over shards inside a graph, and at the owner the rule sees whole tensors."""
    if not is_dtensor(p):
        return Path.OWNERS if world > 1 and isinstance(rule, HiddenRule) else Path.LOCAL
    if is_replicated(p) or driver.elementwise(rule):
        return Path.LOCAL
    rows = tuple(p.placements) in SHARDED_LAYOUTS
    if rows and p.device_mesh.size(p.device_mesh.ndim - 1) == 1:  # row shards of one: whole on every rank
        return Path.LOCAL
    cut = cuts(rule, layout)
    if rows and cut and layout.batch and not layout.folded:  # whole local matrices of a stack
        return Path.LOCAL
    if isinstance(rule, HiddenRule):
        return Path.OWNERS
    sums = isinstance(rule, SteppingRule) or (isinstance(rule, MomentumRule) and not compiled_batched)
    spans = p.device_mesh.size() == torch.distributed.get_world_size()  # the sums run over the default group
    if sums and ((rows and not cut) or (layout.whole and spans and whole_rows(p))):
        return Path.ROWS
    return Path.OWNERS


def by_matrix(p: torch.Tensor, rule: Rule, layout: Layout) -> bool:
    """Whether an ``OWNERS`` DTensor's exchange units may be its matrices (the optimizer's ``exchange_unit="matrix"``),
    one per index of its stack (an expert each), not the whole stack: a hidden rule's stack over one leading dim that
    no placement shards on dim 0 but in contiguous chunks (torchtitan's experts on their dimension 1 where the ranks
    outnumber them, ``train.parallel.expert_placement``; on dimension 0 over ``dp`` and 1 or 2 over ``tp`` under tensor
    parallelism). Every rank's piece of an expert is then its local ``[e]`` or nothing, so each expert
    travels to an owner of its own: the stack's bytes at the floor and its Newton-Schulz spread over as many owners as
    it has experts (a whole stack to one owner moved 6.6-9.5x the floor for DeepSeek-V3 on 1,024 ranks,
    docs/benchmarks.md)."""
    return (is_dtensor(p) and isinstance(rule, HiddenRule) and len(layout.batch) == 1 and not layout.folded
            and not any(_strided(q) for q in p.placements))


def _strided(q: Any) -> bool:
    """A placement that shards dimension 0 otherwise than in ``torch.chunk``'s contiguous chunks (``_StridedShard``)."""
    return getattr(q, "dim", None) == 0 and type(q).__name__ != "Shard"


def alike_block(p: torch.Tensor, ns_group: int) -> tuple[Any, int] | None:
    """The mesh and its dimension whose ranks hold DTensor ``p``'s piece alike (its one ``Replicate()`` dimension,
    ``owners.spanning``'s mesh: a module tensor parallelism left alone is repeated over ``tp``) where they are a block
    of ``ns_group`` (``shared_ns.Blocks``': consecutive ranks of the default group, as many as divide ``ns_group``),
    else ``None``. Such whole local matrices are shared by that block (``shared_ns.ReplicaShare``)."""
    if ns_group == 1 or not is_dtensor(p):
        return None
    mesh, placements = spanning(p)
    dims = [i for i, q in enumerate(placements) if q.is_replicate() and mesh.size(i) > 1]
    if len(dims) != 1 or ns_group % mesh.size(dims[0]) or mesh.size() != torch.distributed.get_world_size():
        return None
    ranks = torch.distributed.get_process_group_ranks(mesh.get_group(dims[0]))
    z = len(ranks)
    return (mesh, dims[0]) if ranks == list(range(ranks[0], ranks[0] + z)) and ranks[0] % z == 0 else None


def splitter(path: Path, p: torch.Tensor, local: LocalSplit, rows: dict[tuple, Any],
             owners: exchange.Exchange | None, ns_group: int = 1) -> Any:
    """The splitter of ``p``'s calls on ``path``: the optimizer's ``local`` one, or for whole matrices that a block of
    ``ns_group`` holds alike (:func:`alike_block`; ``ns_group`` 1 where the engine's form cannot share them) that
    block's ``shared_ns.ReplicaShare``; the ``RowSums`` of ``p``'s mesh and placements; or the plan's ``owners``
    exchange. The ones made per mesh are made once, kept in ``rows``."""
    if path is Path.LOCAL:
        block = alike_block(p, ns_group)
        if block is None:
            return local
        mesh, dim = block
        key = ("alike", id(mesh), dim)
        if key not in rows:
            rows[key] = ReplicaShare(mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim))
        return rows[key]
    if path is Path.ROWS:
        key = RowSums.key(p)
        if key not in rows:
            rows[key] = RowSums(p)
        return rows[key]
    return owners
