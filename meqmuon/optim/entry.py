"""One parameter of a param group as the optimizer's step sees it (:class:`Entry`), prepared once per plan
(``engine.RoleOptimizer._prepare``): its path, its exchange units, its items each step."""

from __future__ import annotations

from typing import Any

import torch

from . import driver
from .calls import Item
from .distributed import is_dtensor
from .exchange import Unit
from .owners import check_mesh, descriptor, is_replicated
from .placement import Path, by_matrix, cuts
from .rule import Rule
from .views import Layout

__all__ = ["Entry", "held_rows"]


def held_rows(p: torch.Tensor) -> slice:
    """The indices along dim 0 of ``p`` that this rank holds: all, or under FSDP2/HSDP its
    ``Shard(0)`` piece (``torch.chunk`` sizes over the mesh's last dimension)."""
    if not is_dtensor(p) or is_replicated(p):
        return slice(None)
    mesh = p.device_mesh
    size = -(-p.shape[0] // mesh.size(mesh.ndim - 1))
    start = min(mesh.get_local_rank(mesh.ndim - 1) * size, p.shape[0])
    return slice(start, start + p.to_local().shape[0])


class Entry:
    """One parameter of a param group as the step sees it, prepared once (:meth:`RoleOptimizer._prepare`): its
    :class:`~.placement.Path`, the splitter of its calls, whether its rule sees the matrices of its view (``cut``;
    a DTensor's exchange unit is the whole parameter, cut by its owner, or with ``matrices`` -- the optimizer's
    ``exchange_unit="matrix"`` -- each matrix of its stack, ``by_matrix``) and, on ``OWNERS``, the exchange's units
    of its items."""

    __slots__ = ("param", "state", "name", "kind", "rule", "layout", "cut", "path", "item", "split", "units", "dtensor",
                 "by_matrix", "held")

    def __init__(self, param: torch.Tensor, state: dict[str, Any], name: str, kind: str, rule: Rule,
                 layout: Layout, path: Path, matrices: bool = False) -> None:
        self.param, self.state, self.name, self.kind, self.rule, self.layout = param, state, name, kind, rule, layout
        self.dtensor, self.path, self.split, self.units = is_dtensor(param), path, None, []
        #: ``by_matrix``: the matrices ``[a, b)`` of the stack this rank holds (all, unless dim 0 is sharded).
        self.held = (0, param.shape[0]) if param.ndim else (0, 0)
        self.by_matrix = matrices and path is Path.OWNERS and by_matrix(param, rule, layout)
        self.cut = cuts(rule, layout) and not (path is Path.OWNERS and self.dtensor and not self.by_matrix)
        #: A whole tensor's item, made once (:meth:`RoleOptimizer._prepare`, once ``units`` are set): a plain
        #: tensor's only gets its gradient, a DTensor's its local tensors (:meth:`items`).
        self.item: Item | None = None

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient the rule reads: a DTensor's local piece in the parameter's placements (a ``Partial()``
        gradient under TP reduced first), else ``grad`` itself."""
        if not self.dtensor:
            return grad
        if tuple(grad.placements) != tuple(self.param.placements):  # Partial() under TP
            grad = grad.redistribute(grad.device_mesh, self.param.placements)
        return grad.to_local()

    def items(self, grad: torch.Tensor) -> list[Item]:
        """This step's items of a parameter that is not one whole plain tensor, from its local gradient: a DTensor's
        local piece (its kept item, refilled), one item per matrix of its view (:meth:`Layout.matrices`) or of its
        stack (``by_matrix``), with the state as local views, named ``name[e]#j``; each with its exchange unit."""
        param = self.param.to_local() if self.dtensor else self.param
        state = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in self.state.items()}
        if self.by_matrix:
            return driver.stack_items(self.rule, param, grad, state, self.name, self.kind, self.param.shape[1:],
                                      self.units, self.held)
        if not self.cut:
            it = self.item
            it.param, it.grad, it.state = param, grad, state
            return [it]
        return driver.cut_items(self.rule, self.layout, param, grad, state, self.name, self.kind,
                                self.layout.labels(held_rows(self.param)), self.units)

    def exchange_units(self, cache: dict) -> list[Unit]:
        """The exchange's units of this entry (where their pieces and sharded state's lie, the layout the owner cuts
        each by): the parameter, under DDP each matrix of its view, ``by_matrix`` each matrix of its stack (every
        rank's piece its local ``[e]``, :meth:`.owners.Pieces.one`, cut by :meth:`Layout.one`)."""
        if not self.dtensor:
            return [Unit(descriptor(t, cache), {}, None) for t in (self.layout.matrices(self.param) if self.cut else
                                                                   [self.param])]
        check_mesh(self.param, self.name)
        d, sharded = descriptor(self.param, cache), {k: descriptor(v, cache) for k, v in sorted(self.state.items())
                                                     if is_dtensor(v) and not is_replicated(v)}
        if not self.by_matrix:
            return [Unit(d, sharded, self.layout if cuts(self.rule, self.layout) else None)]
        # every state tensor of a stack leads with its matrices, sharded on dim 0 as the stack is (by_matrix)
        self.held = d.held_along_0(torch.distributed.get_rank())
        return [Unit(d.at(e), {k: v.at(e) for k, v in sharded.items()}, self.layout.one())
                for e in range(self.param.shape[0])]
