"""The GPUs and links the step's time model prices (``benchmarks/time_model.py``, issue 59): a :class:`Hardware`
and the time of one rank's part of an exchange, direct (:func:`exchange_seconds`, :func:`split_seconds`) or relayed
through the nodes (:func:`relayed_seconds`).

**Sources** (:data:`H100`, :data:`H200`; ``time_model.py --help`` for the options):

- HBM: H100 SXM 3.35 TB/s, H200 4.8 TB/s (NVIDIA's H100 and H200 datasheets), of which the elementwise
  passes reach 80 % (:attr:`Hardware.hbm_efficiency`, measured on this step's passes);
- dense bf16 matmul peak 989 TFLOP/s, float32 (no tensor cores) 67 TFLOP/s (H100 SXM datasheet, without
  sparsity; the same GH100 compute on H200);
- NVLink 4: 450 GB/s each way is the line rate (900 GB/s bidirectional, datasheet); NCCL reaches ~370 GB/s
  (S. Jeaugey, NVIDIA/nccl-tests#212: "with the protocol overhead (~20%)"): the default;
- network: one 400 Gb/s NDR ConnectX-7 per GPU, 46-49 GB/s measured per NIC by nccl-tests, and an all-to-all
  does not aggregate several NICs (NVIDIA/nccl-tests#267, #290): 48 GB/s;
- a kernel launch on the host: 5 us (:attr:`Hardware.launch`), the low end of an H100's eager launch; the
  ``benchmarks/op_count.py`` counts tracked H100 kernels within 10 % (docs/benchmarks.md);
- latencies: NCCL's own tuning model (``src/graph/tuning.cc``, Ring/Simple): 8.4 us per collective, 3.4 us
  per NVLink step, 9.6 us per network step;
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["H100", "H200", "HARDWARE", "PEERS", "Hardware", "Link", "Split", "exchange_seconds", "relayed_seconds",
           "split_seconds"]


@dataclass(frozen=True)
class Link:
    """One kind of link: ``bandwidth`` in bytes/s each way per GPU, ``latency`` in seconds per step."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Hardware:
    """A GPU and its links (sources in the module docstring). ``peak``: dense matmul FLOP/s by dtype name."""

    name: str
    hbm: float
    peak: dict[str, float]
    nvlink: Link
    network: Link
    ranks_per_node: int = 8
    base_latency: float = 8.4e-6
    #: The share of ``hbm`` the step's elementwise passes reach: 80 %, measured on this step's own passes
    #: (docs/benchmarks.md, Issue 49: the CUDA graph's body moves 5.88 GB more than the eager step at
    #: Llama-350M shapes, and took 2.2 ms more on an H100: 2.67 TB/s).
    hbm_efficiency: float = 0.8
    #: The host's time to launch one kernel: 5 us, the low end of the 5-10 us an eager launch takes on an H100
    #: (the launches ``benchmarks/op_count.py`` counts tracked H100 kernels within 10 %, docs/benchmarks.md; the
    #: batched eager step at Llama-60M took 5.33 ms for 207 kernels, 26 us each with its Python): a floor.
    launch: float = 5e-6

    @property
    def memory(self) -> float:
        """The bytes per second the elementwise passes move."""
        return self.hbm * self.hbm_efficiency

    def link_bytes(self, nbytes: float, world: int) -> tuple[float, float]:
        """``nbytes`` a rank moves one way, spread evenly over ``world`` ranks: (NVLink, network); its own stays."""
        p = min(self.ranks_per_node, world)
        return nbytes * (p - 1) / world, nbytes * (world - p) / world

    def allreduce_seconds(self, nbytes: float, world: int) -> float:
        """A small all-reduce over ``world`` ranks as a tree: up and down through a node's NVLink and
        ``log2(nodes)`` network hops (NCCL's tuning model's shape, with the Simple protocol's latencies),
        ``2 nbytes`` over the slowest link."""
        if world <= 1:
            return 0.0
        p, nodes = min(self.ranks_per_node, world), math.ceil(world / self.ranks_per_node)
        hops = (p - 1) * self.nvlink.latency + math.ceil(math.log2(nodes)) * self.network.latency
        slowest = self.network if nodes > 1 else self.nvlink
        return self.base_latency + 2 * hops + 2 * nbytes / slowest.bandwidth


