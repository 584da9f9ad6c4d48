"""The optimizer at the scale users train, simulated on one CPU process: torch's fake process group stands
for one rank of up to 1,024 (issue 47, item 5).

Usage::

    python benchmarks/scale_sim.py                                   # the issue's table (minutes)
    python benchmarks/scale_sim.py --model llama3-405b --layout fsdp2 --ranks 1024 --layers 2
    python benchmarks/scale_sim.py --model llama3-70b --layout fsdp2xtp --ranks 128x8 --sample-ranks 0,5,1023
    python benchmarks/scale_sim.py --runs time --ns-dtype bfloat16 --optimizer muon --save sim-muon.json --time

``dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=N)``: every collective is a no-op
that returns at once and receives nothing, so a plan that needs data another rank sends cannot be made
here (the simulator says so per layout: "not plannable on fake PG: <what failed, where>"; "step N fails on
fake PG: ..." where the first step planned). The model is the transformers class of the real one
(Llama-3 8B/70B/405B, a DeepSeek-V3-like MoE with 256 stacked experts),
built on ``meta`` and sharded by torch's own APIs on a DeviceMesh of the fake group: FSDP2 (``fully_shard``
per decoder layer and the root; stacked experts on their dimension 1 where the ranks outnumber them, as
torchtitan does, or ``fsdp2-rows``: on dimension 0, torch's default, the ranks past the experts holding none),
FSDP2 over TP (torchtitan's TP plan, then FSDP2 over ``dp``; for DeepSeek-V3 its MLA and expert plan,
``comm_bytes.deepseek_tp_plan``; ``fsdp2xtp-dense``: the Llama plan, the experts repeated over ``tp``), EP as
torchtitan lays it out (``ep``: stacked experts ``Shard(0)`` over an ``ep`` mesh, every other parameter
``fully_shard`` over a ``dp`` mesh of the same ranks) or with every other parameter ``Replicate()``
(``ep-replicated``). Gradients are zeros of each parameter's
placements. With ``--device meta`` (the default) nothing is allocated at all: every op runs on shapes, so
Newton-Schulz costs no time and its FLOPs are counted; ``--device cpu`` materialises the local shards only
(``to_empty``) and computes for real (small models).

Per simulated rank, from ``step_accounting``: the bytes of the third step's collectives against the floor,
the collectives per step, what the optimizer holds after the step beyond its state, the step's transient
peak (a counting allocator: every storage an op creates in the step, until freed; the same on ``meta`` as on
a device), the time of the first step (which plans) and of the next (both unmetered; on ``meta`` they are the
Python and dispatch overhead alone), the optimizer's memory against AdamW's state on the same layout
(``rank_model.adamw_bytes``), and the owner load: the busiest simulated rank's Newton-Schulz FLOPs against
``max(total / ranks, largest matrix)`` (analytic, ``newton_schulz.method_flops``).

Which ranks (``--sample-ranks``, default ``0,busiest``): rank 0, then the ranks that ``rank_model`` finds
busiest in rank 0's plan (deterministic, no collective: one rank's plan is every rank's): the most bytes, the
most bytes per byte of floor, the most FLOPs, the least bound per byte of floor. From the same model, every
rank's reachable bound (what whole-matrix owners must move: ``itemsize x (local + owned)``) and the mean over
all ranks of the bound against the floor. Each simulated rank runs in its own process; the largest peak
resident memory (RSS) and the summed wall time of a configuration's are reported beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from rank_model import RankModel, adamw_bytes, rank_model  # noqa: E402
from step_accounting import StepMeter, floor_bytes, held_bytes, hidden_layouts  # noqa: E402

#: Model shapes (transformers config keywords): Llama-3 (Meta's params.json) and DeepSeek-V3 (its config.json).
MODELS = {
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)),
    "llama3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)),
    "llama3-405b": ("llama", dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                  num_attention_heads=128, num_key_value_heads=8, vocab_size=128256)),
    "deepseek-v3": ("deepseek_v3", dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                        num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
                                        n_shared_experts=1, num_experts_per_tok=8, num_attention_heads=128,
                                        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                        vocab_size=129280)),
    "llama-tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256)),
    "moe-tiny": ("deepseek_v3", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                     num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8,
                                     n_shared_experts=1, num_experts_per_tok=2, num_attention_heads=4,
                                     num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                     qk_nope_head_dim=8, v_head_dim=8, vocab_size=256)),
}
#: The issue's configurations: (model, layout, ranks).
DEFAULT_RUNS = [
    ("llama3-8b", "fsdp2", "256"), ("llama3-8b", "fsdp2", "1024"), ("llama3-8b", "fsdp2xtp", "128x8"),
    ("llama3-70b", "fsdp2", "256"), ("llama3-70b", "fsdp2", "512"), ("llama3-70b", "fsdp2", "1024"),
    ("llama3-70b", "fsdp2xtp", "128x8"),
    ("llama3-405b", "fsdp2", "256"), ("llama3-405b", "fsdp2", "1024"), ("llama3-405b", "fsdp2xtp", "128x8"),
    ("deepseek-v3", "fsdp2", "256"), ("deepseek-v3", "ep", "256"), ("deepseek-v3", "ep-replicated", "256"),
]
#: Issue 59's configurations (``--runs time``), whose step times ``benchmarks/time_model.py`` models.
TIME_RUNS = [(model, layout, ranks) for model in ("llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3")
             for layout, ranks in (("fsdp2", "256"), ("fsdp2", "1024"), ("fsdp2xtp", "128x8"))]
RUNS = {"issue47": DEFAULT_RUNS, "time": TIME_RUNS}
#: ``--overlap``: the optimizer's ``overlap`` (``default``: not passed).
OVERLAPS: dict[str, bool | str | None] = {"default": None, "off": False, "pipeline": True, "all": "all"}


def build_model(name: str, layers: int | None):
    """The model ``name`` on ``meta``, with ``layers`` decoder layers (all of them for ``None``)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    family, kw = MODELS[name]
    kw = {**kw, "tie_word_embeddings": False}
    if layers is not None:
        kw["num_hidden_layers"] = layers
    cfg = (LlamaConfig if family == "llama" else DeepseekV3Config)(**kw)
    with torch.device("meta"):
        return (LlamaForCausalLM if family == "llama" else DeepseekV3ForCausalLM)(cfg)


