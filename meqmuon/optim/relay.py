"""The exchange relayed through the nodes (the optimizer's ``relay_group``, issue 59).

At a thousand ranks an owner receives each unit it owns whole, ``1 / W`` of it from every rank, and almost all of it
over its own network link, and sends the results back the same way: at Llama-3 70B on 1,024 H100s a 28,672 x 8,192
MLP matrix is 470 MB in bf16, about 10 ms at one 400 Gb/s NIC each way, while the other seven GPUs of its node own
less and their NICs idle (docs/benchmarks.md, the time model). The owners are as balanced as whole units allow; the
bytes an owner moves are not spread.

``relay_group=p`` (the ``p`` consecutive ranks of a node) routes each of the exchange's ``all_to_all_single`` in two,
through the *owner's* node, so that an owner's network bytes become its node's over ``p``:

* the way out (:func:`relayed_flat` ``via="receiver"``): every rank sends what it has for another node's ranks to
  that node's rank *of its own place* (rank ``s`` of a node to rank ``s mod p`` of every other node: one rail, the
  links a rail-optimised fabric pairs), those destinations' bytes in one piece; within each node (one process
  group per node, ``shared_ns.Blocks``), each rank then forwards what it received for its node's other ranks;
* the way back (``via="sender"``): each rank first hands its node's rank of place ``j`` what it has for the other
  nodes' ranks of place ``j``, then every rank sends its node's bytes for its own rail over the network.

The same bytes arrive, put in the order the one collective gives them (rank ``0``'s first): every caller reads them
as before, bit for bit. What each relay forwards is known on every rank from the plan (``sizes(s, d)``: the bytes
rank ``s`` sends rank ``d``), so nothing is exchanged to learn it and the host never waits on the device. DeepEP's
internode dispatch routes a MoE's tokens the same way (RDMA to the GPU of the same local index in the destination
node, then NVLink; deepseek-ai/DeepEP, README, "normal kernels").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .distributed import InFlight, exchange_flat, offsets

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch builds without distributed support
    dist = None  # type: ignore[assignment]

__all__ = ["relayed_flat"]


def _node(me: int, p: int) -> tuple[range, int]:
    """Rank ``me``'s node (its ``p`` consecutive ranks) and its place in it."""
    return range(me // p * p, me // p * p + p), me % p


def _rail(j: int, mine: range, p: int, world: int) -> list[int]:
    """The ranks of place ``j`` in the nodes other than ``mine``, in rank order."""
    return [r for r in range(j, world, p) if r not in mine]


def _in_order(parts: list[Tensor], device: torch.device) -> Tensor:
    """Every sender's bytes, rank ``0``'s first, as one buffer (as :func:`~.distributed.exchange_flat` returns)."""
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def relayed_flat(send: list[list[Tensor]], out_splits: Sequence[int], sizes: Callable[[int, int], int], group: Any,
                 node: Any, p: int, device: torch.device, *, via: str = "receiver",
                 wait: bool = True) -> Tensor | InFlight:
    """:func:`~.distributed.exchange_flat`'s exchange (``send[r]`` to rank ``r``, ``out_splits[r]`` bytes from it,
    the result rank ``0``'s bytes first) through the receiving node (``via="receiver"``, many ranks to an owner) or
    the sending node (``"sender"``, an owner to many): ``node`` the process group of this rank's ``p`` consecutive
    ranks, ``sizes(s, d)`` the bytes rank ``s`` sends rank ``d`` (the plan's, the same on every rank).
    ``wait=False``: the first collective posted, an :class:`~.distributed.InFlight` whose ``wait`` runs the second
    and puts the bytes in order."""
    if via == "sender":
        return _via_sender(send, out_splits, sizes, group, node, p, device, wait)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    mine, place = _node(me, p)
    # the first hop: to this node directly; to another node's rank of this place, that node's destinations in order
    first: list[list[Tensor]] = [[] for _ in range(world)]
    for t in range(world):
        if t in mine:
            first[t] = send[t]
        elif t % p == place:
            first[t] = [x for d in _node(t, p)[0] for x in send[d]]
    # what arrives: from this node what it sends here; from this place's senders elsewhere, this node's pieces
    into = [out_splits[s] if s in mine else sum(sizes(s, d) for d in mine) if s % p == place else 0
            for s in range(world)]
    got = exchange_flat(first, into, group, device, wait=wait)
    del first
    send.clear()
    if wait:
        return _forward(got, out_splits, into, sizes, node, p, me, world, device)  # type: ignore[arg-type]
    return InFlight(None, lambda: _forward(got.wait(), out_splits, into, sizes, node, p, me,  # type: ignore[union-attr]
                                           world, device))


def _forward(got: Tensor, out_splits: Sequence[int], into: Sequence[int], sizes: Callable[[int, int], int], node: Any,
             p: int, me: int, world: int, device: torch.device) -> Tensor:
    """The second hop, within the node, and every sender's bytes in rank order: ``got`` the first hop's bytes by
    sender (``into[s]`` each; a relayed sender's in the order of this node's destinations)."""
    mine, place = _node(me, p)
    starts = offsets(into)

    def piece(s: int, j: int) -> Tensor:
        """What relayed sender ``s`` sent for this node's ``j``-th rank."""
        start = starts[s] + sum(sizes(s, mine[i]) for i in range(j))
        return got[start : start + sizes(s, mine[j])]

    onward = [[piece(s, j) for s in _rail(place, mine, p, world)] if j != place else [] for j in range(p)]
    # from the node's rank of place j: what the senders of place j elsewhere sent here, in their rank order
    back = [0 if j == place else sum(out_splits[s] for s in _rail(j, mine, p, world)) for j in range(p)]
    second = exchange_flat(onward, back, node, device)
    cursor = offsets(back)
    parts = []
    for s in range(world):
        if s in mine:
            parts.append(got[starts[s] : starts[s] + out_splits[s]])
        elif s % p == place:
            parts.append(piece(s, place))
        else:
            j = s % p
            parts.append(second[cursor[j] : cursor[j] + out_splits[s]])  # type: ignore[index]
            cursor[j] += out_splits[s]
    return _in_order(parts, device)


def _via_sender(send: list[list[Tensor]], out_splits: Sequence[int], sizes: Callable[[int, int], int], group: Any,
                node: Any, p: int, device: torch.device, wait: bool) -> Tensor | InFlight:
    """:func:`relayed_flat` through the sending node: within it first (to its rank of place ``j``, this node's bytes
    and what goes to the other nodes' ranks of place ``j``), then over the group each rank its node's bytes for its
    own rail, every sender's in rank order."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    mine, place = _node(me, p)
    rail = _rail(place, mine, p, world)
    first = [[*send[mine[j]], *(x for d in _rail(j, mine, p, world) for x in send[d])] if j != place else send[me]
             for j in range(p)]
    into = [out_splits[s] + (sum(sizes(s, d) for d in rail) if s != me else 0) for s in mine]
    got = exchange_flat(first, into, node, device, wait=wait)
    own = {d: send[d] for d in rail}  # this rank's own pieces for its rail, sent in the second hop
    send.clear()
    if wait:
        return _second(got, own, out_splits, into, sizes, group, p, me, world, device)  # type: ignore[arg-type]
    return InFlight(None, lambda: _second(got.wait(), own, out_splits, into, sizes, group,  # type: ignore[union-attr]
                                          p, me, world, device))


def _second(got: Tensor, own: dict[int, list[Tensor]], out_splits: Sequence[int], into: Sequence[int],
            sizes: Callable[[int, int], int], group: Any, p: int, me: int, world: int, device: torch.device) -> Tensor:
    """:func:`_via_sender`'s second hop, over the group, and every sender's bytes in rank order: ``got`` the first
    hop's by node rank (``into[j]`` each: that rank's bytes for this one, then for this rank's rail in order)."""
    mine, place = _node(me, p)
    starts = offsets(into)
    rail = _rail(place, mine, p, world)

    def piece(j: int, d: int) -> Tensor:
        """What this node's rank of place ``j`` handed here for rank ``d`` of this rank's rail."""
        s = mine[j]
        start = starts[j] + out_splits[s] + sum(sizes(s, e) for e in rail if e < d)
        return got[start : start + sizes(s, d)]

    onward: list[list[Tensor]] = [[] for _ in range(world)]
    for d in rail:
        onward[d] = [x for j in range(p) for x in (own[d] if j == place else [piece(j, d)])]
    back = [sum(out_splits[s] for s in _node(t, p)[0]) if t in rail else 0 for t in range(world)]
    second = exchange_flat(onward, back, group, device)
    cursor = offsets(back)
    parts = []
    for s in range(world):
        if s in mine:
            j = s - mine[0]
            parts.append(got[starts[j] : starts[j] + out_splits[s]])
        else:
            t = s // p * p + place  # the relay of s's node on this rank's rail
            parts.append(second[cursor[t] : cursor[t] + out_splits[s]])  # type: ignore[index]
            cursor[t] += out_splits[s]
    return _in_order(parts, device)
