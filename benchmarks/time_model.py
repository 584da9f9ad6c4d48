"""The optimizer step's time at scale, modelled from what the simulator counts (issue 59, item 1).

Usage::

    python benchmarks/scale_sim.py --runs time --ns-dtype bfloat16 --optimizer meqmuon --save sim-meqmuon.json
    python benchmarks/time_model.py sim-meqmuon.json sim-muon.json sim-adamw.json      # the time table
    python benchmarks/time_model.py --validate           # against the single-GPU steps measured on H100 / H200
    python benchmarks/time_model.py sim.json --calibration my-gpu.json --extrapolate-rate 0.7

What it reads: ``scale_sim.summarise``'s ``time_inputs`` (the simulated ranks' bytes, memory traffic and ops
as ``step_accounting.StepMeter`` counted them; the plan's exchange rounds with every rank's pieces and owned
matrices, ``rank_model.RankModel.rounds``), a calibration table of Newton-Schulz time per matrix shape and
dtype (:class:`Calibration`, ``benchmarks/calibration/h100.json``; ``benchmarks/ns_calibrate.py`` measures
one on a GPU) and a :class:`Hardware`. Nothing here counts bytes or FLOPs itself: the counting is the
simulator's, so that its instruments stay the one source of every byte.

**The model.** The step exchanges shape bucket after shape bucket ("rounds": one ``all_to_all_single`` out,
Newton-Schulz at the owners, one back; ``sharded.py`` and ``engine.py`` today), every collective blocking:

- exchange: rank ``r`` moves ``max(sent, received)`` bytes each way of a round; of them ``(p - 1) / W`` cross
  NVLink and ``(W - p) / W`` the network (``p = min(ranks_per_node, W)``: every matrix's pieces are spread
  over all ``W`` ranks, under FSDP2 and FSDP2 x TP alike, so an owner receives ``1 / W`` of a matrix from
  each rank; a sender's pieces go to owners spread over the ranks likewise), each link at its bandwidth
  after its latency, the two links at once: ``t = base + max(lat_nvl + B_nvl / bw_nvl, lat_net + B_net /
  bw_net)``. A collective ends when its slowest rank's does;
- Newton-Schulz: each owner's matrices of the round at the calibrated time per matrix of their shape and
  dtype (:meth:`Calibration.seconds`);
- elementwise passes (momentum, the direction input, eq. 8, the update): the bytes the rank's non-matmul ops
  move (``StepMeter.traffic``) at the memory's bandwidth (:attr:`Hardware.memory`), less Newton-Schulz's own
  three passes over each matrix it orthogonalises (the norm's read, the scaling's read and write), which the
  calibrated time already holds; the largest simulated rank's, spread over the rounds by their elements;
- other collectives (MeqMuon's few ``all_reduce`` of a kilobyte): a tree's latency each, at the end.

``serial``: the rounds one after the other, each ``out + max over ranks of compute + back`` (what the blocking
step does: a round's way back waits for its slowest owner). ``overlapped``: a two-bucket pipeline, the
network taking ``out_1, out_2, back_1, out_3, back_2, ...`` (at most two buckets' matrices alive, as issue 59
item 3 bounds them) while every rank computes its rounds in order, each after its way out: ``overlap=True``'s
posts (``exchange._pipelined``). ``in_flight``: the same with every round in flight, ``out_1 .. out_B`` first
(``overlap="all"``: every matrix a rank owns alive at once), so that no owner waits for another's round. Modelled,
not measured on GPUs. None counts host time: the model predicts device time, which in a training loop is the
step's (the host runs ahead; see :func:`validate`), as long as the host's launches take less: ``host``, the
busiest simulated rank's kernels at :attr:`Hardware.launch` each, is a floor under every schedule.

**Critical path.** Newton-Schulz along the serial rounds (each round's busiest owner, what a pipeline waits for) and
the busiest rank's own total (every round in flight). With ``ns_group=g`` (``meqmuon/optim/shared_ns.py``) a block
of ``g`` ranks, or of a size dividing ``g``, may share a unit: each member then has its share (:func:`share_seconds`)
and the block's collectives it waits for (:func:`block_seconds`, over NVLink). Their lower bounds: the issue's,
compute only (:attr:`StepTimes.work_bound`), and the form's, its collectives and its units' packing included
(:func:`form_bound`), of the busiest rank and of the serial rounds.

**Inputs and their sources**: the GPU and its links in ``benchmarks/hardware.py`` (``--help`` for the options);
- training: ``6 N`` FLOPs per token (``N`` without the input embedding, routed experts counted for the ones a
  token visits, ``scale_sim.train_params``) at 40 % MFU (the Llama 3 paper, arXiv 2407.21783, Table 4: 38-43 %
  BF16 MFU for 405B on 8,192-16,384 H100s), 16M tokens a step for Llama-3 (ibid. section 3.4.1, 405B's batch
  after its ramp; the same for 8B and 70B, an assumption) and 15,360 x 4,096 for DeepSeek-V3 (the DeepSeek-V3
  report, arXiv 2412.19437, section 4.2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hardware import (  # noqa: E402
    H100,
    H200,
    HARDWARE,
    PEERS,
    Hardware,
    Link,
    Split,
    exchange_seconds,
    relayed_seconds,
    split_seconds,
)

__all__ = ["H100", "H200", "Calibration", "Hardware", "Link", "StepTimes", "exchange_seconds", "ns_flops",
           "pipeline", "rounds_of", "step_times", "train_seconds", "validate"]

#: The calibration table this repository ships (measured on an H100; ``ns_calibrate.py`` writes others).
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "calibration" / "h100.json"
#: Newton-Schulz's own elementwise passes over a matrix (its norm reads it, the scaling reads and writes it):
#: in the calibrated time, so taken out of the step's traffic.
NS_PASSES = 3
#: Tokens per optimizer step (see the module docstring for the sources).
TOKENS = {"llama3-8b": 16 * 2**20, "llama3-70b": 16 * 2**20, "llama3-405b": 16 * 2**20,
          "deepseek-v3": 15360 * 4096}


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """Matmul FLOPs of ``steps`` quintic iterations of an ``m x n`` matrix (``newton_schulz.ns_flops``)."""
    from meqmuon.optim.newton_schulz import ns_flops as count

    return count(m, n, steps)


@dataclass
class Calibration:
    """Newton-Schulz seconds per matrix by wide shape ``(min(m, n), max(m, n))`` and dtype, on ``gpu``.

    ``entries``: ``{"m", "n", "dtype", "seconds", "stack", "kind", "source"}``, ``seconds`` per matrix of a
    batched stack of ``stack`` of them (how an owner runs a bucket), ``kind`` ``"measured"`` (timed alone)
    or ``"derived"`` (from measurements of several shapes together, the derivation in ``source``)."""

    gpu: str
    entries: list[dict] = field(default_factory=list)
    source: str = ""
    #: ``--extrapolate-rate``: a fraction of the dtype's peak for every shape not in the table, instead of the
    #: nearest entry's rate (a sensitivity, e.g. the issue's "realistic 70 %").
    rate_fraction: float | None = None

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        data = json.loads(Path(path).read_text())
        return cls(data["gpu"], data["entries"], data.get("source", ""))

    def _table(self) -> dict[tuple[int, int, str], dict]:
        return {(min(e["m"], e["n"]), max(e["m"], e["n"]), e["dtype"]): e for e in self.entries}

    def seconds(self, m: int, n: int, dtype: str, hw: Hardware) -> tuple[float, str]:
        """Seconds of one ``m x n`` matrix's Newton-Schulz in ``dtype`` and how it was found: the table's
        ``kind`` where it has the shape; else ``"extrapolated"``: the effective rate (Newton-Schulz FLOPs per
        second) of the entry of that dtype nearest in FLOPs per matrix (log scale), held (larger matrices run
        their matmuls at least as fast, so this errs long), or of the nearest entry of any dtype scaled by the
        two dtypes' peaks; or ``rate_fraction`` of the dtype's peak where that is set."""
        key = (min(m, n), max(m, n), dtype)
        table = self._table()
        if key in table:
            return table[key]["seconds"], table[key]["kind"]
        flops = ns_flops(m, n)
        if self.rate_fraction is not None:
            return flops / (self.rate_fraction * hw.peak[dtype]), "extrapolated"
        same = [e for e in self.entries if e["dtype"] == dtype] or self.entries
        if not same:
            raise ValueError(f"calibration for {self.gpu} has no entries: nothing to extrapolate {m}x{n} from")
        near = min(same, key=lambda e: abs(math.log(ns_flops(e["m"], e["n"]) / flops)))
        rate = ns_flops(near["m"], near["n"]) / near["seconds"] * hw.peak[dtype] / hw.peak[near["dtype"]]
        return flops / rate, "extrapolated"


@dataclass
class Round:
    """One exchange round (a shape bucket) as every rank sees it: the bytes it moves each way out and back (the
    larger of sent and received), its Newton-Schulz seconds; ``seconds``, its largest matrix's, and ``kind``,
    how the round's times were found (:meth:`Calibration.seconds`; the least exact of them)."""

    shape: tuple[int, int]
    out: list[float]
    back: list[float]
    ns: list[float]
    elements: list[int]  # of the matrices each rank orthogonalises
    seconds: float
    work: float  # the least Newton-Schulz of the round's matrices (the Gram mirrored), no share's collectives
    kind: str
    #: One way's time where the exchange is relayed (:func:`relayed_seconds`), else None.
    relayed: float | None = None
    #: A unit's ways on the ranks allowed to share it (:func:`ways`): (ranks, each one's seconds).
    ways: tuple[tuple[int, float], ...] = ()
    units: int = 0  # the round's units (of ``ways`` each)
    #: Each rank's bytes by peer (``hardware.Split``, ``rank_model``'s count for a node of this size), else None:
    #: spread evenly over the ranks.
    split: Split | None = None