H100 = Hardware("NVIDIA H100 SXM 80GB", hbm=3.35e12, peak={"bfloat16": 989e12, "float32": 67e12},
                nvlink=Link(370e9, 3.4e-6), network=Link(48e9, 9.6e-6))
H200 = replace(H100, name="NVIDIA H200 SXM 141GB", hbm=4.8e12)
HARDWARE = {"h100": H100, "h200": H200}


def exchange_seconds(nbytes: float, world: int, hw: Hardware) -> float:
    """One rank's part of an all-to-all that moves ``nbytes`` each way for it (the larger of what it sends and
    receives): both links at once, each after its latency (the module docstring); 0 for nothing to move."""
    return split_seconds(*hw.link_bytes(nbytes, world), hw) if world > 1 else 0.0


def split_seconds(near: float, far: float, hw: Hardware) -> float:
    """One rank's part of an all-to-all whose peers are known: ``near`` bytes each way with ranks of its node (over
    NVLink), ``far`` with the others (over the network), both links at once, each after its latency; 0 for nothing."""
    parts = [link.latency + b / link.bandwidth for link, b in ((hw.nvlink, near), (hw.network, far)) if b > 0]
    return hw.base_latency + max(parts) if parts else 0.0


#: A round's bytes by peer, per rank: (its pieces for other nodes, its owned units' pieces from other nodes, its
#: pieces for its node's other ranks, its owned units' pieces from them), under the keys :data:`PEERS` in
#: ``rank_model``'s rounds.
Split = tuple[list[float], list[float], list[float], list[float]]
#: The keys of :data:`Split`'s parts, in its order.
PEERS = ("far", "far_owned", "near", "near_owned")


def relayed_seconds(local: list[float], owned: list[float], hw: Hardware, split: Split | None = None) -> float:
    """One way of a round relayed through the owners' nodes (``meqmuon/optim/relay.py``, ``relay_group`` a node's
    ``p`` ranks): rank ``r`` moves its pieces, ``local[r]`` bytes, and its whole units, ``owned[r]``, each spread
    evenly over the ``W`` ranks, or as ``split`` says. The network hop: a rank's own pieces for other nodes
    (spread: ``(W - p) / W`` of ``local[r]``), and one place's share of its node's owned bytes from (or to) other
    nodes (spread: ``(W - p) / W`` of the node's ``owned`` over ``p``); the NVLink hop: what it forwards for (or
    receives from) its node's other ranks, ``(p - 1) / p`` of those; beside the network hop the node's own pieces
    (spread: ``(p - 1) / W``). The two hops one after the other (the way out network first, the way back NVLink
    first: the same time), each ending with its slowest rank. With ``W <= p`` nothing is relayed."""
    world = len(local)
    p = min(hw.ranks_per_node, world)
    if world <= p:
        if split is not None:
            return max((split_seconds(max(a, b), 0.0, hw) for a, b in zip(split[2], split[3], strict=True)),
                       default=0.0)
        return max((exchange_seconds(max(a, b), world, hw) for a, b in zip(local, owned, strict=True)), default=0.0)
    if not any(local) and not any(owned):
        return 0.0
    far = (world - p) / world
    far_l, far_o, near_l, near_o = split or ([far * x for x in local], [far * x for x in owned],
                                             [(p - 1) / world * x for x in local], [(p - 1) / world * x for x in owned])
    node = [sum(far_o[n : n + p]) / p for n in range(0, world, p)]  # one place's share of its node's far owned bytes
    net = max(hw.network.latency + max(loc, node[r // p]) / hw.network.bandwidth for r, loc in enumerate(far_l))
    near = max(hw.nvlink.latency + max(a, b) / hw.nvlink.bandwidth for a, b in zip(near_l, near_o, strict=True))
    forward = max(hw.nvlink.latency + (p - 1) / p * max(node[r // p], own) / hw.nvlink.bandwidth
                  for r, own in enumerate(far_o))
    return 2 * hw.base_latency + max(net, near) + forward
