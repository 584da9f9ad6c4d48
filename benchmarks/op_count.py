"""Dispatched aten ops per optimizer step: the CPU proxy for GPU kernel launches.

Usage::

    python benchmarks/op_count.py --model llama-60m          # table for every optimizer, both paths
    python benchmarks/op_count.py --model llama-350m --depth 3

An optimizer step on a GPU is launch-bound for small and mid-sized models (each launch costs
~5-10 us before any FLOP), so the number of kernels per step decides its speed there. A
``TorchDispatchMode`` sees every aten op a step dispatches; counting the non-view ones predicted the
H100 launch counts of our step within 10 % (603 against 542 for Muon, 5,604 against 5,647 for
MeqMuon). The step runs on the ``meta`` device: shapes and dtypes are real (the paper
model's, from ``benchmarks/shapes.py``), no memory is allocated and nothing is computed, so
Llama-350M's step is counted in a second on any machine. Counted: the second step (the first also
creates state and workspaces), with bf16 Newton-Schulz as on a bf16 GPU. ``--depth 3`` repeats
every per-layer tensor three times, the check that the batched step's kernel count does not grow
with depth.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import MODELS, model_shapes  # noqa: E402
from step_accounting import launches, op_traffic  # noqa: E402

import meqmuon  # noqa: E402
from meqmuon.optim.cuda_graph import GraphedStep  # noqa: E402

#: The optimizers of the comparison that run our engine (``adamw`` is torch's own).
OPTIMIZERS = [n for n in meqmuon.OPTIMIZERS if n != "adamw"]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, views and allocations excluded (they launch no kernel: the
    step's workspaces are allocated in every step and freed at its end)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches(func):
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())



class TrafficCounter(OpCounter):
    """:class:`OpCounter` plus the bytes each non-matmul op moves through memory (``step_accounting.op_traffic``:
    every tensor argument read once, the result written once). The step's memory-bound work, which the op
    count does not see: at Llama-350M shapes on an H100 (docs/benchmarks.md, GPU) MeqMuon's 3.7 GB over Muon's
    batched step came to 2.2 ms of its 1.08x."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        moved = op_traffic(func, args, kwargs, out)
        if moved:
            self.bytes[func.overloadpacket.__name__] += moved
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def deepen(shapes: dict[str, list[tuple[int, ...]]], depth: int) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of a model ``depth`` times as deep with the same widths: per-layer tensors (hidden
    matrices and vectors) repeated, embedding and head once."""
    return {k: (v * depth if k in ("hidden", "vector") else list(v)) for k, v in shapes.items()}


def mixtral_shapes(experts: int, layers: int = 2, d: int = 512, inner: int = 1376,
                   vocab: int = 32000) -> tuple[dict[str, list[tuple[int, ...]]], dict[str, list]]:
    """Shapes of a Mixtral-like model (GQA attention, a router, ``experts`` experts stored as
    transformers 5 does, ``(E, 2I, d)`` and ``(E, d, I)``) and its hidden tensors' views and splits."""
    hidden: list[tuple[int, ...]] = []
    for _ in range(layers):
        hidden += [(d, d), (d // 4, d), (d // 4, d), (d, d), (experts, d), (experts, 2 * inner, d), (experts, d, inner)]
    views = ["stacked" if len(s) == 3 else "matrix" for s in hidden]
    splits = [(inner, inner) if len(s) == 3 and s[1] == 2 * inner else None for s in hidden]
    shapes = {"hidden": hidden, "embedding": [(vocab, d)], "head": [(vocab, d)], "vector": [(d,)] * (2 * layers + 1)}
    return shapes, {"views": views, "splits": splits}


def count_step_ops(name: str, shapes: dict[str, list[tuple[int, ...]]], foreach: bool,
                   hidden_views: dict[str, list] | None = None, counter: type[OpCounter] = OpCounter,
                   graph_body: bool = False, **hparams) -> OpCounter:
    """Ops dispatched by the second ``step()`` of optimizer ``name`` over meta tensors of ``shapes``;
    ``hidden_views`` (``views`` and ``splits`` lists) declares the hidden tensors' matrix views; ``counter``
    what counts them (:class:`TrafficCounter`: bytes too); ``graph_body``: the body ``cuda_graph=True``
    captures (hyperparameters as device scalars), run without a graph."""
    groups = []
    for kind, kind_shapes in shapes.items():
        params = [nn.Parameter(torch.empty(s, device="meta")) for s in kind_shapes]
        for p in params:
            p.grad = torch.empty_like(p)
        if params:
            groups.append({"params": params, "kind": kind, **(hidden_views or {} if kind == "hidden" else {})})
    if "ns_dtype" in meqmuon.valid_hyperparameters(name):
        # What ns_dtype=None resolves to on a bf16-capable GPU (meqmuon.precision); on `meta` it
        # would resolve to float32 and drop the casts a GPU step makes.
        hparams.setdefault("ns_dtype", torch.bfloat16)
    opt = meqmuon.build_optimizer(name, groups, lr=1e-3, foreach=foreach, **hparams)
    if graph_body:
        opt._graphed = GraphedStep(capture=False)
    opt.step()
    with counter() as counted:
        opt.step()
    return counted


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-60m", choices=MODELS)
    ap.add_argument("--depth", type=int, default=3, help="also count a model this many times as deep")
    ap.add_argument("--top", type=int, default=0, help="list the N most frequent ops of each batched step")
    ap.add_argument("--bytes", action="store_true",
                    help="instead: the bytes the batched step and cuda_graph's body move through memory (matmuls out)")
    args = ap.parse_args(argv)
    if args.bytes:
        print_traffic(args.model, args.top)
        return
    shapes = model_shapes(args.model)
    deep = deepen(shapes, args.depth)
    print(f"# dispatched non-view aten ops per optimizer step, {args.model} shapes (meta device)\n")
    print(f"| optimizer | per-tensor (foreach=False) | batched (foreach=True) | batched, {args.depth}x deep "
          "| deep / original |")
    print("|---|---:|---:|---:|---:|")
    counts = {}
    for name in OPTIMIZERS:
        per_tensor = count_step_ops(name, shapes, foreach=False).total
        batched = count_step_ops(name, shapes, foreach=True)
        deeper = count_step_ops(name, deep, foreach=True).total
        counts[name] = batched
        print(f"| {name} | {per_tensor:,} | {batched.total:,} | {deeper:,} | {deeper / batched.total:.2f} |")
    print(f"\nMeqMuon / Muon, batched: {counts['meqmuon'].total / counts['muon'].total:.2f}")
    print("\n# batched ops per step, Mixtral-like model (2 layers, experts viewed stacked, gate/up split)\n")
    print("| optimizer | 4 experts | 16 experts | 16 / 4 |\n|---|---:|---:|---:|")
    for name in ("meqmuon", "muon", "normuon"):
        four, sixteen = (count_step_ops(name, shapes, True, views).total
                         for shapes, views in (mixtral_shapes(4), mixtral_shapes(16)))
        print(f"| {name} | {four:,} | {sixteen:,} | {sixteen / four:.2f} |")
    if args.top:
        for name, c in counts.items():
            print(f"\n{name}: " + ", ".join(f"{op} {k}" for op, k in c.ops.most_common(args.top)))


def print_traffic(model: str, top: int = 0) -> None:
    """``--bytes``: per optimizer the memory traffic of the batched step and of the graph's body."""
    shapes = model_shapes(model)
    print(f"# bytes moved through memory per batched step, {model} shapes (meta device, bf16 Newton-Schulz; "
          "matmuls left out)\n")
    print("| optimizer | eager batched (GB) | ops | cuda_graph body (GB) | ops |\n|---|---:|---:|---:|---:|")
    counted = {}
    for name in ("muon", "normuon", "meqmuon"):
        eager, body = (count_step_ops(name, shapes, True, counter=TrafficCounter, graph_body=g) for g in (False, True))
        counted[name] = eager
        print(f"| {name} | {eager.total_bytes / 1e9:.2f} | {eager.total} | {body.total_bytes / 1e9:.2f} "
              f"| {body.total} |")
    if top:
        for name, c in counted.items():
            print(f"\n{name}: " + ", ".join(f"{op} {b / 1e9:.2f} GB" for op, b in c.bytes.most_common(top)))


if __name__ == "__main__":
    main()
