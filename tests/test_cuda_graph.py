"""``cuda_graph=True`` (meqmuon/optim/cuda_graph.py): the step captured in a CUDA graph, hyperparameters on the device.

Everywhere (CPU): the graph's body, run without a graph (``GraphedStep(capture=False)``), with lr, weight
decay and momentum read from device-scalar slots that each step re-uploads, equals the batched step while a
schedule changes them every step; what re-captures (the key) and what does not; every refusal is one
``ValueError`` line. On CUDA (skipped elsewhere): the captured step equals the eager batched step, captures
once with static gradients, and makes no host-device sync.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tinynet import batches, loss_fn, make_model

import meqmuon
from meqmuon.optim.cuda_graph import GraphedStep, graph_key

NAMES = ("meqmuon", "muon", "normuon")  # muon and normuon: AdamW (embedding, head, vectors) too


def _schedule(opt):
    """lr changing every step (and weight decay and momentum at step 3): what a scheduler does."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))


def _train(name, device, steps=6, graphed=None, **kw):
    model = make_model(dtype=torch.float64).to(device)
    opt = meqmuon.build_optimizer(name, model, lr=0.02, weight_decay=0.1, foreach=True, ns_dtype=torch.float64, **kw)
    if graphed is not None:
        opt._graphed = graphed
    sched = _schedule(opt)
    for t, ids in enumerate(batches(steps)):
        model.zero_grad(set_to_none=False)
        loss_fn(model, ids.to(device)).backward()
        if t == 3:
            for g in opt.param_groups:
                g["weight_decay"] = 0.05
                if "momentum" in g:
                    g["momentum"] = 0.9
        opt.step()
        sched.step()
    return model, opt


def _assert_close(m0, m1, tol):
    start = make_model(dtype=torch.float64)
    moved = max((p.cpu() - q).abs().max().item() for p, q in zip(m0.parameters(), start.parameters(), strict=True))
    assert moved > 1e-2
    for (n, p), q in zip(m0.named_parameters(), m1.parameters(), strict=True):
        p, q = p.detach().cpu(), q.detach().cpu()
        assert torch.allclose(p, q, rtol=tol, atol=tol * p.abs().max().item()), (n, (p - q).abs().max().item())


@pytest.mark.parametrize("name", NAMES)
def test_the_graph_body_with_device_scalars_equals_the_batched_step(name):
    """The body a capture records, run eagerly: every step re-uploads lr (a schedule), and weight decay and
    momentum change at step 3; a stale slot would leave the runs apart."""
    eager, _ = _train(name, "cpu")
    body = GraphedStep(capture=False)
    graphed, opt = _train(name, "cpu", graphed=body)
    _assert_close(eager, graphed, 1e-12)
    assert body.scalars.buffer is not None
    assert float(body.scalars.buffer[body.scalars.keys[(0, "lr")]]) == pytest.approx(0.02 / 6)  # the 6th step's


def test_the_key_follows_what_a_capture_bakes_in_and_not_lr():
    model = make_model(dtype=torch.float64)
    opt = meqmuon.build_optimizer("muon", model, lr=0.02, foreach=True)
    loss_fn(model, batches(1)[0]).backward()
    opt.step()
    k0 = graph_key(opt)
    for g in opt.param_groups:
        g["lr"] *= 0.5
        g["weight_decay"] = 0.3  # non-zero before and after: a value on the device
    assert graph_key(opt) == k0
    opt.param_groups[0]["weight_decay"] = 0.0  # a decay kernel less: baked in
    assert graph_key(opt) != k0
    opt.param_groups[0]["weight_decay"] = 0.3
    assert graph_key(opt) == k0
    p = next(model.parameters())
    p.grad = p.grad.clone()  # a gradient at another address
    assert graph_key(opt) != k0


def test_a_parameter_without_a_gradient_keeps_the_key():
    """Its step count stays behind the others' every step: the key holds the counts of those that step."""
    model = make_model(dtype=torch.float64)
    opt = meqmuon.build_optimizer("muon", model, lr=0.02, foreach=True)
    opt._graphed = body = GraphedStep(capture=False)
    for ids in batches(4):
        model.zero_grad(set_to_none=False)
        loss_fn(model, ids).backward()
        model.q.weight.grad = None  # q never steps
        opt.step()
    assert body.captures == 1 and opt.state[model.q.weight]["step"] == 0


def _opt(name="meqmuon", device="cpu", **kw):
    model = make_model(dtype=torch.float32).to(device)
    loss_fn(model, batches(1)[0].to(device)).backward()
    return meqmuon.build_optimizer(name, model, lr=0.02, **{"cuda_graph": True, **kw})