def rounds_of(inputs: dict, world: int, cal: Calibration, hw: Hardware) -> tuple[list[Round], float]:
    """The rounds of a simulated configuration (``time_inputs``), every rank's bytes from the plan: out, a rank
    sends its ``local`` pieces and an owner receives its whole matrices; back, the reverse; in the Newton-Schulz
    dtype, scaled by ``factor``: what the most loaded simulated rank measured over what the plan gives it
    (MeqMuon's float32 factors beside its bf16 directions, the few all-reduced bytes). Returns the rounds and
    the factor (1 without an exchange)."""
    from meqmuon.optim.shared_ns import block_of, column_flops

    itemsize, dtype = inputs["itemsize"], inputs["ns_dtype"]
    plan = [itemsize * (loc + own) for loc, own in zip(inputs.get("local", []), inputs.get("owned", []),
                                                       strict=True)]
    factor = 1.0
    if any(plan):
        def exchanged(r: dict) -> float:  # a block's collectives (ns_group, ReplicaShare) are priced apart
            down = r.get("block_received", r.get("block", 0) / 2)  # earlier simulations: half of them each way
            return max(r["sent"] - (r.get("block", 0) - down), r["received"] - down)

        measured = {r["rank"]: exchanged(r) for r in inputs["ranks"]}
        top = max(measured, key=lambda r: (plan[r], -r))
        factor = measured[top] / plan[top] if plan[top] else 1.0
    rounds = []
    for rd in inputs.get("rounds", []):
        # an owner's unit of work: one matrix of the bucket's shape, or a parameter's matrices (the owner path)
        matrices = rd.get("matrices", [rd["shape"]])
        found = [cal.seconds(m, n, dtype, hw) for m, n in matrices]
        seconds, size = sum(t for t, _ in found), sum(m * n for m, n in matrices)
        # the least work that orthogonalises them: the quintic with its Gram matrix mirrored (the column split's
        # FLOPs on one rank, shared_ns.column_flops), at each matrix's calibrated rate
        least = sum(t * column_flops(m, n, 5, 1) / ns_flops(m, n) for (t, _), (m, n) in zip(found, matrices,
                                                                                            strict=True))
        kinds = {k for _, k in found}
        kind = next(k for k in ("extrapolated", "derived", "measured") if k in kinds)
        owned = [0] * world
        for r, k in rd["owned"]:
            owned[r] = k
        moved = ([factor * itemsize * max(loc, k * size) for loc, k in zip(rd["local"], owned, strict=True)]
                 if rd["local"] else [0.0] * world)
        ns = [k * seconds for k in owned]
        for r, b in enumerate(rd.get("gathered", ())):  # a block's alike stack, gathered over NVLink in n rounds,
            n = rd.get("gather_rounds", 1)              # each round's gather h while the next computes c: a flow shop
            c, h = ns[r] / n, hw.base_latency + (rd["replicas"] - 1) * hw.nvlink.latency + b / n / hw.nvlink.bandwidth
            ns[r] = c + (n - 1) * max(c, h) + h if b else ns[r]
        for q, how, *block in rd.get("shared", []):  # a unit a block shares: each member its part and the block's
            ns[q] -= seconds                          # collectives, the owner still receiving it whole
            g = block[0] if block else rd.get("block", 1)  # its own block's size (earlier simulations: ns_group's)
            part = (share_seconds(how, matrices, dtype, g, cal, hw)
                    + block_seconds(how, matrices, dtype, itemsize, g, cal, hw))
            for member in block_of(q, g):
                ns[member] += part
        # each rank's bytes by peer (its node's ranks or the others), where the rank model counted them for this
        # node size: an expert owned in the TP group that holds it moves over NVLink alone
        split = (tuple([factor * itemsize * x for x in rd[k]] for k in PEERS)
                 if rd["local"] and rd.get("node") == hw.ranks_per_node else None)
        relayed = None
        if inputs.get("relay_group", 1) > 1 and rd["local"]:  # the pieces and the owned units, each way
            relayed = relayed_seconds([factor * itemsize * loc for loc in rd["local"]],
                                      [factor * itemsize * k * size for k in owned], hw, split)
        rounds.append(Round(tuple(rd["shape"]), moved, list(moved), ns, [k * size for k in owned],
                            max(t for t, _ in found), sum(owned) * least, kind, relayed,
                            ways(matrices, seconds, dtype, itemsize, inputs.get("ns_group", 1), cal, hw),
                            sum(owned), split))
    return rounds, factor


