"""``compile=True`` warm-up at a paper model's shapes (issue 49, item 4): how long the first step takes, per graph.

Each bucket graph's first call is timed (synchronised) as it happens and printed at once, so a run cut
by ``--cap`` still says which graphs compiled and how long each took; then the first and second step's
wall time, dynamo's counters (graphs, recompiles, graph breaks) and ``compile_times()`` (time per
compile phase). The step is ``step_time.py``'s (random gradients on the model's parameter shapes).

usage: python benchmarks/gpu_diag_warmup.py --model llama-60m [--optimizer meqmuon] [--foreach auto] [--cap 60]
"""

from __future__ import annotations

import time

START = time.perf_counter()  # the cap counts from here, imports included

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import MODELS, model_shapes  # noqa: E402
from step_time import build, make_params  # noqa: E402

from meqmuon.optim import compiled  # noqa: E402
from meqmuon.precision import resolve_ns_dtype  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _summary(t0):
    from torch._dynamo.utils import compile_times, counters

    print(f"elapsed {time.perf_counter() - t0:.1f} s; graphs {len(compiled._bucket_graphs)}", flush=True)
    for k in ("stats", "recompiles", "graph_break", "frames", "unimplemented"):
        if counters.get(k):
            print(f"counters[{k}]: {dict(counters[k])}", flush=True)
    try:
        print(compile_times(repr="str", aggregate=True), flush=True)
    except Exception as e:  # the table is informative only
        print(f"compile_times: {e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-60m", choices=MODELS)
    ap.add_argument("--optimizer", default="meqmuon")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--foreach", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--cap", type=float, default=60.0, help="seconds; print what is known and exit past it")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    t0 = START

    def watchdog():
        time.sleep(max(0.0, args.cap - (time.perf_counter() - START)))
        print(f"CAP {args.cap:.0f} s reached during the first step", flush=True)
        _summary(t0)
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    shapes = model_shapes(args.model)
    params = make_params(shapes, device)
    ns_dtype = resolve_ns_dtype(None, device)
    hp = {} if args.foreach == "auto" else {"foreach": args.foreach == "on"}
    opt = build(f"{args.optimizer} (compile)", params, ns_dtype, **hp)
    original = compiled.bucket_step

    def timed(label, fn, key, *a, **static):
        before = len(compiled._bucket_graphs)
        t = time.perf_counter()
        out = original(label, fn, key, *a, **static)
        if len(compiled._bucket_graphs) > before:
            _sync(device)
            sizes = [len(x) for x in a if isinstance(x, list)]
            print(f"graph {len(compiled._bucket_graphs)}: {label} {fn.__name__} key {key[0] if key else key} "
                  f"lists {sizes}: first call {time.perf_counter() - t:.1f} s", flush=True)
        return out

    compiled.bucket_step = timed
    print(f"{args.model} {args.optimizer} compile=True foreach={args.foreach} on {device} "
          f"(torch {torch.__version__}); setup {time.perf_counter() - t0:.1f} s", flush=True)
    t = time.perf_counter()
    opt.step()
    _sync(device)
    first = time.perf_counter() - t
    t = time.perf_counter()
    opt.step()
    _sync(device)
    second = time.perf_counter() - t
    print(f"first step (warm-up) {first:.1f} s; second step {second * 1e3:.1f} ms", flush=True)
    _summary(t0)
    os._exit(0)  # the watchdog thread must not outlive the run


if __name__ == "__main__":
    main()