@pytest.mark.parametrize("make, message", [
    (lambda: _opt(), "needs CUDA parameters; one is on cpu"),
    (lambda: _opt("muoneq-r"), "reads per-step host counters"),
    (lambda: _opt("scale"), "has no graph form"),
])
def test_cuda_graph_refusals_are_one_line(make, message):
    opt = make()
    with pytest.raises(ValueError, match=message) as e:
        opt.step()
    assert "\n" not in str(e.value) and str(e.value).startswith("meqmuon: error: cuda_graph=True")


def test_a_closure_and_the_capture_hook_are_refused():
    opt = _opt()
    with pytest.raises(ValueError, match="cannot capture step"):
        opt.step(lambda: 0.0)
    opt.set_capture_hook(lambda *a: None)
    with pytest.raises(ValueError, match="capture hook"):
        opt.step()


def test_cuda_graph_takes_a_bool():
    with pytest.raises(ValueError, match="Invalid cuda_graph"):
        _opt(cuda_graph="yes")


# ---- on CUDA -------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("compile_", [False, True])
@pytest.mark.parametrize("name", ("meqmuon", "muon", "normuon"))
def test_cuda_graph_equals_the_eager_batched_step(name, compile_):
    """float64 (Newton-Schulz too), a schedule changing lr every step: the replays read the device slots.
    Static gradients (zero_grad(set_to_none=False)): one capture, then replays only."""
    kw = {"compile": True} if compile_ else {}
    eager, _ = _train(name, "cuda", **kw)
    graphed, opt = _train(name, "cuda", cuda_graph=True, **kw)
    _assert_close(eager, graphed, 1e-10)
    assert opt._graphed.captures == 1


@cuda
def test_cuda_graph_refuses_the_per_tensor_form():
    opt = _opt(device="cuda", foreach=False)
    with pytest.raises(ValueError, match="captures the batched step; a group has foreach=False"):
        opt.step()


@cuda
def test_cuda_graph_replays_without_host_device_sync():
    model = make_model(dtype=torch.float32).to("cuda")
    opt = meqmuon.build_optimizer("meqmuon", model, lr=0.02, cuda_graph=True)
    loss_fn(model, batches(1)[0].to("cuda")).backward()
    opt.step()  # warm-up and capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for g in opt.param_groups:
            g["lr"] *= 0.5
        opt.step()
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt._graphed.captures == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_scalars_are_written_by_fill_only_where_changed():
    """The slots travel as kernel arguments (``fill_``), never by a copy from host memory (a pageable copy may
    wait for the stream: a host-device sync in the step), and only the slots whose value changed are written."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from op_count import OpCounter  # dispatched ops, views and allocations left out

    from meqmuon.optim.cuda_graph import Scalars

    hp = {"lr": 0.1, "wd": 0.01, "mu": 0.95}
    scalars = Scalars(torch.device("cpu"), torch.float64)
    with OpCounter() as counted:
        slots = {k: scalars.get(k, lambda k=k: hp[k]) for k in hp}
        scalars.freeze()
    assert not {"copy_", "_to_copy", "lift_fresh"} & set(counted.ops), counted.ops
    assert [scalars.get(k, None).item() for k in hp] == list(hp.values()) == [s.item() for s in slots.values()]
    hp["lr"] = 0.05  # a scheduler's step
    with OpCounter() as counted:
        assert scalars.upload() == 1
    assert counted.ops == {"fill_": 1}, counted.ops
    assert scalars.get("lr", None).item() == 0.05 and scalars.upload() == 0


@pytest.mark.parametrize("name", NAMES)
def test_every_device_scalar_has_its_tensors_dtype(name):
    """A ``torch._foreach_*`` op given a 0-D tensor scalar of another dtype than its tensors takes the per-tensor
    path on CUDA (a kernel per tensor inside the graph): in the graph's body on a float32 model every such
    scalar is float32, and the slots are float64 only for a float64 model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Scalars(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            lists = [a for a in args if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)]
            if func.overloadpacket.__name__.startswith("_foreach_") and lists:
                for a in args:
                    if isinstance(a, torch.Tensor) and a.dim() == 0:
                        seen.append((func.overloadpacket.__name__, a.dtype, lists[0][0].dtype))
            return func(*args, **(kwargs or {}))

    model = make_model(dtype=torch.float32)
    opt = meqmuon.build_optimizer(name, model, lr=0.02, weight_decay=0.1, foreach=True, ns_dtype=torch.float32)
    opt._graphed = GraphedStep(capture=False)
    for t, ids in enumerate(batches(3)):
        model.zero_grad(set_to_none=False)
        loss_fn(model, ids).backward()
        if t == 2:
            with Scalars():
                opt.step()
        else:
            opt.step()
    assert seen, "the body passed no device scalar to a foreach op"
    assert all(s == t for _, s, t in seen), sorted(set(seen))
    assert opt._graphed.scalars.buffer.dtype == torch.float32
    _, wide = _train(name, "cpu", steps=1, graphed=GraphedStep(capture=False))
    assert wide._graphed.scalars.buffer.dtype == torch.float64