def ways(matrices: list, seconds: float, dtype: str, itemsize: int, g: int, cal: Calibration,
         hw: Hardware) -> tuple[tuple[int, float], ...]:
    """A unit's ways on at most ``g`` ranks (``ns_group``) in the form the plan has, as ``(ranks, each one's
    seconds)``: whole at one owner (``seconds``, the full quintic) or shared by a block of each of
    ``shared_ns.block_sizes(g)``, a member's part and the block's collectives (:func:`share_seconds`,
    :func:`block_seconds`; as ``shared_ns.share`` splits: a stack of at least ``z`` matrices by its matrices, else
    each matrix by its columns). :func:`form_bound` reads them."""
    from meqmuon.optim.shared_ns import block_sizes, split_of

    def part(z: int) -> float:
        how = split_of(len(matrices), z)
        return (share_seconds(how, matrices, dtype, z, cal, hw)
                + block_seconds(how, matrices, dtype, itemsize, z, cal, hw))

    return ((1, seconds), *((z, part(z)) for z in block_sizes(g)))


def form_bound(rounds: list[Round], world: int) -> float:
    """The critical path's lower bound for plans of the issue's form, their collectives included: the least ``T`` at
    which every unit has a way (:func:`ways`) of at most ``T`` per rank and the units fit ``world`` ranks for ``T``,
    counted by Fekete and Schepers' dual feasible functions (Math. Programming 91, 2001, "New classes of fast lower
    bounds for bin packing problems"): for ``0 <= e <= T / 2``, ``u(x) = 1`` where ``x > T - e``, ``x / T`` where
    ``e <= x <= T - e``, ``0`` where ``x < e`` sums to at most 1 on any rank loaded within ``T`` (a share above
    ``T - e`` leaves room only for shares below ``e``), so a plan within ``T`` has ``sum_u min_{t_z(u) <= T} z
    u(t_z(u)) <= W``. ``e = 0`` is the fluid bound ``T_0`` (every rank-second used); a larger ``e`` counts a share
    that leaves no room for another of ``e`` as a whole rank (70B on 1,024 ranks: beside a 4-share of an MLP matrix,
    23.7 ms, only a q matrix's 8-share, 9.9 ms, fits). For one ``e`` the test is monotone in ``T`` (``u`` falls and
    the ways grow with ``T``), so its least ``T`` is bisected, for ``e`` in 0, ``T_0 / 2`` and the ways' times within
    it; the bound is the largest. It ignores block alignment and units a layout pins to ranks (local experts), so a
    plan may sit above it, never below."""
    units = [(rd.units, rd.ways) for rd in rounds if rd.units and rd.ways]
    if not units:
        return 0.0

    def least(e: float, lo: float) -> float:
        def fits(t: float) -> bool:
            return sum(k * min(z * (1.0 if s > t - e else s / t if s >= e else 0.0) for z, s in w if s <= t)
                       for k, w in units) <= world

        hi = lo
        while not fits(hi):
            hi *= 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return hi

    fluid = least(0.0, max(min(s for _, s in w) for _, w in units))
    return max([fluid, *(least(e, fluid) for e in {fluid / 2} | {s for _, w in units for _, s in w if s <= fluid / 2})])


