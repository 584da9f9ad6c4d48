"""The CUDA step: what CI (CPU only) cannot check, run on a lent GPU (``pytest tests/test_cuda.py``).

- The batched step (the CUDA default, ``foreach=None``) equals the per-tensor CUDA step to 1e-5 with
  float32 Newton-Schulz, and the CUDA step equals the CPU step to 1e-4 (cuBLAS against the CPU BLAS,
  TF32 off), for every optimizer with both forms.
- No host-device synchronisation in ``step()``: ``torch.cuda.set_sync_debug_mode("error")`` makes any
  synchronising CUDA call raise, on the per-tensor and the batched step, with the default (bf16 on
  CUDA) Newton-Schulz.
- ``compile=True`` on CUDA (inductor's Triton kernels) equals the eager step to 1e-10 in float64 after
  5 steps, for Muon, NorMuon and MeqMuon per-tensor and NorMuon batched (test_compile.py's check on the CPU).
- ``cuda_graph=True``: tests/test_cuda_graph.py.

The whole module needs CUDA; on a CPU-only machine it is skipped (test_foreach.py and test_engine.py
prove the same on the CPU).
"""

from __future__ import annotations

import pytest
import torch
from capabilities import having
from test_foreach import _run
from tinynet import batches, loss_fn, make_model

import meqmuon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 products in full float32, so that 1e-5 means what it says on Ampere and later."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _close(m0, m1, rtol):
    start = make_model(dtype=next(m0.parameters()).dtype)
    moved = max((p.cpu() - q).abs().max().item() for p, q in zip(m0.parameters(), start.parameters(), strict=True))
    assert moved > 1e-2  # the runs trained: equality below is not two copies of the start
    for (n, p), q in zip(m0.named_parameters(), m1.parameters(), strict=True):
        p, q = p.detach().cpu(), q.detach().cpu()
        assert torch.allclose(p, q, rtol=rtol, atol=rtol * p.abs().max().item()), (n, (p - q).abs().max().item())


@pytest.mark.parametrize("name", having("per-tensor", "batched"))
def test_cuda_batched_default_equals_per_tensor_and_cpu(name):
    default, _ = _run(name, None, device=CUDA)  # foreach=None: batched on CUDA
    per_tensor, _ = _run(name, False, device=CUDA)
    cpu, _ = _run(name, False)
    _close(per_tensor, default, 1e-5)
    _close(cpu, per_tensor, 1e-4)


@pytest.mark.parametrize("foreach", [False, True])
def test_cuda_step_makes_no_host_device_sync(foreach):
    model = make_model(dtype=torch.float32).to(CUDA)
    opts = [meqmuon.build_optimizer(n, model, lr=1e-2, foreach=foreach) for n in having("per-tensor", "batched")]
    loss_fn(model, batches(1)[0].to(CUDA)).backward()
    for opt in opts:  # the first step creates state (allocations, not synchronisations), then two checked
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for opt in opts:
            opt.step()
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name, foreach", [(n, False) for n in ("muon", "normuon", "meqmuon") if n in having("compile")]
                         + [("normuon", True)])
def test_cuda_compile_equals_eager(name, foreach):
    """One optimizer per compiled rule family (each compile costs seconds of device time), and NorMuon's batched
    graphs too. In float64, as test_compile.py on the CPU: in float32 the fused kernels' last-bit differences
    grow through the gradients over the steps (NorMuon: 2e-3 after 10 steps on an H200), which says nothing of
    the maths. NorMuon was 8.5e-5 apart on an H200 until its per-row state was written back with ``copy_``
    (the per-tensor graph of compiled.py, since replaced: inductor's in-place foreach lowering aliased it)."""
    eager, _ = _run(name, foreach, torch.float64, steps=5, device=CUDA)
    compiled, _ = _run(name, foreach, torch.float64, steps=5, device=CUDA, compile=True)
    _close(eager, compiled, 1e-10)
