"""Where ``compile=True`` and the eager step part on CUDA (issue 49, item 1): a diagnosis, not a test.

NorMuon's compiled CUDA step differed from its eager one by 8.5e-5 (float64, 5 steps, TinyNet; an H200,
torch 2.11), while Muon and MeqMuon agreed to 1e-10 and the CPU inductor agrees for all three. What
NorMuon's graph has that Muon's has not: a per-row state ``v`` (a graph input) read, updated
``v <- lerp(v, mean_j O_ij^2, 1 - beta2)``, read again broadcast over each row (``O / sqrt(v)``) and
written back into the input by ``torch._foreach_copy_`` in the middle of the graph (inductor lowers an
in-place foreach op with ``mutate_to(..., unsafe_alias=True)``: the new value's buffer *is* the input's
storage, and CUDA groups foreach ops into kernels of their own).

Each case runs ``--steps`` teacher-forced steps on a few hidden matrices (float64 Newton-Schulz): the same
random gradients go to an eager and a compiled optimizer, every parameter and state tensor is compared
after each step, then the compiled copy is reset to the eager one, so each number is one step's error.
Variants change one thing each: the inductor options, the backend (``aot_eager``: no inductor), the
state write-back (out of the graph; per-tensor ``copy_`` at the graph's end), the form (batched), and
Muon and MeqMuon for contrast. A line per case: the largest difference per tensor kind and whether it
is within 1e-10.

usage: python benchmarks/gpu_diag_compile.py [--device cuda] [--budget 60] [--dump-code]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

import meqmuon
from meqmuon import functional as F
from meqmuon.optim import compiled

TOL = 1e-10


def _bucket_writeback_outside(params, grads, bufs, states, steps, lr, wd, mu, scale, *, rule, plain, nesterov,
                              batched, group):
    """``compiled._hidden_bucket`` with the new per-matrix state returned, not copied into the inputs."""
    from meqmuon.optim.driver import directions

    inputs = [x.reshape(x.shape[0], -1) for x in compiled._momentum_inputs(grads, bufs, mu, nesterov, update=batched)]
    X = torch.stack(inputs[:plain] + [x.mT for x in inputs[plain:]])
    state = {k: torch.stack(v) for k, v in states.items()}
    if steps is not None:
        state["step"] = steps
    (D,) = directions(rule, [(X, plain, state)], group, None, batched=batched, ns_dtype=group["ns_dtype"])
    rows = [r for d in D for r in d.unbind(0)]
    F.decay_and_update_(params, [d.reshape(p.shape) for d, p in zip(rows, params, strict=True)], lr, wd, scale)
    return [state[k] for k in states]


def _bucket_copy_last(params, grads, bufs, states, steps, lr, wd, mu, scale, *, rule, plain, nesterov, batched,
                      group):
    """``compiled._hidden_bucket`` with the write-back as per-tensor ``copy_`` after the parameter update."""
    from meqmuon.optim.driver import directions

    inputs = [x.reshape(x.shape[0], -1) for x in compiled._momentum_inputs(grads, bufs, mu, nesterov, update=batched)]
    X = torch.stack(inputs[:plain] + [x.mT for x in inputs[plain:]])
    state = {k: torch.stack(v) for k, v in states.items()}
    if steps is not None:
        state["step"] = steps
    (D,) = directions(rule, [(X, plain, state)], group, None, batched=batched, ns_dtype=group["ns_dtype"])
    rows = [r for d in D for r in d.unbind(0)]
    F.decay_and_update_(params, [d.reshape(p.shape) for d, p in zip(rows, params, strict=True)], lr, wd, scale)
    for k, v in states.items():
        for dst, src in zip(v, state[k].unbind(0), strict=True):
            dst.copy_(src)


def _hidden_step_outside(rule, members, plain, shape, key, group, ns_dtype, *, batched):
    """``compiled.hidden_step`` around :func:`_bucket_writeback_outside`: the graph returns the new state
    stack, one eager ``_foreach_copy_`` writes it back."""
    per_matrix = {k: how for k, how in rule.state_views.items() if how in ("rows", "counter", "step")}
    states = {k: [it.state[k] for it in members] for k, how in per_matrix.items() if how != "step"}
    steps = next((F.on_device([it.state[k] for it in members], members[0].param.device)
                  for k, how in per_matrix.items() if how == "step"), None)
    S = compiled.scalar
    new = compiled.bucket_step(
        rule.name, _bucket_writeback_outside, (key, id(rule), tuple(it.param.ndim for it in members), "outside"),
        [it.param.detach() for it in members], [it.grad for it in members],
        [it.state["momentum_buffer"] for it in members], states, steps, S(group["lr"]), S(group["weight_decay"]),
        S(group["momentum"]), S(rule.lr_scale(*shape, group)), rule=rule, plain=plain, nesterov=group["nesterov"],
        batched=batched, group=compiled.static_group(rule, group, ns_dtype))
    for dst, stack in zip(states.values(), new, strict=True):
        torch._foreach_copy_(dst, list(stack.to(dst[0].dtype).unbind(0)))


@contextlib.contextmanager
def variant(options=None, backend="inductor", bucket=None, step=None):
    """Compile fresh graphs with these inductor ``options`` / ``backend`` / bucket body, then restore."""
    saved = compiled.INDUCTOR_OPTIONS, compiled.BACKEND, compiled._hidden_bucket, compiled.hidden_step
    compiled._bucket_graphs.clear()
    torch._dynamo.reset()
    if options is not None:
        compiled.INDUCTOR_OPTIONS = options
    compiled.BACKEND = backend
    if bucket is not None:
        compiled._hidden_bucket = bucket
    if step is not None:
        compiled.hidden_step = step
    try:
        yield
    finally:
        compiled.INDUCTOR_OPTIONS, compiled.BACKEND, compiled._hidden_bucket, compiled.hidden_step = saved
        compiled._bucket_graphs.clear()


def _make(name, shapes, device, foreach, compile_):
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(s, dtype=torch.float64, device=device) * 0.5) for s in shapes]
    opt = meqmuon.build_optimizer(name, [{"params": ps, "kind": "hidden", "names": [f"w{s}" for s in shapes]}],
                                  lr=0.02, weight_decay=0.1, foreach=foreach, compile=compile_,
                                  ns_dtype=torch.float64)
    return ps, opt


def _tensors(ps, opt):
    """``{label: tensor}``: each parameter and each of its state tensors."""
    out = {}
    for i, p in enumerate(ps):
        out[f"param{i}"] = p.detach()
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"{k}{i}"] = v
    return out


def compare(name, shapes, device, steps, foreach=False, reset=True, reference_compiled=False):
    """Per step, the largest |eager - compiled| per state kind (param, momentum_buffer, second_moment, ...);
    ``reference_compiled``: compiled against compiled (does the compiled step give the same bits twice?)."""
    pe, oe = _make(name, shapes, device, foreach, reference_compiled)
    pc, oc = _make(name, shapes, device, foreach, True)
    g = torch.Generator(device="cpu").manual_seed(1)
    per_step = []
    for _ in range(steps):
        for a, b in zip(pe, pc, strict=True):
            a.grad = torch.randn(a.shape, generator=g, dtype=torch.float64).to(device)
            b.grad = a.grad.clone()
        oe.step()
        oc.step()
        te, tc = _tensors(pe, oe), _tensors(pc, oc)
        diffs: dict[str, float] = {}
        for k, v in te.items():
            kind = k.rstrip("0123456789")
            d = (v.double() - tc[k].double()).abs().max().item() if v.is_floating_point() else float(
                (v != tc[k]).any().item())
            diffs[kind] = max(diffs.get(kind, 0.0), d)
            diffs[f"{kind}[{k[len(kind):]}]"] = d
        per_step.append(diffs)
        if reset:  # the compiled copy back on the eager one's values (same tensors: no recompile)
            for k, v in te.items():
                tc[k].copy_(v)
    return per_step


def tinynet(name, device, steps, foreach=False):
    """tests/test_cuda.py's case: TinyNet in float64, eager and compiled in lockstep (each on its own
    gradients, errors accumulate), the largest parameter difference per step and per parameter."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tinynet import batches, loss_fn, make_model

    runs = []
    for compile_ in (False, True):
        model = make_model(dtype=torch.float64).to(device)
        opt = meqmuon.build_optimizer(name, model, lr=0.02, foreach=foreach, compile=compile_, ns_dtype=torch.float64)
        runs.append((model, opt))
    per_step = []
    for ids in batches(steps):
        for model, opt in runs:
            model.zero_grad()
            loss_fn(model, ids.to(device)).backward()
            opt.step()
        (m0, o0), (m1, o1) = runs
        diffs = {}
        for (n, p), q in zip(m0.named_parameters(), m1.parameters(), strict=True):
            diffs[f"param[{n}]"] = (p - q).abs().max().item()
            for k, v in o0.state[p].items():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    diffs[f"{k}[{n}]"] = (v - o1.state[q][k]).abs().max().item()
        for key in list(diffs):
            kind = key.split("[")[0]
            diffs[kind] = max(diffs.get(kind, 0.0), diffs[key])
        per_step.append(diffs)
    return per_step