def share_seconds(how: str, matrices: list, dtype: str, g: int, cal: Calibration, hw: Hardware) -> float:
    """A block member's Newton-Schulz of a unit its block of ``g`` shares (``meqmuon/optim/shared_ns.py``): its share
    of the FLOPs (``shared_ns.share_flops``: a range of a stack's matrices, or its columns of each matrix) at the
    rate of a matrix's calibrated time, the quintic's five steps as everywhere here."""
    from meqmuon.optim.shared_ns import share_flops

    (m, n) = matrices[0]
    quintic = {"ns_method": "quintic", "ns_steps": 5}
    return cal.seconds(m, n, dtype, hw)[0] * share_flops(how, matrices, quintic, g) / ns_flops(m, n)


def block_seconds(how: str, matrices: list, dtype: str, itemsize: int, g: int, cal: Calibration, hw: Hardware,
                  steps: int = 5) -> float:
    """A shared unit's collectives over its block (consecutive ranks: NVLink where ``g`` fits a node) that every
    member waits for: the owner's bytes less those its Gram matmuls hide (``shared_ns.exposed_bytes``, at the
    matrix's calibrated rate over the link's bandwidth: the parts out and back, ``B``'s rows gathered, and of the
    Gram matrices' ring all-reduce in float32 its last row block and what the next blocks' making does not cover)
    at the link's bandwidth, after each collective's latency (a ring all-reduce ``2 (g - 1)`` steps; one
    all-reduce's and one gather's per iteration, the earlier blocks' latencies hidden with their bytes)."""
    from meqmuon.optim.shared_ns import exposed_bytes

    link = hw.nvlink if g <= hw.ranks_per_node else hw.network
    (m, n), k = matrices[0], len(matrices)
    latency = 2 * (hw.base_latency + link.latency)
    if how == "columns":
        latency += steps * (2 * hw.base_latency + (2 * (g - 1) + 1) * link.latency)
    rate = ns_flops(m, n) / cal.seconds(m, n, dtype, hw)[0]
    return latency + exposed_bytes(how, k, m, n, itemsize, g, steps, rate / link.bandwidth) / link.bandwidth


