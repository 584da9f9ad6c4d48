"""Newton-Schulz seconds per matrix shape and dtype on this device: the calibration table that
``benchmarks/time_model.py`` reads (issue 59).

Usage::

    python benchmarks/ns_calibrate.py --out ns_calibration.json     # a GPU: every shape below, bf16 and float32
    python benchmarks/ns_calibrate.py --shapes 64x128 --dtypes float32 --device cpu --out x.json   # seconds

The shapes are every hidden matrix the optimizer orthogonalises in the simulator's models
(``scale_sim.MODELS``: Llama-3 8B, 70B, 405B and the DeepSeek-V3-like MoE, read off the optimizer's own
matrix views, ``step_accounting.hidden_layouts``) and the paper's Llama-60M and Llama-350M (the single-GPU
steps the model is validated against), or ``--shapes``. Each is timed as an owner runs it: the GPU default's
batched quintic (``NS_METHODS["quintic"]``, 5 steps, ``batched=True``) of a stack of ``k`` random matrices,
``k`` as many as make about ``--stack-flop`` FLOPs (at most 64, at least 1, within ``--max-bytes`` of
buffers), the stack cast to the dtype inside as the optimizer's call does; one warm-up call, then the median
of ``--repeats`` calls between device syncs (one call where a single one takes over a second). Smallest first,
bf16 before float32, so that ``--budget-s`` (measured from the start) cuts the longest last; a shape that does
not fit in memory is left out with its error. Writes JSON: the device, torch, float32 matmul precision, date,
and per shape and dtype the seconds per matrix (``kind: "measured"``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: The paper's models of the single-GPU validation (hidden, ffn): their matrices' shapes.
PAPER = {"llama-60m": (512, 1376), "llama-350m": (1024, 2736)}


def model_shapes(names: list[str]) -> list[tuple[int, int]]:
    """The distinct matrix shapes the optimizer orthogonalises in ``scale_sim.MODELS`` ``names`` (built on
    ``meta``, one decoder layer of each kind) and the paper's models, wide orientation (``m <= n``)."""
    import scale_sim
    from step_accounting import hidden_layouts

    import meqmuon

    shapes = set()
    for name in names:
        if name in PAPER:
            h, f = PAPER[name]
            shapes |= {(h, h), (h, f)}
            continue
        model = scale_sim.build_model(name, layers=scale_sim.MODELS[name][1].get("first_k_dense_replace", 0) + 1)
        opt = meqmuon.build_optimizer("muon", model, ns_dtype=torch.float32)
        for _, _, layout in hidden_layouts(opt):
            shapes |= {(min(m, n), max(m, n)) for m, n in layout.shapes()}
    return sorted(shapes, key=lambda s: s[0] * s[0] * s[1])


def time_shape(m: int, n: int, dtype: torch.dtype, device: torch.device, stack_flop: float, max_bytes: float,
               repeats: int) -> dict:
    """One shape's seconds per matrix (see the module docstring)."""
    from meqmuon import functional as F
    from meqmuon.optim.newton_schulz import NS_METHODS, ns_flops

    flops = ns_flops(m, n, 5)
    # the float32 input, the cast stack and its iterate, two Gram buffers: bytes per matrix of the stack
    per = m * n * (4 + 2 * dtype.itemsize) + 2 * m * m * dtype.itemsize
    k = int(max(1, min(64, stack_flop // flops, max_bytes // per)))
    X = torch.randn(k, m, n, device=device)
    fn = NS_METHODS["quintic"].function

    def call() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(X, 5, F.NS_COEFFICIENTS, dtype, batched=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = call()  # warm-up (cuBLAS heuristics, allocator)
    times = [call() for _ in range(1 if first > 1.0 else repeats)]
    seconds = statistics.median(times) / k
    return {"m": m, "n": n, "dtype": str(dtype).removeprefix("torch."), "stack": k, "seconds": seconds,
            "tflops": flops / seconds / 1e12, "kind": "measured",
            "source": f"benchmarks/ns_calibrate.py: median of {len(times)} batched calls of {k}"}


def main(argv: list[str] | None = None) -> int:
    import scale_sim

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="llama3-8b,llama3-70b,llama3-405b,deepseek-v3,llama-60m,llama-350m",
                    help=f"of {sorted(scale_sim.MODELS) + sorted(PAPER)}")
    ap.add_argument("--shapes", default=None, help="instead: MxN,MxN,...")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stack-flop", type=float, default=2e12)
    ap.add_argument("--max-bytes", type=float, default=16e9)
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting new shapes after this long")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device(args.device)
    shapes = ([tuple(sorted(int(x) for x in s.split("x"))) for s in args.shapes.split(",")] if args.shapes
              else model_shapes(args.models.split(",")))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({args.device})"
    out = {"gpu": gpu, "torch": torch.__version__, "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "source": " ".join(sys.argv),
           "entries": [], "left_out": []}
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for m, n in shapes:
            if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
                out["left_out"].append(f"{m}x{n} {dtype}: the budget of {args.budget_s:.0f} s was spent")
                continue
            try:
                e = time_shape(m, n, dtype, device, args.stack_flop, args.max_bytes, args.repeats)
            except torch.OutOfMemoryError as exc:
                out["left_out"].append(f"{m}x{n} {dtype}: {str(exc).splitlines()[0]}")
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            out["entries"].append(e)
            print(f"{m}x{n} {e['dtype']}: {e['seconds'] * 1e3:.3f} ms a matrix ({e['stack']} stacked), "
                  f"{e['tflops']:.0f} TFLOP/s", flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")  # what is done survives a cut
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(out['entries'])} entries, {len(out['left_out'])} left out, {time.perf_counter() - t0:.0f} s: "
          f"{args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
