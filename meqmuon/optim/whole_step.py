"""A stepping rule's step through the exchange, where its statistics need whole tensors (SCALE's column and row
rules on pieces that are not whole rows): the tensors to their owners (``exchange.Exchange``), the rule's own form
there, the new pieces back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from . import commit
from .calls import Item, StepContext
from .driver import cut_items
from .exchange import Exchange
from .forms import naming
from .rule import SteppingRule

__all__ = ["whole_step"]


def whole_step(form: Callable[..., None], items: Sequence[Item], group: dict, ctx: StepContext) -> None:
    """A stepping rule whose statistics need whole tensors (SCALE's column and row rules on pieces that are not
    whole rows): parameter, gradient and sharded state to the owner, the rule's form (its ``step`` or
    ``step_foreach``) there on whole tensors made for this step (copies of what the owner holds), the new parameter
    and state pieces back, written in the step's commit."""
    ex: Exchange = ctx.split  # type: ignore[assignment]
    rule: SteppingRule = form.__self__  # type: ignore[attr-defined]
    indices = [it.index for it in items]
    keys, pieces = [], []
    for it, i in zip(items, indices, strict=True):
        sharded = list(ex.units[i].state_pieces)
        keys.append(["param", "param", *sharded])
        pieces.append([it.param, it.grad, *(it.state[k] for k in sharded)])
    wholes = ex.to_owners(indices, pieces, keys)
    at_owner, states = [], []
    for it, ws, ks in zip(items, wholes, keys, strict=True):
        if ws is None:
            states.append(None)
            continue
        if ex.units[it.index].replicas:  # the pieces themselves: the owner steps a copy
            ws[0] = ws[0].clone()
        state = {k: (ws[ks.index(k)] if k in ks[2:] else v.clone() if isinstance(v, Tensor) else v)
                 for k, v in it.state.items()}
        layout = ex.units[it.index].layout
        at_owner += ([Item(ws[0], ws[1], state, it.name, it.shape, it.kind)] if layout is None else
                     cut_items(rule, layout, ws[0], ws[1], state, it.name, it.kind, layout.labels()))
        states.append(state)
    if at_owner:
        try:
            with naming(rule, at_owner):
                form(at_owner, group, ctx)
        except Exception as e:
            ctx.keep(e)
    names = [[k for k in sorted(it.state) if isinstance(it.state[k], Tensor) and k != commit.SKIPPED]
             for it in items]
    out_wholes = [None if st is None else [ws[0], *(st[k] for k in ns)]
                  for ws, st, ns in zip(wholes, states, names, strict=True)]
    back_keys = [["param", *(k if k in ex.units[i].state_pieces else None for k in ns)]
                 for i, ns in zip(indices, names, strict=True)]
    got = ex.from_owners(indices, out_wholes, back_keys,
                         [lambda it=it, ns=ns: [(it.param.shape, it.param.dtype),
                                                *((it.state[k].shape, it.state[k].dtype) for k in ns)]
                          for it, ns in zip(items, names, strict=True)], items[0].param.device)
    targets, news = [], []
    for it, ns, parts in zip(items, names, got, strict=True):
        targets.append(it.param)
        news.append(parts[0])
        for k, t in zip(ns, parts[1:], strict=True):
            targets.append(it.state[k])
            news.append(t)
    ctx.commit.later(commit.copy_, targets, news)