def pipeline(out: list[float], compute: list[list[float]], back: list[float], overlap: bool | int) -> float:
    """The step's time from its rounds: ``out[b]`` and ``back[b]`` the collectives' times (global: a
    collective ends when its slowest rank's part does), ``compute[b][r]`` rank ``r``'s work of round ``b``.

    ``overlap=False``: ``sum_b out[b] + max_r compute[b][r] + back[b]``. Else ``d`` rounds in flight (``True``: 2,
    ``overlap=True``'s pipeline; an integer: that many; the number of rounds: ``overlap="all"``): the network runs
    ``out_1 .. out_d, back_1, out_{d+1}, back_2, out_{d+2}, ..., back_B`` in that order (``exchange._pipelined``'s
    posts), each rank its rounds in order, round ``b``'s compute after ``out[b]`` and ``back[b]`` after every rank's
    compute of ``b``: never above the serial time, and where one side is negligible the other's sum plus the first
    way out and the last way back."""
    rounds = len(out)
    if not rounds:
        return 0.0
    if overlap is False:
        return sum(o + max(c, default=0.0) + b for o, c, b in zip(out, compute, back, strict=True))
    depth = 2 if overlap is True else max(1, int(overlap))
    order = [("out", b) for b in range(min(depth, rounds))] + [
        x for b in range(rounds) for x in (("back", b), *((("out", b + depth),) if b + depth < rounds else ()))]
    net = 0.0
    free = [0.0] * max(len(c) for c in compute)  # each rank's compute stream
    out_end = [0.0] * rounds
    for what, b in order:
        if what == "out":
            net = out_end[b] = net + out[b]
            continue
        for r, c in enumerate(compute[b]):
            free[r] = max(free[r], out_end[b]) + c
        done = max([out_end[b], *free[:len(compute[b])]])  # every rank's compute of round b
        net = max(net, done) + back[b]
    return max([net, *free])


@dataclass
class StepTimes:
    """One configuration's modelled step, in seconds (the module docstring): ``serial`` (today's blocking rounds),
    ``overlapped`` (a two-bucket pipeline) and ``in_flight`` (every round in flight, ``overlap="all"``), each also
    with nothing to exchange (``*_compute``: the rest is the exchange not hidden, :attr:`hidden`,
    :attr:`hidden_in_flight`); ``one_exchange``: every round's pieces out in one collective, every owner's
    Newton-Schulz, everything back in one. Their parts: the rounds' collectives both ways (``exchange``);
    Newton-Schulz along the serial rounds (``ns_serial``), the busiest rank's own (``ns_busiest``), the mean rank's
    and the largest matrix's (:attr:`ns_bound`, the larger); the bounds: every matrix's least work over the ranks
    (``ns_work``: the quintic with its Gram matrix mirrored, no share's collectives; :attr:`work_bound`, the
    issue's), the form's with its collectives and packing (``ns_form``, :func:`form_bound`, the busiest rank's) and
    the sum of each round's alone (``ns_form_rounds``, the serial rounds'); the elementwise passes of the most loaded
    simulated rank, the other collectives; ``factor``: measured over planned bytes; ``extrapolated``: some shape's
    Newton-Schulz time is not in the calibration table; ``kernels``: the most a simulated rank launches
    (``StepMeter.ops``), ``host`` their launches' time, a floor under the step."""

    serial: float
    overlapped: float
    overlapped_compute: float
    one_exchange: float
    in_flight: float
    in_flight_compute: float
    exchange: float
    ns_serial: float
    ns_busiest: float
    ns_mean: float
    ns_largest: float
    ns_work: float
    ns_form: float
    ns_form_rounds: float
    elementwise: float
    other: float
    factor: float
    extrapolated: bool
    kernels: int = 0
    host: float = 0.0

    @property
    def ns_bound(self) -> float:
        """Newton-Schulz's critical path at best without splitting a matrix: ``max(total / W, largest)``."""
        return max(self.ns_mean, self.ns_largest)

    @property
    def work_bound(self) -> float:
        """The critical path's lower bound, compute only (issue 59): ``max(total work / W, largest / g)``."""
        return max(self.ns_work, self.ns_largest)

    @property
    def hidden(self) -> float:
        """The share of the exchange's time the two-bucket pipeline hides behind compute."""
        return 1 - (self.overlapped - self.overlapped_compute) / self.exchange if self.exchange else 0.0

    @property
    def hidden_in_flight(self) -> float:
        """The share of the exchange's time hidden behind compute with every round in flight."""
        return 1 - (self.in_flight - self.in_flight_compute) / self.exchange if self.exchange else 0.0


