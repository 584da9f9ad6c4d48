"""Optimizer step time on the parameter shapes of a paper model (random gradients), plus the NS FLOP floor.

Usage (CPU here; any device with ``--device``)::

    python benchmarks/step_time.py --model llama-60m --threads 2 --repeats 5

All optimizers are timed in one run, interleaved round-robin (the machine is shared and noisy), and
reported as ratios. The FLOP floor is the Newton-Schulz FLOP count divided by the best measured
matmul rate *on the same shapes*, in the NS dtype the optimizers use (the three matmuls of one NS
iteration, batched or per matrix, whichever is faster, timed in the same round-robin as the steps):
the time NS would take if nothing but its matmuls ran, at the rate this machine achieves.

The NS dtype is ``--ns-dtype`` (default ``auto``: :func:`meqmuon.precision.resolve_ns_dtype`, bf16
where the device runs it natively, float32 elsewhere). ``torch.optim.Muon`` hard-codes bf16; when the
NS dtype is not bf16 the reference runs torch's own Newton-Schulz code with the cast changed to that
dtype (:func:`torch_ns_in`), since in bf16 on an AVX2-only CPU one Llama-60M step would take minutes.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import MODELS, model_shapes  # noqa: E402

import meqmuon  # noqa: E402
from meqmuon import orthogonalization  # noqa: E402
from meqmuon.functional import NS_STEPS  # noqa: E402
from meqmuon.optim.newton_schulz import ns_flops  # noqa: E402
from meqmuon.precision import detect_cpu_capability, resolve_ns_dtype  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_params(shapes, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {
        k: [nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device, dtype)) for s in v] for k, v in shapes.items()
    }
    for ps in params.values():
        for p in ps:
            p.grad = torch.randn_like(p)
    return params


def clone_params(params):
    """A copy of :func:`make_params`' result (parameters and gradients), made on their device: at Llama-350M
    shapes drawing the values again on the CPU took seconds per optimizer."""
    out = {k: [nn.Parameter(p.detach().clone()) for p in ps] for k, ps in params.items()}
    for ps, qs in zip(params.values(), out.values(), strict=True):
        for p, q in zip(ps, qs, strict=True):
            q.grad = p.grad.clone()
    return out


def groups_of(params):
    return [{"params": ps, "kind": k, "names": [f"{k}.{i}" for i in range(len(ps))]} for k, ps in params.items() if ps]


def torch_ns_in(dtype):
    """``torch.optim._muon._zeropower_via_newtonschulz`` (torch 2.13) with ``grad.bfloat16()`` replaced
    by ``grad.to(dtype)``; otherwise the same code, line for line."""

    def zeropower(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        ortho_grad = grad.to(dtype)
        if grad.size(0) > grad.size(1):
            ortho_grad = ortho_grad.T
        ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
        for _ in range(ns_steps):
            gram_matrix = ortho_grad @ ortho_grad.T
            gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
            ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
        if grad.size(0) > grad.size(1):
            ortho_grad = ortho_grad.T
        return ortho_grad

    return zeropower


class TorchMuonAdamW:
    """``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`` on hidden matrices + ``torch.optim.AdamW`` on the rest.

    ``ns_dtype`` other than bf16: torch's Newton-Schulz runs in that dtype (:func:`torch_ns_in`)."""

    def __init__(self, params, lr=1e-3, ns_dtype=torch.bfloat16):
        hidden = params["hidden"]
        rest = [p for k, ps in params.items() if k != "hidden" for p in ps]
        self.muon = torch.optim.Muon(hidden, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
        self.ns = None if ns_dtype == torch.bfloat16 else torch_ns_in(ns_dtype)

    def step(self):
        if self.ns is None:
            self.muon.step()
        else:
            import torch.optim._muon as torch_muon

            original = torch_muon._zeropower_via_newtonschulz
            torch_muon._zeropower_via_newtonschulz = self.ns
            try:
                self.muon.step()
            finally:
                torch_muon._zeropower_via_newtonschulz = original
        self.adamw.step()


def build(name, params, ns_dtype=torch.bfloat16, **hparams):
    """``hparams``: extra optimizer keywords (``ns_method``, ``ns_steps``, ``ns_coefficients``) of a
    ``--ns-variants`` row."""
    all_params = [p for ps in params.values() for p in ps]
    if name == "torch Muon+AdamW":
        return TorchMuonAdamW(params, ns_dtype=ns_dtype)
    if name == "torch AdamW":
        return torch.optim.AdamW(all_params, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    base, flags = split_name(name)
    kw = {k: True for k, flag in (("compile", "compile"), ("cuda_graph", "cuda graph")) if flag in flags}
    if "unguarded" in flags:  # the step without its non-finite guard (issue 56): nonfinite="propagate"
        kw["nonfinite"] = "propagate"
    opt = meqmuon.build_optimizer(base, groups_of(params), lr=1e-3, ns_dtype=ns_dtype, **kw, **hparams)
    switches = [SWITCHES[f] for f in flags if f in SWITCHES]
    return Switched(opt, switches) if switches else opt


def split_name(name):
    """``"meqmuon (compile, cuda graph)"`` -> ``("meqmuon", ("compile", "cuda graph"))``."""
    base, _, flag = name.partition(" (")
    return base, tuple(f.strip() for f in flag.rstrip(")").split(",")) if flag else ()


def _symmetric_ns(on: bool, default=orthogonalization.SYMMETRIC_STACK_MIN) -> None:
    """The batched Newton-Schulz's block-symmetric products from k = 512 (every bucket of the Llama models)."""
    orthogonalization.SYMMETRIC_STACK_MIN = 512 if on else default


#: Row flags that switch a module-level setting on around each step of their optimizer (an A/B in one run):
#: ``name -> function(on: bool)``.
SWITCHES: dict[str, Callable[[bool], None]] = {"symmetric-ns": _symmetric_ns}


class Switched:
    """An optimizer whose ``step`` runs with the ``switches`` on (and off again after)."""

    def __init__(self, opt, switches):
        self.opt, self.switches = opt, switches

    def step(self):
        for s in self.switches:
            s(True)
        try:
            self.opt.step()
        finally:
            for s in self.switches:
                s(False)


def parse_variant(text):
    """``METHOD``, ``METHOD:STEPS`` or ``METHOD:STEPS:COEFFICIENTS`` (``--ns-variants``; COEFFICIENTS a
    named schedule such as ``polar_express``) -> ``(row name, optimizer keywords)``."""
    method, _, rest = text.partition(":")
    steps, _, coefficients = rest.partition(":")
    hp = {"ns_method": method, **({"ns_steps": int(steps)} if steps else {}),
          **({"ns_coefficients": coefficients} if coefficients else {})}
    detail = "".join(f", {x}" for x in (f"{steps} steps" if steps else "", coefficients) if x)
    return f"meqmuon ({method}{detail})", hp


def time_call(fn, device, repeats, clock=time.perf_counter):
    """Seconds per call of ``fn``; ``clock=time.process_time`` (``--clock cpu``) counts the process's CPU
    time, which other jobs on a shared CPU disturb far less than wall time (as ``step_ab.py``)."""
    out = []
    for _ in range(repeats):
        _sync(device)
        t = clock()
        fn()
        _sync(device)
        out.append(clock() - t)
    return out


def floor_work(hidden_shapes, device, dtype=torch.bfloat16):
    """The matmuls of one Newton-Schulz iteration of every hidden matrix, as timeable calls, and the NS FLOPs.

    Per shape bucket two calls do the bucket's three matmuls (``XX^T``, ``AA``, ``AX``): one batched
    ``bmm`` per bucket, and one ``mm`` per matrix. ``main`` times both in the same round-robin as
    the optimizers and takes the faster per bucket (on CPU ``mm`` usually wins, on GPU ``bmm``
    may), so the floor is as low as this machine allows and sees the same load as the steps. Outputs
    go into preallocated tensors (``out=``), as in the optimizer: fresh outputs page-fault on CPU
    and inflated the floor by up to ~15% on the SmolLM2-135M shapes. The FLOPs are the plain
    iteration's (``ns_flops``); a step that computes the symmetric products block-wise
    (``functional.SYMMETRIC_MIN``) does fewer, so it can beat this floor.

    ``dtype`` is the NS dtype the optimizers use (the floor is at that dtype's matmul rate).

    Returns:
        ``(calls, flops)``: ``calls[(bucket, "bmm" | "mm")]`` runs one iteration's matmuls.
    """
    calls, flops = {}, 0
    for (m, n), k in Counter((s[0], s[1]) for s in hidden_shapes).items():
        a, b = min(m, n), max(m, n)
        X = torch.randn(k, a, b, device=device, dtype=dtype)
        A = torch.randn(k, a, a, device=device, dtype=dtype)
        OA, OX = torch.empty_like(A), torch.empty_like(X)
        Xc, Ac, OAc, OXc = (list(t.unbind(0)) for t in (X, A, OA, OX))  # contiguous matrices

        def batched(X=X, A=A, OA=OA, OX=OX):
            torch.bmm(X, X.mT, out=OA), torch.bmm(A, A, out=OA), torch.bmm(A, X, out=OX)

        def single(Xc=Xc, Ac=Ac, OAc=OAc, OXc=OXc):
            for x, y, oa, ox in zip(Xc, Ac, OAc, OXc, strict=True):
                torch.mm(x, x.T, out=oa), torch.mm(y, y, out=oa), torch.mm(y, x, out=ox)

        calls[((m, n), "bmm")], calls[((m, n), "mm")] = batched, single
        flops += k * ns_flops(m, n, NS_STEPS)
    return calls, flops


ALL_OPTIMIZERS = ("meqmuon", "muon", "normuon", "torch Muon+AdamW", "torch AdamW")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-60m", choices=MODELS)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true",
                    help="also time MeqMuon and Muon with compile=True (a pair: MeqMuon / Muon compiled)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time each of meqmuon, muon, normuon chosen with cuda_graph=True (and the compile=True "
                    "rows with it, with --compile)")
    ap.add_argument("--unguarded", action="store_true",
                    help="also time meqmuon, muon and normuon with nonfinite='propagate' (the step without its "
                    "non-finite guard), an A/B in the same rounds")
    ap.add_argument("--switches", nargs="+", default=[], choices=sorted(SWITCHES),
                    help="also time meqmuon and muon with each of these settings on (an A/B in the same rounds)")
    ap.add_argument("--ns-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="Newton-Schulz dtype of every optimizer and of the floor (auto: bf16 where native)")
    ap.add_argument(
        "--optimizers", nargs="+", choices=ALL_OPTIMIZERS, default=list(ALL_OPTIMIZERS),
        help="which optimizers to time (each holds its own parameters, gradients and state: for the "
        "larger models pick a few to fit in memory); torch Muon+AdamW is always timed, as the reference",
    )
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="wall (default) or the process's CPU time (robust to other jobs; CPU with --threads 1)")
    ap.add_argument(
        "--ns-variants", nargs="+", default=[], metavar="METHOD[:STEPS[:COEFFICIENTS]]",
        help="also time MeqMuon with these Newton-Schulz methods (ns_method, optionally ns_steps and a named "
        "ns_coefficients schedule), one row "
        "each, e.g. quintic gram aol quintic:4 quintic:4:polar_express; the FLOP floor stays the 5-iteration quintic's",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    ns_dtype = resolve_ns_dtype(None if args.ns_dtype == "auto" else getattr(torch, args.ns_dtype), device)
    ns_name = str(ns_dtype).removeprefix("torch.")
    shapes = model_shapes(args.model)
    names = [n for n in ALL_OPTIMIZERS if n in args.optimizers or n == "torch Muon+AdamW"]
    compiled = [n for n in ("meqmuon", "muon") if args.compile and n in names]
    names += [f"{n} (compile)" for n in compiled]
    if args.cuda_graph:
        names += [f"{n} (cuda graph)" for n in ("meqmuon", "muon", "normuon") if n in names]
        names += [f"{n} (compile, cuda graph)" for n in compiled]
    names += [f"{n} ({s})" for s in args.switches for n in ("meqmuon", "muon") if n in names]
    if args.unguarded:
        names += [f"{n} (unguarded)" for n in ("meqmuon", "muon", "normuon") if n in names]
    variants = dict(parse_variant(v) for v in args.ns_variants)
    names += [n for n in variants if n not in names]
    opts = {}
    params = {}
    first = None
    for name in list(names):
        params[name] = make_params(shapes, device) if first is None else clone_params(first)
        first = first or params[name]
        try:
            opts[name] = build("meqmuon" if name in variants else name, params[name], ns_dtype,
                               **variants.get(name, {}))
            for _ in range(args.warmup):
                opts[name].step()
        except Exception as e:  # an opt-in row (cuda graph, a switch) that fails is named, the others are timed
            if name == "torch Muon+AdamW":
                raise
            print(f"- {name}: left out, {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            names.remove(name)
            opts.pop(name, None)
            del params[name]
    floor_calls, flops = floor_work(shapes["hidden"], device, ns_dtype)
    for fn in floor_calls.values():
        fn()
    times = {n: [] for n in [*names, *floor_calls]}
    for _ in range(args.repeats):  # round-robin: load changes hit all optimizers and the floor alike
        for name in names:
            times[name] += time_call(opts[name].step, device, 1, clock)
        for key, fn in floor_calls.items():
            times[key] += time_call(fn, device, 1, clock)
    med = {n: statistics.median(t) for n, t in times.items()}
    buckets = {bucket for bucket, _ in floor_calls}
    floor = NS_STEPS * sum(min(med[(bucket, "bmm")], med[(bucket, "mm")]) for bucket in buckets)
    ref = med["torch Muon+AdamW"]
    # Paired ratios: each round's step over the same round's reference (or floor), timed seconds
    # apart, so a slow phase of the host slows both sides of the ratio. The median and range over
    # rounds say how firmly a ratio holds on a noisy machine; the ratio of medians can mix phases.
    variant = {bucket: min(("bmm", "mm"), key=lambda v, b=bucket: med[(b, v)]) for bucket in buckets}
    round_floor = [
        NS_STEPS * sum(times[(bucket, variant[bucket])][r] for bucket in buckets) for r in range(args.repeats)
    ]

    def paired(name, against):
        ratios = sorted(t / a for t, a in zip(times[name], against, strict=True))
        return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"

    n_params = sum(torch.Size(s).numel() for v in shapes.values() for s in v)
    lines = [
        f"### {args.model} optimizer step ({n_params / 1e6:.2f}M parameters, fp32 params, {ns_name} NS)",
        "",
        f"- date {date.today()}, machine: {platform.processor() or platform.machine()}, CPU capability "
        f"{detect_cpu_capability()}, {torch.get_num_threads()} thread"
        f"{'s' * (torch.get_num_threads() != 1)}, torch {torch.__version__}, device {device}",
        f"- clock: {'process CPU time' if args.clock == 'cpu' else 'wall'} (--clock {args.clock}); "
        f"NS dtype {ns_name} (--ns-dtype {args.ns_dtype})"
        + ("" if ns_dtype == torch.bfloat16 else "; torch Muon's NS run in this dtype (torch hard-codes bf16)"),
        f"- command: `python benchmarks/step_time.py {shlex.join(argv if argv is not None else sys.argv[1:])}`",
        f"- Newton-Schulz FLOPs per step: {flops / 1e9:.1f} GFLOP; "
        f"best measured {ns_name} matmul rate on these shapes: "
        f"{flops / floor / 1e9:.0f} GFLOP/s; FLOP floor {floor * 1e3:.0f} ms",
        "",
        "| optimizer | median step (ms) | / torch Muon+AdamW | / FLOP floor | NS rate achieved "
        f"| per round / torch Muon+AdamW, median (range of {args.repeats}) | per round / floor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        has_ns = n not in ("torch AdamW",)
        lines.append(
            f"| {n} | {med[n] * 1e3:.2f} | {med[n] / ref:.2f} | {med[n] / floor:.2f} | "
            + (f"{floor / med[n]:.0%}" if has_ns else "-")
            + f" | {paired(n, times['torch Muon+AdamW'])} | {paired(n, round_floor)} |"
        )
    # MeqMuon against Muon with the same flags, per round (issue 49's targets: <= 1.05x at Llama-350M, 1.1x at 60M)
    for n in names:
        base, flags = split_name(n)
        twin = "muon" + (f" ({', '.join(flags)})" if flags else "")
        if base == "meqmuon" and twin in times and n not in variants:
            lines.append(f"- {n} / {twin}, per round: {paired(n, times[twin])}")
    # The guard's cost (issue 56's target: unchanged within noise): each default step over its unguarded twin's
    # step of the same round.
    for n in names:
        if f"{n} (unguarded)" in times:
            lines.append(f"- {n} / {n} (unguarded), per round: {paired(n, times[f'{n} (unguarded)'])}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