def mesh_for(layout: str, ranks: str):
    """The DeviceMesh of ``layout`` over the fake group: ``N`` ranks, or ``DPxTP`` for FSDP2 over TP."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.startswith("fsdp2xtp"):
        dp, tp = (int(x) for x in ranks.split("x"))
        return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (world_of(ranks),), mesh_dim_names=(layout,))


def torchtitan_ep(model, ep, dp) -> None:
    """torchtitan's expert parallelism: the stacked experts (3-D parameters) ``Shard(0)`` over the EP mesh
    ``ep``, each rank holding whole experts; every other parameter FSDP2 (``fully_shard`` per decoder layer and
    the root, the experts ``ignored_params``) over the DP mesh ``dp`` of the same ranks
    (``tests/test_placement.py``'s EP test, at full scale)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    experts = set()
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.ndim == 3:
                q = torch.nn.Parameter(distribute_tensor(p.detach(), ep, [Shard(0)]))
                setattr(module, name, q)
                experts.add(q)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp, ignored_params=experts)
    fully_shard(model, mesh=dp, ignored_params=experts)


def world_of(ranks: str) -> int:
    return math.prod(int(x) for x in ranks.split("x"))


def hidden_ns_flops(opt) -> tuple[int, int]:
    """(total, largest) Newton-Schulz FLOPs of the optimizer's hidden-kind matrices, whole (analytic: the
    group's method's count, ``newton_schulz.method_flops``)."""
    try:
        from meqmuon.optim.newton_schulz import method_flops
    except ImportError:  # the optimizer before main's refactor (7fbad80): the quintic count, the only one then
        from meqmuon.optim.newton_schulz import ns_flops

        def method_flops(group: dict, m: int, n: int) -> int:
            return ns_flops(m, n, group["ns_steps"])

    total = largest = 0
    for _, group, layout in hidden_layouts(opt):
        for m, n in layout.shapes():
            f = method_flops(group, m, n)
            total += f
            largest = max(largest, f)
    return total, largest