def step_times(summary: dict, hw: Hardware, cal: Calibration, longest_first: bool = False) -> StepTimes:
    """:class:`StepTimes` of one ``scale_sim.summarise`` row (its ``time_inputs``) on ``hw``; the rounds in the
    plan's order, or with ``longest_first`` by their busiest owner's Newton-Schulz, longest first (what a
    pipeline would want: the longest computes while the others' exchanges run)."""
    inputs = summary["time_inputs"]
    world = math.prod(int(x) for x in str(summary["ranks"]).split("x"))
    rounds, factor = rounds_of(inputs, world, cal, hw)
    if longest_first:
        rounds.sort(key=lambda rd: -max(rd.ns, default=0.0))
    orthogonalised = [sum(rd.elements[r] for rd in rounds) for r in range(world)]
    traffic = max(r["traffic"] - NS_PASSES * inputs["itemsize"] * orthogonalised[r["rank"]] for r in inputs["ranks"])
    elementwise = max(traffic, 0) / hw.memory
    weights = [sum(rd.out) + sum(rd.ns) for rd in rounds]
    total = sum(weights)
    compute = [[ns + elementwise * w / total for ns in rd.ns] for rd, w in zip(rounds, weights, strict=True)] \
        if total else [[elementwise]]
    def one_way(rd: Round, moved: list[float]) -> float:  # a collective ends with its slowest rank's part
        if rd.relayed is not None:
            return rd.relayed
        if rd.split is not None:
            far, far_owned, near, near_owned = rd.split
            return max(split_seconds(max(a, b), max(c, d), hw) for a, b, c, d in zip(near, near_owned, far,
                                                                                      far_owned, strict=True))
        return max(exchange_seconds(b, world, hw) for b in moved)

    out = [one_way(rd, rd.out) for rd in rounds] or [0.0]
    back = [one_way(rd, rd.back) for rd in rounds] or [0.0]
    # the other collectives (all-reduces of a few floats over the world; a block's are its rounds' block_seconds): a
    # tree's latency each, after the rounds
    calls, nbytes = ((inputs["calls_by_group"], inputs["bytes_by_group"]) if inputs.get("calls_by_group") else
                     (inputs["calls"], inputs["bytes_by_name"]))
    other = sum(count * hw.allreduce_seconds(nbytes.get(name, 0) / (2 * count), world)
                for name, count in calls.items() if name.startswith("allreduce")
                and name.partition("@")[2] in ("", str(world)))
    per_rank = [sum(rd.ns[r] for rd in rounds) for r in range(world)]
    # the largest matrix on the ranks allowed to share it (ns_group: its block's, by columns)
    largest = max((rd.seconds for rd in rounds if any(rd.ns)), default=0.0) / inputs.get("ns_group", 1)
    return StepTimes(
        serial=pipeline(out, compute, back, overlap=False) + other,
        overlapped=pipeline(out, compute, back, overlap=True) + other,
        overlapped_compute=pipeline([0.0] * len(out), compute, [0.0] * len(back), overlap=True) + other,
        one_exchange=pipeline([max(exchange_seconds(sum(rd.out[r] for rd in rounds), world, hw) for r in range(world))],
                              [[sum(c[r] for c in compute) for r in range(len(compute[0]))]],
                              [max(exchange_seconds(sum(rd.back[r] for rd in rounds), world, hw)
                                   for r in range(world))], overlap=False) + other if rounds else
        elementwise + other,
        in_flight=pipeline(out, compute, back, overlap=len(out)) + other,
        in_flight_compute=pipeline([0.0] * len(out), compute, [0.0] * len(back), overlap=len(out)) + other,
        exchange=sum(out) + sum(back), ns_serial=sum(max(rd.ns) for rd in rounds),
        ns_busiest=max(per_rank, default=0.0), ns_mean=sum(per_rank) / world, ns_largest=largest,
        ns_work=sum(rd.work for rd in rounds) / world,
        ns_form=form_bound(rounds, world), ns_form_rounds=sum(form_bound([rd], world) for rd in rounds),
        elementwise=elementwise, other=other, factor=factor,
        extrapolated=any(rd.kind == "extrapolated" for rd in rounds if any(rd.ns)),
        kernels=(kernels := max((r.get("ops") or 0 for r in inputs["ranks"]), default=0)), host=kernels * hw.launch)


def train_seconds(params: int, tokens: int, world: int, hw: Hardware, mfu: float) -> float:
    """Forward and backward of one step: ``6 params tokens`` FLOPs over ``world`` GPUs at ``mfu`` of bf16's peak."""
    return 6 * params * tokens / (world * hw.peak["bfloat16"] * mfu)


HEADER = ("| model | layout | ranks | optimizer | exchange, both ways | Newton-Schulz: serial rounds / busiest rank / "
          "mean rank / largest matrix | serial rounds / their form bound | busiest / work bound | busiest / form bound "
          "| elementwise | step: serial | two-bucket pipeline | exchange hidden by it | every bucket in flight | "
          "exchange hidden by it | one exchange | kernels: count / host's launches | fwd+bwd at MFU | share: serial | "
          "pipeline | in flight | one exchange |")


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x < 10 else f"{x:,.1f} s"


