"""A kernel profile of one optimizer step at a paper model's shapes (issue 49, items 2 and 3): where the time goes.

Per optimizer (batched step, the CUDA default, bf16 Newton-Schulz): the median step over ``--repeats``
(CUDA events), then one step under ``torch.profiler``: the number of kernels launched, the GPU time
summed over them against the step's wall time (the gap is launch and host time), and the top kernels
by GPU time. Then, for the same shapes: the Newton-Schulz FLOP floor (``step_time.floor_work``) and the
batched Newton-Schulz of each bucket alone (``functional.orthogonalize_stack``), so the step's excess
over the floor splits into Newton-Schulz's own and the rest. Last, whether the eager step can be
captured in a CUDA graph as it is (``torch.cuda.graph``) and its replay time: what one launch per step
would give.

usage: python benchmarks/gpu_diag_profile.py --models llama-60m llama-350m [--optimizers meqmuon muon] [--top 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import MODELS, model_shapes  # noqa: E402
from step_time import build, floor_work, make_params  # noqa: E402

from meqmuon import functional as F  # noqa: E402
from meqmuon.precision import resolve_ns_dtype  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, repeats):
    """Median ms of ``fn`` over ``repeats`` calls (CUDA events on CUDA, else wall)."""
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def profile_step(fn, device, top):
    """One call of ``fn`` under the profiler: kernels launched, their summed GPU time, wall, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        fn()
        _sync(device)
        wall = (time.perf_counter() - t) * 1e3
    kernels: Counter = Counter()
    gpu_us: Counter = Counter()
    launches = 0
    for e in prof.events():
        if device.type == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
            gpu_us[e.name] += e.time_range.elapsed_us()
        elif "LaunchKernel" in e.name or "cudaMemcpyAsync" in e.name or "cudaMemsetAsync" in e.name:
            launches += 1
    total = sum(gpu_us.values()) / 1e3
    print(f"  profiled step: wall {wall:.2f} ms (under the profiler), {sum(kernels.values())} GPU kernels/copies, "
          f"{launches} launch calls, GPU time summed {total:.2f} ms ({total / wall:.0%} of wall)", flush=True)
    for name, us in gpu_us.most_common(top):
        print(f"    {us / 1e3:8.3f} ms  x{kernels[name]:<4} {name[:150]}", flush=True)
    by_family: Counter = Counter()
    for name, us in gpu_us.items():
        low = name.lower()
        fam = ("gemm/matmul" if any(s in low for s in ("gemm", "cutlass", "sm90", "xmma", "nvjet", "cublas")) else
               "foreach" if "foreach" in low or "multi_tensor" in low else
               "reduce" if "reduce" in low or "norm" in low else
               "copy/cat" if any(s in low for s in ("copy", "cat", "memcpy", "memset")) else "elementwise/other")
        by_family[fam] += us
    print("  by family: " + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in by_family.most_common()), flush=True)


def try_graph(opt, device, repeats):
    """Capture ``opt.step()`` in a CUDA graph as it is; replay time, or why it cannot be captured."""
    if device.type != "cuda":
        print("  CUDA graph: not on CUDA", flush=True)
        return
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            opt.step()
    except Exception as e:
        print(f"  CUDA graph of the eager step: capture FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
              flush=True)
        torch.cuda.synchronize()
        return
    ms = time_ms(g.replay, device, repeats)
    print(f"  CUDA graph of the eager step (values baked in; timing only): replay {ms:.2f} ms", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-60m"], choices=MODELS)
    ap.add_argument("--optimizers", nargs="+", default=["meqmuon", "muon"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph capture attempt")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    for model in args.models:
        run_model(model, args, device)


def run_model(model, args, device):
    """:func:`main`'s work for one model."""
    ns_dtype = resolve_ns_dtype(None, device)
    shapes = model_shapes(model)
    print(f"## {model} on {torch.cuda.get_device_name() if device.type == 'cuda' else device}, torch "
          f"{torch.__version__}, NS {ns_dtype}", flush=True)
    for name in args.optimizers:
        params = make_params(shapes, device)
        opt = build(name, params, ns_dtype)
        for _ in range(3):
            opt.step()
        ms = time_ms(opt.step, device, args.repeats)
        print(f"{name}: median step {ms:.2f} ms ({args.repeats} steps)", flush=True)
        profile_step(opt.step, device, args.top)
        if not args.no_graph:
            try_graph(opt, device, args.repeats)
        del opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    calls, flops = floor_work(shapes["hidden"], device, ns_dtype)
    for fn in calls.values():
        fn()
    med = {k: time_ms(fn, device, args.repeats) for k, fn in calls.items()}
    buckets = sorted({b for b, _ in calls})
    floor = F.NS_STEPS * sum(min(med[(b, "bmm")], med[(b, "mm")]) for b in buckets)
    print(f"NS FLOP floor {floor:.2f} ms ({flops / 1e9:.1f} GFLOP, {flops / floor / 1e9:.0f} GFLOP/s)", flush=True)
    ns_total = 0.0
    for (m, n), k in Counter((s[0], s[1]) for s in shapes["hidden"]).items():
        X = torch.randn(k, m, n, device=device, dtype=ns_dtype)
        W = torch.empty_like(X)
        ms = time_ms(lambda X=X, W=W: F.orthogonalize_stack(W.copy_(X), inplace=True), device, args.repeats)
        one = 5 * min(med[((m, n), "bmm")], med[((m, n), "mm")])
        ns_total += ms
        print(f"  bucket {k} x {m}x{n}: orthogonalize_stack {ms:.2f} ms (its floor {one:.2f} ms, {ms / one:.2f}x)",
              flush=True)
    print(f"  all buckets' Newton-Schulz alone {ns_total:.2f} ms = {ns_total / floor:.2f}x the floor", flush=True)


if __name__ == "__main__":
    main()
