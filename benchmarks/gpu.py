"""GPU training-step benchmark: tokens/s, MFU and the optimizer's share of step time (paper models, bf16).

Usage (one GPU)::

    python benchmarks/gpu.py --optimizer meqmuon --steps 30            # Llama-350M, bf16 autocast, torch.compile
    python benchmarks/gpu.py --optimizer meqmuon --opt-compile        # also MeqMuon's compile=True kernels
    python benchmarks/gpu.py --optimizer meqmuon --ns-per-matrix      # NS matrix by matrix, not batched by shape
    python benchmarks/gpu.py --optimizer meqmuon --foreach off        # the per-tensor step (default on CUDA: batched)
    python benchmarks/gpu.py --optimizer meqmuon --cuda-graph         # the step captured in a CUDA graph
    python benchmarks/gpu.py --tiny --device cpu --steps 3            # CPU smoke check of the script itself

Model: ``--model``, a registry entry of ``meqmuon.train.models`` (default the paper's Llama-350M,
GaLore ``llama_350m.json``: 24 layers, hidden 1024, ffn 2736, 16 heads, vocab 32000, untied
embeddings; ``--model llama-60m`` for the horizon comparison's budget). Parameters are fp32,
forward/backward run under bf16 autocast and the model is ``torch.compile``-d. Data: random
tokens (throughput does not depend on them).

Reported (medians over the timed steps, after ``--warmup`` steps):
- tokens/s = batch * seq / step time;
- MFU = 6 * N_params_nonembedding-plus-head * tokens/s + attention FLOPs, over ``--peak-tflops``
  (default 989 = H100 SXM dense bf16; pass your GPU's number);
- optimizer share = optimizer step time / full step time, with CUDA events around ``opt.step()``.

Results (an H200, 2026-11-26) are in docs/benchmarks.md, GPU; benchmarks/gpu_all.sh runs this with the other
GPU checks in one call.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

import meqmuon
from meqmuon.precision import resolve_precision


def build(name: str, device: torch.device):
    """The registry's model (``meqmuon.train.models``: the paper's configs, SDPA attention), fp32."""
    from meqmuon.train.models import build_config, build_model

    return build_model(name, device=device, seed=0), build_config(name)


def flops_per_token(model, cfg, seq: int) -> float:
    """6 N (matmul weights: every >=2-D parameter except the input embedding) + attention scores/values."""
    n = sum(p.numel() for name, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in name)
    attn = 6 * 2 * cfg.num_hidden_layers * cfg.hidden_size * seq  # QK^T and AV, causal not discounted
    return 6 * n + attn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--optimizer", default="meqmuon", help="meqmuon, muon, normuon, adamw, ...")
    ap.add_argument("--opt-compile", action="store_true", help="MeqMuon compile=True")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="cuda_graph=True: the step captured in a CUDA graph (gradients kept in place: "
                    "zero_grad(set_to_none=False))")
    ap.add_argument(
        "--ns-per-matrix", action="store_true",
        help="orthogonalise matrix by matrix (the CPU path) instead of one batched call per shape bucket",
    )
    ap.add_argument("--foreach", choices=["auto", "on", "off"], default="auto",
                    help="the optimizer's foreach: auto (batched on CUDA), on (batched), off (per-tensor step)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--no-compile", action="store_true", help="do not torch.compile the model")
    ap.add_argument("--model", default="llama-350m", help="registry name (llama-60m, llama-350m, ...)")
    ap.add_argument("--tiny", action="store_true", help="llama-tiny and a tiny batch: a CPU smoke check")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.tiny:
        args.model, args.batch, args.seq = "llama-tiny", 2, 32
    torch.manual_seed(0)
    model, cfg = build(args.model, device)
    kw = {"compile": True} if args.opt_compile else {}
    if args.cuda_graph:
        kw["cuda_graph"] = True
    if args.optimizer != "adamw" or args.foreach != "auto":
        kw["foreach"] = {"auto": None, "on": True, "off": False}[args.foreach]
    if args.ns_per_matrix:
        from meqmuon.optim import newton_schulz

        newton_schulz.BATCHED_NS_DEVICES = frozenset()
    opt = meqmuon.build_optimizer(args.optimizer, model, lr=args.lr, **kw)
    fwd = model if args.no_compile else torch.compile(model)
    # bf16 autocast where the device runs bf16 natively (any GPU this is meant for), else fp32: the
    # CPU smoke run on an AVX2-only CPU would otherwise run bf16 matmuls ~170x slower than fp32.
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if resolve_precision("auto", device) == "bf16"
           else contextlib.nullcontext())
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    step_t, opt_t = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
        sync()
        t0 = time.perf_counter()
        with amp:
            logits = fwd(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        if cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        t1 = time.perf_counter()
        opt.step()
        if cuda:
            ev1.record()
        opt.zero_grad(set_to_none=not args.cuda_graph)
        sync()
        t2 = time.perf_counter()
        if step >= args.warmup:
            step_t.append(t2 - t0)
            opt_t.append(ev0.elapsed_time(ev1) / 1e3 if cuda else t2 - t1)
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    st, ot = statistics.median(step_t), statistics.median(opt_t)
    tok_s = args.batch * args.seq / st
    mfu = flops_per_token(model, cfg, args.seq) * tok_s / (args.peak_tflops * 1e12)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"| {args.model} | {args.optimizer}{' (compile)' if args.opt_compile else ''}"
        f"{f' (cuda graph, {opt._graphed.captures} captures)' if args.cuda_graph else ''}"
        f"{' (NS per matrix)' if args.ns_per_matrix else ''} foreach={args.foreach} | "
        f"{name} | {args.batch}x{args.seq} | {st * 1e3:.1f} ms | {tok_s:,.0f} tok/s | MFU {mfu:.1%} | "
        f"optimizer {ot * 1e3:.1f} ms ({ot / st:.0%}) | loss {loss.item():.3f} |"
    )


if __name__ == "__main__":
    main()