def table(summaries: list[dict], hw: Hardware, cal: Calibration, mfu: float, tokens: dict[str, int],
          longest_first: bool = False) -> str:
    """The time table (``HEADER``) of ``scale_sim`` summaries; an extrapolated Newton-Schulz time marked ``*``."""
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for s in summaries:
        group, relay = (s.get("time_inputs", {}).get(k, 1) for k in ("ns_group", "relay_group"))
        head = (f"| {s['model']} | {s['layout']} | {s['ranks']} | {s.get('optimizer')}"
                + (f", ns_group={group}" if group > 1 else "") + (f", relay_group={relay}" if relay > 1 else "") + " |")
        if "error" in s:
            lines.append(f"{head} {s['error']} |" + " |" * (HEADER.count(" | ") - 5))
            continue
        t = step_times(s, hw, cal, longest_first)
        world = math.prod(int(x) for x in str(s["ranks"]).split("x"))
        fb = train_seconds(s["time_inputs"]["train_params"], tokens.get(s["model"], 16 * 2**20), world, hw, mfu)
        star = "*" if t.extrapolated else ""
        ns = (f"{_ms(t.ns_serial)} / {_ms(t.ns_busiest)} / {_ms(t.ns_mean)} / {_ms(t.ns_largest)}{star}"
              if t.ns_bound else "-")
        ratio = f"{t.ns_serial / t.ns_form_rounds:.2f}x" if t.ns_form_rounds else "-"
        ratio += f" | {t.ns_busiest / t.work_bound:.2f}x" if t.work_bound else " | -"
        ratio += f" | {t.ns_busiest / t.ns_form:.2f}x" if t.ns_form else " | -"
        hidden = f"{t.hidden:.0%}" if t.exchange else "-"
        hidden_all = f"{t.hidden_in_flight:.0%}" if t.exchange else "-"
        share = " | ".join(f"{x / (fb + x):.2%}" for x in (t.serial, t.overlapped, t.in_flight, t.one_exchange))
        lines.append(f"{head} {_ms(t.exchange)} | {ns} | {ratio} | {_ms(t.elementwise)} | {_ms(t.serial)} | "
                     f"{_ms(t.overlapped)} | {hidden} | {_ms(t.in_flight)} | {hidden_all} | {_ms(t.one_exchange)} | "
                     f"{t.kernels:,} / {_ms(t.host)} | {_ms(fb)} | {share} |")
    return "\n".join(lines)


#: The single-GPU optimizer steps measured (docs/benchmarks.md, "GPU" and "Issue 49"), batched eager, bf16
#: Newton-Schulz: (GPU, model, optimizer, milliseconds, how). "events in training": CUDA events around
#: ``opt.step()`` in ``benchmarks/gpu.py``'s training loop, where the host has run ahead (device time);
#: "step_time.py": wall time of one step between device syncs (host time included, rounded to whole ms on
#: the H200); "kernels": the profile's GPU time of the step's kernels.
MEASURED = [
    ("h100", "llama-350m", "muon", 27.72, "step_time.py, calls 5 and 6 (27.67, 27.78)"),
    ("h100", "llama-350m", "meqmuon", 29.78, "step_time.py, calls 5 and 6 (29.92, 29.64)"),
    ("h100", "llama-60m", "muon", 3.44, "step_time.py, call 5"),
    ("h100", "llama-60m", "meqmuon", 5.31, "step_time.py, call 5 (host-bound)"),
    ("h100", "llama-60m", "meqmuon", 3.3, "kernels, call 1 (of a 5.33 ms step)"),
    ("h100", "llama-60m", "meqmuon", 3.5, "events in training, call 6"),
    ("h200", "llama-350m", "adamw", 8.2, "events in training, run 1"),
    ("h200", "llama-350m", "muon", 23.6, "events in training, runs 1 and 2"),
    ("h200", "llama-350m", "meqmuon", 26.45, "events in training, runs 1 and 2 (26.8, 26.1)"),
    ("h200", "llama-350m", "muon", 24.0, "step_time.py, run 1"),
    ("h200", "llama-350m", "meqmuon", 27.0, "step_time.py, run 1"),
    ("h200", "llama-60m", "adamw", 1.4, "events in training, run 1"),
    ("h200", "llama-60m", "meqmuon", 3.0, "events in training, run 2"),
    ("h200", "llama-60m", "adamw", 2.0, "step_time.py (torch AdamW), run 1"),
]