def train_params(model) -> int:
    """The parameters one token's forward multiplies by (``6 N`` FLOPs per token for forward and backward, as
    ``benchmarks/gpu.py`` counts: every matrix but the input embedding; attention's own FLOPs left out), a routed
    expert stack ``(E, ...)`` counted for the ``num_experts_per_tok`` of its ``E`` experts a token visits."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    total = 0
    for name, p in model.named_parameters():
        if p.ndim < 2 or "embed_tokens" in name:
            continue
        total += p.numel() * top_k // p.shape[0] if p.ndim == 3 and top_k else p.numel()
    return total


def _fail_reason(exc: BaseException) -> str:
    """The exception in one line with the innermost frame of ``meqmuon`` that raised it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/meqmuon/" in f.filename]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    text = str(exc).strip()
    if "meta" in text:  # a data-dependent op: what the fake group's collectives return has no data
        op = re.search(r"(torch\.[\w.]+\(\)|aten::\w+|\.item\(\)|\.tolist\(\))", text)
        return f"the plan reads tensor data ({op.group(1) if op else 'a data-dependent op'} on meta){where}"
    first = text.splitlines()[0].split(". ")[0][:120] if text else ""
    return f"{type(exc).__name__}: {first}{where}"


def simulate(model_name: str, layout: str, ranks: str, rank: int, *, layers: int | None, device: str,
             optimizer: str = "meqmuon", ns_dtype: torch.dtype = torch.float32, foreach: bool = True,
             ns_group: int = 1, relay_group: int = 1, overlap: bool | str | None = None,
             exchange_unit: str = "matrix") -> dict:
    """One simulated rank: builds, shards, steps three times (the first two timed, the third metered).
    Returns the measurements, or ``{"error": ...}`` where the optimizer cannot be planned or stepped on the
    fake group."""
    import torch.distributed as dist
    from comm_bytes import expert_parallel, shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import meqmuon
    from meqmuon.optim import decision

    world = world_of(ranks)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    # the simulated ranks are GPUs: the skip flag folded into the writes (never read), whatever device the tensors
    # are on here (a CPU's step reads it instead, decision.ON_HOST)
    on_host, decision.ON_HOST = decision.ON_HOST, ()
    try:
        t0 = time.perf_counter()
        model = build_model(model_name, layers)
        mesh = mesh_for(layout, ranks)
        if layout == "ep":
            from torch.distributed.device_mesh import init_device_mesh

            torchtitan_ep(model, mesh, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
        elif layout == "ep-replicated":
            expert_parallel(model, mesh)
        else:
            shard(model, layout, mesh)
        if device != "meta":
            model.to_empty(device=device)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        # torch's AdamW (meqmuon's "adamw") has no Newton-Schulz dtype
        dtype_kw = {"ns_dtype": ns_dtype} if "ns_dtype" in meqmuon.valid_hyperparameters(optimizer) else {}
        opt = meqmuon.build_optimizer(optimizer, model, foreach=foreach, **dtype_kw,
                                      **({"ns_group": ns_group} if ns_group > 1 else {}),
                                      **({"relay_group": relay_group} if relay_group > 1 else {}),
                                      **({"overlap": overlap} if overlap is not None else {}),
                                      **({"exchange_unit": exchange_unit} if exchange_unit != "matrix" else {}))
        built = time.perf_counter() - t0
        row = {"model": model_name, "layout": layout, "ranks": ranks, "rank": rank, "device": device,
               "optimizer": optimizer, "ns_dtype": str(ns_dtype).removeprefix("torch."), "ns_group": ns_group,
               "relay_group": relay_group, "overlap": overlap, "exchange_unit": exchange_unit,
               "layers": model.config.num_hidden_layers,
               "build_s": built,
               "train_params": train_params(model)}
        engine = hasattr(opt, "_plan")  # the engine's optimizers; torch's AdamW exchanges nothing, has no NS
        row["floor"] = floor_bytes(opt, ns_dtype.itemsize) if engine else 0
        row["ns_total"], row["ns_largest"] = hidden_ns_flops(opt) if engine else (0, 0)
        meter, times = StepMeter(), [time.perf_counter()]
        try:
            opt.step()  # plans, creates state
            times.append(time.perf_counter())
            opt.step()
            times.append(time.perf_counter())
            with meter:
                opt.step()
        except Exception as exc:  # noqa: BLE001 - what failed is the result
            what = "not plannable on fake PG" if len(times) == 1 else f"step {len(times)} fails on fake PG"
            return {**row, "error": f"{what}: {_fail_reason(exc)}"}
        row.update(meter.summary(), first_step_s=times[1] - times[0], step_s=times[2] - times[1],
                   held=held_bytes(opt), adamw=adamw_bytes(model.parameters()))
        if not engine:
            row["model_error"] = f"{optimizer}: no Newton-Schulz plan"
            return row
        try:
            ranks_model = rank_model(opt, ns_dtype.itemsize)
            row["ranks_model"] = {"local": ranks_model.local, "owned": ranks_model.owned, "flops": ranks_model.flops,
                                  "rounds": ranks_model.rounds}
        except NotImplementedError as exc:
            row["model_error"] = str(exc)
        return row
    finally:
        decision.ON_HOST = on_host
        dist.destroy_process_group()


def run_one(args: argparse.Namespace) -> dict:
    """One configuration in this process, every sampled rank; adds wall time and peak RSS."""
    t0 = time.perf_counter()
    rows = [simulate(args.model, args.layout, args.ranks, r, layers=args.layers, device=args.device,
                     optimizer=args.optimizer, ns_dtype=getattr(torch, args.ns_dtype),
                     foreach=args.form == "batched", ns_group=args.ns_group, relay_group=args.relay_group,
                     overlap=OVERLAPS[args.overlap], exchange_unit=args.exchange_unit)
            for r in sample(args.sample_ranks, world_of(args.ranks))]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rows": rows, "wall_s": time.perf_counter() - t0, "rss": rss}


def sample(spec: str, world: int, busiest: dict[str, int] | None = None) -> list[int]:
    """The ranks to simulate: ``0,1,last`` style (``last`` = world - 1), deduplicated; ``busiest``: the ranks
    that :class:`rank_model.RankModel` predicts busiest (``busiest``, from a simulated rank's plan; left out
    while it is ``None``)."""
    out = []
    for x in spec.split(","):
        if x == "busiest":
            out += list((busiest or {}).values())
            continue
        r = world - 1 if x == "last" else int(x)
        if not 0 <= r < world:
            raise SystemExit(f"scale_sim.py: error: --sample-ranks: rank {r} outside 0..{world - 1}")
        out.append(r)
    return list(dict.fromkeys(out))


def _model_of(row: dict, itemsize: int) -> RankModel | None:
    m = row.get("ranks_model")
    return (RankModel(world_of(row["ranks"]), itemsize, m["local"], m["owned"], m["flops"], m.get("rounds", []))
            if m else None)


def summarise(result: dict, itemsize: int = 4) -> dict:
    """A table row from one configuration's simulated ranks: rank 0's accounting, the worst simulated rank's
    bytes against its floor and its bound, the mean over all ranks of the bound against the floor
    (:mod:`rank_model`), the busiest owner's FLOPs (measured, and predicted over all ranks), the optimizer's
    memory against AdamW's; the first error of any."""
    rows = result["rows"]
    r0 = rows[0]
    out = {k: r0[k] for k in ("model", "layout", "ranks", "layers", "device")}
    out["optimizer"] = r0.get("optimizer")
    out.update(wall_s=result["wall_s"], rss=result["rss"], sampled=[r["rank"] for r in rows])
    failed = [r for r in rows if "error" in r]
    if failed:
        return {**out, "error": failed[0]["error"] + (f" (rank {failed[0]['rank']})" if failed[0]["rank"] else "")}
    world = world_of(r0["ranks"])
    out.update({k: r0[k] for k in ("sent", "received", "floor", "calls", "peak", "first_step_s", "step_s", "held",
                                   "adamw")})
    lower = max(r0["ns_total"] / world, r0["ns_largest"])
    out["owner_load"] = max(r["flops"] for r in rows) / lower if lower else 0.0
    out["memory_vs_adamw"] = max(r["held"]["total"] / r["adamw"] for r in rows)
    worst = max(rows, key=lambda r: (max(r["sent"], r["received"]) / r["floor"] if r["floor"] else 0, -r["rank"]))
    out["worst"] = {"rank": worst["rank"], "ratio": max(worst["sent"], worst["received"]) / worst["floor"]
                    if worst["floor"] else 0.0}
    # what benchmarks/time_model.py reads: every simulated rank's counts, the plan's rounds for every rank
    out["time_inputs"] = {
        "optimizer": r0.get("optimizer"), "ns_dtype": r0.get("ns_dtype"), "train_params": r0.get("train_params"),
        "itemsize": itemsize, "calls": r0["calls"], "bytes_by_name": r0["bytes_by_name"],
        # the world's collectives apart from a block's (ns_group), by "name@group size"
        "calls_by_group": r0.get("calls_by_group", {}), "bytes_by_group": r0.get("bytes_by_group", {}),
        "ns_group": r0.get("ns_group", 1), "relay_group": r0.get("relay_group", 1),
        "overlap": r0.get("overlap"), "exchange_unit": r0.get("exchange_unit", "matrix"),
        "ranks": [{**{k: r.get(k) for k in ("rank", "sent", "received", "flops", "ops", "traffic")},
                   # the bytes of a block's collectives (ns_group: groups smaller than the world), not the exchange's
                   **{key: sum(n for size, n in r.get(by, {}).items() if size is not None and int(size) < world)
                      for key, by in (("block", "bytes_by_group_size"), ("block_received", "received_by_group_size"))}}
                  for r in rows],
        **({k: r0["ranks_model"][k] for k in ("local", "owned", "rounds")} if "ranks_model" in r0 else {})}
    model = _model_of(r0, itemsize)
    if model is None:
        out["model_error"] = r0.get("model_error", "no rank model")
        return out
    out["busiest"] = model.busiest()
    out["mean_bound"] = model.mean_bound_over_floor()
    out["model_owner_load"] = max(model.flops) / lower if lower else 0.0
    out["over_bound"] = max(max(r["sent"], r["received"]) / model.bound(r["rank"]) if model.bound(r["rank"]) else 0.0
                            for r in rows)
    out["flops_model_exact"] = all(r["flops"] == model.flops[r["rank"]] for r in rows)
    return out


def gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**28 else f"{x / 2**20:.1f} MiB"


HEADER = ("| model | layout | ranks | ranks simulated | sent / floor, rank 0 | most sent or received / floor (rank) | "
          "mean bound / floor | most sent or received / bound | collectives per step | state | held after step / "
          "state | optimizer memory / AdamW's | transient peak | first / next step s | owner load: simulated "
          "(model, all ranks) | sim wall s | sim RSS |")


def table(summaries: list[dict]) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for s in summaries:
        head = f"| {s['model']} | {s['layout']} | {s['ranks']} | {','.join(map(str, s['sampled']))} |"
        tail = f" {s['wall_s']:.0f} | {gib(s['rss'])} |"
        if "error" in s:
            lines.append(f"{head} {s['error']} |" + " |" * (HEADER.count(" | ") - 6) + tail)
            continue
        ratio = f"{s['sent'] / s['floor']:.2f}x ({gib(s['sent'])})" if s["floor"] else f"{gib(s['sent'])} (floor 0)"
        worst = f"{s['worst']['ratio']:.2f}x ({s['worst']['rank']})" if s["floor"] else "-"
        calls = ", ".join(f"{k} {v}" for k, v in sorted(s["calls"].items())) or "none"
        held = s["held"]
        beyond = (f"{held['total'] / held['state']:.2f}x (+{gib(held['other'])})" if held["state"]
                  else gib(held["other"]))
        steps = f"{s['first_step_s']:.1f} / {s['step_s']:.1f}"
        if "busiest" in s:
            mean = f"{s['mean_bound']:.2f}x" if s["floor"] else "-"
            bound = f"{s['over_bound']:.2f}x" if s["floor"] else "-"
            load = f"{s['owner_load']:.2f}x ({s['model_owner_load']:.2f}x{'' if s['flops_model_exact'] else ', off'})"
        else:
            mean = bound = "-"
            load = f"{s['owner_load']:.2f}x (no model: {s['model_error']})"
        lines.append(f"{head} {ratio} | {worst} | {mean} | {bound} | {calls} | {gib(held['state'])} | {beyond} | "
                     f"{s['memory_vs_adamw']:.2f}x | {gib(s['peak'])} | {steps} | {load} |{tail}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), help="one configuration (with --layout, --ranks)")
    parser.add_argument("--layout", choices=("fsdp2", "fsdp2-rows", "fsdp2xtp", "fsdp2xtp-dense", "ep",
                                                   "ep-replicated"))
    parser.add_argument("--ranks", help="N, or DPxTP for fsdp2xtp")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    parser.add_argument("--device", default="meta", choices=("meta", "cpu"))
    parser.add_argument("--optimizer", default="meqmuon")
    parser.add_argument("--ns-dtype", default="float32")
    parser.add_argument("--form", default="batched", choices=("batched", "per-tensor"))
    parser.add_argument("--ns-group", type=int, default=1,
                        help="the optimizer's ns_group: blocks of this many ranks may share a unit's Newton-Schulz")
    parser.add_argument("--relay-group", type=int, default=1,
                        help="the optimizer's relay_group: the exchange relayed through nodes of this many ranks")
    parser.add_argument("--overlap", default="default", choices=sorted(OVERLAPS),
                        help="the optimizer's overlap, which the plan packs shared units for (default: the engine's "
                             "off-CUDA default; the plan then packs for a pipeline, as for CUDA's overlap=True)")
    parser.add_argument("--exchange-unit", default="matrix", choices=("tensor", "matrix"),
                        help="the optimizer's exchange_unit: a stack of experts on its dimension 1 one unit, or each "
                             "expert one")
    parser.add_argument("--sample-ranks", default="0,busiest",
                        help="ranks simulated: numbers, 'last', 'busiest' (the rank model's busiest by bytes, "
                             "bytes per floor and FLOPs, read from the first rank's plan)")
    parser.add_argument("--runs", default="issue47", choices=sorted(RUNS),
                        help="the configurations without --model: issue 47's table, or issue 59's (time)")
    parser.add_argument("--time", action="store_true",
                        help="also print benchmarks/time_model.py's table of the runs (H100, its defaults)")
    parser.add_argument("--json", action="store_true", help="print the configuration's result as JSON")
    parser.add_argument("--save", help="also write every configuration's summary to this JSON file")
    return parser


def _run_rank(args: argparse.Namespace, model: str, layout: str, ranks: str, rank: int) -> dict:
    """:func:`run_one` of one rank in a process of its own (a fresh fake group and mesh)."""
    cmd = [sys.executable, __file__, "--json", "--model", model, "--layout", layout, "--ranks", ranks,
           "--device", args.device, "--optimizer", args.optimizer, "--ns-dtype", args.ns_dtype,
           "--form", args.form, "--sample-ranks", str(rank), "--ns-group", str(args.ns_group),
           "--relay-group", str(args.relay_group), "--overlap", args.overlap, "--exchange-unit", args.exchange_unit]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    if done.returncode:
        raise SystemExit(f"scale_sim.py: error: {model} {layout} {ranks} rank {rank} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_ranks(args: argparse.Namespace, model: str, layout: str, ranks: str) -> dict:
    """Every sampled rank in a process of its own; ``busiest`` ones once the first rank's plan names them.
    Their rows together, the wall times summed, the largest RSS."""
    result: dict = {"rows": [], "wall_s": 0.0, "rss": 0}
    world, itemsize = world_of(ranks), getattr(torch, args.ns_dtype).itemsize
    todo, busiest = sample(args.sample_ranks, world), None
    if not todo:
        todo = [0]
    while todo:
        one = _run_rank(args, model, layout, ranks, todo.pop(0))
        result["rows"] += one["rows"]
        result["wall_s"] += one["wall_s"]
        result["rss"] = max(result["rss"], one["rss"])
        if busiest is None and "busiest" in args.sample_ranks.split(","):
            m = _model_of(one["rows"][0], itemsize) if "error" not in one["rows"][0] else None
            busiest = m.busiest() if m else {}
            done = {r["rank"] for r in result["rows"]}
            todo = [r for r in sample(args.sample_ranks, world, busiest) if r not in done and r not in todo] + todo
    return result


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(run_one(args)))
        return 0
    runs = [(args.model, args.layout, args.ranks)] if args.model else RUNS[args.runs]
    if args.model and not (args.layout and args.ranks):
        parser.error("--model needs --layout and --ranks")
    from meqmuon.precision import detect_cpu_capability

    itemsize = getattr(torch, args.ns_dtype).itemsize
    print(f"# fake process group, CPU {detect_cpu_capability()}, torch {torch.__version__}, device {args.device}, "
          f"{args.optimizer} {args.form}, ns_dtype {args.ns_dtype}, ranks simulated {args.sample_ranks}")
    summaries = []
    for model, layout, ranks in runs:
        summaries.append(summarise(_run_ranks(args, model, layout, ranks), itemsize))
        print(table(summaries[-1:]).splitlines()[-1], flush=True)
        if args.save:
            Path(args.save).write_text(json.dumps(summaries, indent=1))
    print(table(summaries))
    if args.time:
        import time_model

        print("\n" + time_model.table(summaries, time_model.H100, time_model.Calibration.load(
            time_model.DEFAULT_CALIBRATION), 0.4, time_model.TOKENS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