def report(label, per_step, t):
    kinds = [k for k in per_step[0] if "[" not in k]
    worst = max(max(d[k] for k in kinds) for d in per_step)
    cells = "; ".join(f"{k} " + " ".join(f"{d[k]:.1e}" for d in per_step) for k in kinds)
    where = max(((k, d[k]) for d in per_step for k in d if "[" in k), key=lambda kv: kv[1])
    verdict = "AGREES" if worst <= TOL else "DIFFERS"
    print(f"{verdict:7} {worst:.1e} | {label} | per step: {cells} | worst tensor {where[0]} ({t:.1f} s)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds; later cases are skipped past it")
    ap.add_argument("--dump-code", action="store_true", help="print inductor's code of one NorMuon graph")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}; compiled.INDUCTOR_OPTIONS "
              f"{compiled.INDUCTOR_OPTIONS}", flush=True)
    small = [(36, 12), (12, 36)]  # TinyNet's up and down projections
    big = [(36, 12), (300, 100)]
    base = dict(compiled.INDUCTOR_OPTIONS)
    cases = [
        ("normuon per-tensor, current code", "normuon", small, {}, {}),
        ("normuon TinyNet as tests/test_cuda.py (5 steps, lockstep, no reset)", "normuon", "tinynet", {}, {}),
        ("normuon per-tensor, compiled against compiled (a race would differ)", "normuon", small, {},
         {"reference_compiled": True}),
        ("normuon per-tensor, state written back OUT of the graph", "normuon", small,
         {"step": _hidden_step_outside}, {}),
        ("normuon per-tensor, backend aot_eager (no inductor)", "normuon", small, {"backend": "aot_eager"}, {}),
        ("normuon per-tensor, inductor max_fusion_size=1", "normuon", small,
         {"options": {**base, "max_fusion_size": 1}}, {}),
        ("normuon per-tensor, write-back by per-tensor copy_ after the update", "normuon", small,
         {"bucket": _bucket_copy_last}, {}),
        ("normuon batched (foreach=True), current code", "normuon", small, {}, {"foreach": True}),
        ("normuon batched, state written back OUT of the graph", "normuon", small,
         {"step": _hidden_step_outside}, {"foreach": True}),
        ("muon per-tensor (contrast)", "muon", small, {}, {}),
        ("meqmuon per-tensor (contrast)", "meqmuon", small, {}, {}),
        ("meqmuon batched (contrast)", "meqmuon", small, {}, {"foreach": True}),
        ("normuon per-tensor, larger matrix", "normuon", big, {}, {}),
        ("normuon per-tensor, current code, no reset (errors accumulate)", "normuon", small, {}, {"reset": False}),
    ]
    for opts in ({"epilogue_fusion": False, "aggressive_fusion": False},
                 {"triton.persistent_reductions": False}, {"loop_ordering_after_fusion": False},
                 {"realize_opcount_threshold": 0}, {"emulate_precision_casts": True}, {"triton.cudagraphs": False},
                 {"combo_kernels": True}):
        cases.append((f"normuon per-tensor, inductor options {opts}", "normuon", small,
                      {"options": {**base, **opts}}, {}))
    t0 = time.perf_counter()
    if args.dump_code:  # first: a time limit must not lose it
        from torch._inductor.utils import run_and_get_code

        with variant():
            pe, oe = _make("normuon", [(36, 12)], device, False, True)
            pe[0].grad = torch.randn_like(pe[0])
            _, codes = run_and_get_code(oe.step)
        print("=== inductor code of NorMuon's per-tensor graph, (36, 12), current options ===")
        for code in codes:
            print(code)
        print("=== end of code", flush=True)
    for label, name, shapes, how, kw in cases:
        if time.perf_counter() - t0 > args.budget:
            print(f"SKIPPED (budget {args.budget:.0f} s) | {label}", flush=True)
            continue
        t = time.perf_counter()
        try:
            with variant(**how):
                per_step = (tinynet(name, device, 5, **kw) if shapes == "tinynet" else
                            compare(name, shapes, device, args.steps, **kw))
            report(label, per_step, time.perf_counter() - t)
        except Exception as e:  # a variant that does not compile says so and the others run
            print(f"FAILED  | {label} | {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
