"""Newton-Schulz methods side by side: FLOPs, time paired against the quintic, spectra, distance to the
polar factor, and MeqMuon's row/column CVs after its ``post``.

Usage::

    python benchmarks/ns_methods.py                              # Llama-60M and Llama-350M hidden shapes, CPU
    python benchmarks/ns_methods.py --models llama-tiny --repeats 3   # seconds (tests/test_benchmarks.py)
    python benchmarks/ns_methods.py --device cuda --dtype bfloat16 --batched   # a lent GPU: the batched stacks

For each distinct hidden-matrix shape of the model (``benchmarks/shapes.py``) a momentum-like input is
drawn (a random matrix with a decaying spectrum, as gradients have), then every method of
``ns_method`` (``optim/newton_schulz.py``) orthogonalises it. Time: the methods alternate within every
round and each method's median is divided by the quintic's of the same rounds (ratios, robust to a
shared machine). Spectrum: largest and smallest singular value of the result; ``dist``: RMS distance to
the exact polar factor ``P Q^T`` of the input (float64 SVD); CVs: MeqMuon's row and column coefficients
of variation after its adaptive normalisation (eq. 8), the statistics the paper's Table 1 reports.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import model_shapes  # noqa: E402

from meqmuon import functional as F  # noqa: E402
from meqmuon.optim.driver import matrix_shape  # noqa: E402
from meqmuon.optim.newton_schulz import NS_METHODS  # noqa: E402


def method_flops(method: str, m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of one ``m x n`` matrix (wide orientation ``a <= b``) for ``method``."""
    a, b = min(m, n), max(m, n)
    gram_side, gram_square = 2 * a * a * b, 2 * a**3
    if method.startswith("quintic") or (method == "gram" and m == n):  # Gram falls back to the quintic on squares
        # (the "quintic+eps" forms differ only in how X is normalised first)
        return steps * (2 * gram_side + gram_square)
    if method == "cubic":  # A = X X^T and A X an iteration (c = 0: no A^2)
        return steps * 2 * gram_side
    if method == "aol":  # one Gram matrix for the scaling and the first iteration; steps - 1 iterations
        return gram_side + (steps - 1) * (gram_side + gram_square) + (steps - 2) * gram_side
    if method == "gram":
        flops, fresh = gram_side, True  # R = X X^T
        for k in range(steps):
            if k in F.GRAM_RESTARTS and k:
                flops, fresh = flops + 2 * gram_side, True  # X = Q X, R = X X^T
            flops += gram_square + (0 if fresh else gram_square)  # R^2, P Q
            if k < steps - 1 and k + 1 not in F.GRAM_RESTARTS:
                flops += 2 * gram_square  # R = P R P
            fresh = False
        return flops + gram_side  # Q X
    raise ValueError(f"no FLOP count for method {method!r}")


def momentum_like(m: int, n: int, seed: int = 0) -> torch.Tensor:
    """A random ``m x n`` matrix with singular values decaying as ``1 / (1 + i)^0.5`` (float64)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    P = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))[0]
    Q = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))[0]
    s = (1 + torch.arange(k, dtype=torch.float64)) ** -0.5
    return (P * s) @ Q.T


def quality(U: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """Spectrum of ``U``, its RMS distance to the polar factor of ``x``, MeqMuon's CVs after eq. 8."""
    U64 = U.double().cpu()
    P, _, Qh = torch.linalg.svd(x, full_matrices=False)
    s = torch.linalg.svdvals(U64)
    D, _ = F.adaptive_normalize(U64)
    cv_r, cv_c = F.row_col_cv(D)
    return {"smax": s.max().item(), "smin": s.min().item(), "dist": (U64 - P @ Qh).pow(2).mean().sqrt().item(),
            "cv_r": cv_r.item(), "cv_c": cv_c.item()}


def measure(models: list[str], methods: list[str], repeats: int, steps: int, dtype: torch.dtype,
            device: str, batched: bool, stack: int) -> list[dict]:
    rows = []
    for model in models:
        shapes = sorted({matrix_shape(s) for s in model_shapes(model)["hidden"]})
        for m, n in shapes:
            x = momentum_like(m, n)
            X = x.to(device=device, dtype=torch.float32).expand(stack, m, n).contiguous() if batched else \
                x.to(device=device, dtype=torch.float32)
            times: dict[str, list[float]] = {meth: [] for meth in methods}
            out = {}
            for r in range(repeats + 1):
                for meth in methods if r % 2 else reversed(methods):
                    fn = NS_METHODS[meth].function
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out[meth] = fn(X, steps, F.NS_COEFFICIENTS, dtype, batched=batched)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    if r:  # round 0 warms up
                        times[meth].append(time.perf_counter() - t0)
            base = statistics.median(times["quintic"])
            for meth in methods:
                U = out[meth][0] if batched else out[meth]
                ratios = [t / q for t, q in zip(times[meth], times["quintic"], strict=True)]
                rows.append({"model": model, "shape": f"{m}x{n}", "method": meth,
                             "gflop": method_flops(meth, m, n, steps) * (stack if batched else 1) / 1e9,
                             "ms": statistics.median(times[meth]) * 1e3, "ratio": statistics.median(ratios),
                             "ratio_lo": min(ratios), "ratio_hi": max(ratios), "quintic_ms": base * 1e3,
                             **quality(U, x)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | shape | method | GFLOP | ms | time / quintic (min-max) | s_max | s_min | dist to polar | "
             "CV_r | CV_c |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['shape']} | {r['method']} | {r['gflop']:.3f} | {r['ms']:.2f} | "
                     f"{r['ratio']:.2f} ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f}) | {r['smax']:.3f} | "
                     f"{r['smin']:.3f} | {r['dist']:.3f} | {r['cv_r']:.4f} | {r['cv_c']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-60m,llama-350m", type=lambda s: s.split(","))
    parser.add_argument("--methods", default=",".join(NS_METHODS), type=lambda s: s.split(","))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=F.NS_STEPS)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batched", action="store_true", help="a stack of --stack copies in one batched call")
    parser.add_argument("--stack", type=int, default=8)
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods if m not in NS_METHODS]
    if unknown or "quintic" not in args.methods:
        parser.error(f"--methods: {unknown or 'quintic is the reference and must be listed'} "
                     f"(known: {', '.join(NS_METHODS)})")
    if args.device == "cpu" and args.dtype == "float16":
        parser.error("--dtype float16 is for GPUs (never fp16 on a CPU)")
    from meqmuon.precision import detect_cpu_capability

    form = "batched" if args.batched else "per matrix"
    print(f"# ns_methods: device {args.device}, dtype {args.dtype}, CPU {detect_cpu_capability()}, "
          f"{torch.get_num_threads()} thread"
          f"{'s' * (torch.get_num_threads() != 1)}, torch {torch.__version__}, {form}")
    print(table(measure(args.models, args.methods, args.repeats, args.steps, getattr(torch, args.dtype),
                        args.device, args.batched, args.stack)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