def single_gpu(model: str, optimizer: str, hw: Hardware, cal: Calibration) -> tuple[float, float, float]:
    """One GPU's step at a registry model's shapes (``benchmarks/shapes.py``): its matrices' Newton-Schulz at
    the calibrated times, batched by shape, and the bytes its batched step's non-matmul ops move
    (``op_count.TrafficCounter`` on ``meta``, bf16 Newton-Schulz) less Newton-Schulz's own passes, at the
    memory's bandwidth. Returns (total, Newton-Schulz, elementwise) seconds."""
    from collections import Counter

    from op_count import TrafficCounter, count_step_ops
    from shapes import model_shapes

    shapes = model_shapes(model)
    traffic = count_step_ops(optimizer, shapes, True, counter=TrafficCounter).total_bytes
    ns = elements = 0.0
    if optimizer != "adamw":
        for (m, n), k in Counter(s[-2:] for s in shapes["hidden"]).items():
            ns += k * cal.seconds(m, n, "bfloat16", hw)[0]
            elements += k * m * n
    elementwise = (traffic - NS_PASSES * 2 * elements) / hw.memory
    return ns + elementwise, ns, elementwise


def validate(cal: Calibration) -> str:
    """The model against every measured single-GPU step of :data:`MEASURED` (same calibration on both GPUs:
    an H200 is an H100's compute with faster memory)."""
    lines = ["| GPU | model | optimizer | measured | how | modelled (Newton-Schulz + elementwise) | error | "
             "at the datasheet's HBM bandwidth |", "|---|---|---|---|---|---|---|---|"]
    cache: dict = {}
    for gpu, model, optimizer, ms, how in MEASURED:
        hw = HARDWARE[gpu]
        key = (gpu, model, optimizer)
        if key not in cache:
            cache[key] = single_gpu(model, optimizer, hw, cal)
        total, ns, elementwise = cache[key]
        peak = ns + elementwise * hw.hbm_efficiency
        lines.append(f"| {gpu.upper()} | {model} | {optimizer} | {ms:.2f} ms | {how} | {total * 1e3:.2f} ms "
                     f"({ns * 1e3:.2f} + {elementwise * 1e3:.2f}) | {total * 1e3 / ms - 1:+.0%} | "
                     f"{peak * 1e3:.2f} ms, {peak * 1e3 / ms - 1:+.0%} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summaries", nargs="*", help="scale_sim.py --save files (their configurations in order)")
    parser.add_argument("--gpu", default="h100", choices=sorted(HARDWARE))
    parser.add_argument("--calibration", default=str(DEFAULT_CALIBRATION), help="Newton-Schulz times per shape")
    parser.add_argument("--extrapolate-rate", type=float, default=None,
                        help="a fraction of the dtype's peak for shapes the table lacks, not the nearest's rate")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--nvlink-gbs", type=float, default=None, help="NVLink GB/s each way (default 370)")
    parser.add_argument("--network-gbs", type=float, default=None, help="network GB/s per GPU (default 48)")
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--tokens", type=float, default=None, help="tokens per step for every model (default: "
                        "16M for Llama-3, 15,360 x 4,096 for DeepSeek-V3)")
    parser.add_argument("--longest-first", action="store_true",
                        help="the rounds by their Newton-Schulz time, longest first, not in the plan's order")
    parser.add_argument("--relay-group", type=int, default=None,
                        help="the exchange relayed through nodes of this many ranks (relay_group) in every "
                             "configuration: the plan's bytes routed so (a simulation without the relay serves)")
    parser.add_argument("--launch-us", type=float, default=None,
                        help="the host's microseconds a kernel launch (default 5): the host's floor under a step")
    parser.add_argument("--validate", action="store_true", help="the model against the single-GPU steps")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    hw = HARDWARE[args.gpu]
    hw = replace(hw, ranks_per_node=args.ranks_per_node, launch=hw.launch if args.launch_us is None else
                 args.launch_us * 1e-6, **{k: replace(getattr(hw, k), bandwidth=gbs * 1e9) for k, gbs in
                                           (("nvlink", args.nvlink_gbs), ("network", args.network_gbs)) if gbs})
    cal = Calibration.load(args.calibration)
    cal.rate_fraction = args.extrapolate_rate
    if args.validate:
        print(f"# the model against single-GPU steps, calibration {args.calibration} ({cal.gpu})\n")
        print(validate(cal))
    if args.summaries:
        summaries = [s for path in args.summaries for s in json.loads(Path(path).read_text())]
        for s in summaries if args.relay_group else ():
            s.get("time_inputs", {})["relay_group"] = args.relay_group
        tokens = {k: int(args.tokens) for k in TOKENS} if args.tokens else TOKENS
        print(f"# {hw.name}, {hw.ranks_per_node} ranks a node, NVLink {hw.nvlink.bandwidth / 1e9:.0f} GB/s, network "
              f"{hw.network.bandwidth / 1e9:.0f} GB/s, HBM {hw.hbm / 1e12:.2f} TB/s; calibration {cal.gpu}"
              + (f", extrapolated at {cal.rate_fraction:.0%} of peak" if cal.rate_fraction else "")
              + f"; MFU {args.mfu:.0%}; {hw.launch * 1e6:g} us a kernel launch"
              + ("; rounds longest first" if args.longest_first else "") + "\n")
        print(table(summaries, hw, cal, args.mfu, tokens, args.longest_first))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
