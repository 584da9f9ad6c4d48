"""meqmuon.precision: bf16 only where the hardware reports native bf16.

The decision is a pure function of the reported capability, so every case is tested here by
injecting the report (CUDA with and without bf16, an AVX512-BF16 CPU, an AVX2 CPU), whatever
machine runs the tests.
"""

from __future__ import annotations

import pytest
import torch

import meqmuon
from meqmuon import precision as P

AVX2 = "AVX2"
AVX512_BF16 = "AVX512+AVX512_BF16"  # what detect_cpu_capability() reports on such a CPU


@pytest.mark.parametrize(
    "capability, native",
    [("AVX2", False), ("AVX512", False), ("DEFAULT", False), ("NO AVX", False), ("AVX512+AVX512_BF16", True),
     ("AVX512+AVX512_BF16+AMX_BF16", True), ("AVX512_BF16", True), ("SVE256+BF16", True)],
)
def test_cpu_native_bf16_from_capability(capability, native):
    assert P.cpu_native_bf16(capability) is native


def test_ns_dtype_auto_cuda():
    assert P.resolve_ns_dtype(None, "cuda", cuda_bf16=True) is torch.bfloat16
    assert P.resolve_ns_dtype(None, torch.device("cuda:1"), cuda_bf16=False) is torch.float32
    # the CPU capability does not matter for a CUDA device
    assert P.resolve_ns_dtype(None, "cuda", cpu_capability=AVX2, cuda_bf16=True) is torch.bfloat16


def test_ns_dtype_auto_cpu_avx512_bf16_and_avx2():
    assert P.resolve_ns_dtype(None, "cpu", cpu_capability=AVX512_BF16) is torch.bfloat16
    assert P.resolve_ns_dtype(None, torch.device("cpu"), cpu_capability=AVX2) is torch.float32
    assert P.resolve_ns_dtype(None, "cpu", cpu_capability="AVX512") is torch.float32
    # a CUDA report does not matter for a CPU device
    assert P.resolve_ns_dtype(None, "cpu", cpu_capability=AVX2, cuda_bf16=True) is torch.float32


def test_ns_dtype_auto_other_devices_is_float32():
    assert P.resolve_ns_dtype(None, "meta", cpu_capability=AVX512_BF16, cuda_bf16=True) is torch.float32


@pytest.mark.parametrize("explicit", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("device, cap, cuda", [("cpu", AVX2, None), ("cpu", AVX512_BF16, None), ("cuda", None, True),
                                               ("cuda", None, False)])
def test_explicit_ns_dtype_is_honoured(explicit, device, cap, cuda):
    assert P.resolve_ns_dtype(explicit, device, cpu_capability=cap, cuda_bf16=cuda) is explicit


def test_resolve_precision():
    assert P.resolve_precision("auto", "cpu", cpu_capability=AVX2) == "fp32"
    assert P.resolve_precision("auto", "cpu", cpu_capability=AVX512_BF16) == "bf16"
    assert P.resolve_precision("auto", "cuda", cuda_bf16=True) == "bf16"
    assert P.resolve_precision("auto", "cuda", cuda_bf16=False) == "fp32"
    # explicit values are honoured even where slow
    assert P.resolve_precision("bf16", "cpu", cpu_capability=AVX2) == "bf16"
    assert P.resolve_precision("fp32", "cpu", cpu_capability=AVX512_BF16) == "fp32"
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp32"):
        P.resolve_precision("fp16", "cpu")


def test_bf16_warning_only_on_cpu_without_native_bf16():
    msg = P.bf16_warning("cpu", cpu_capability=AVX2)
    assert msg is not None and "AVX2" in msg and f"~{P.BF16_SLOWDOWN_NO_NATIVE}x slower" in msg
    assert "\n" not in msg
    assert P.bf16_warning("cpu", cpu_capability=AVX512_BF16) is None
    assert P.bf16_warning("cuda", cpu_capability=AVX2) is None


def test_this_machine_is_consistent():
    """Whatever this machine is, the cached detection, the pure rule and describe() agree."""
    cap = P.detect_cpu_capability()
    assert cap.split("+")[0] == torch.backends.cpu.get_cpu_capability()
    assert P.detect_cpu_capability() is cap  # computed once per process
    native = P.cpu_native_bf16(cap)
    assert P.native_bf16("cpu") is native
    d = P.describe("cpu")
    assert d["cpu_capability"] == cap and d["native_bf16"] is native
    assert d["auto_ns_dtype"] == ("bfloat16" if native else "float32")
    assert d["auto_precision"] == ("bf16" if native else "fp32")
    if torch.cpu._is_avx512_bf16_supported():
        assert "AVX512_BF16" in cap


def _ns_dtypes_used(opt_cls, monkeypatch, **kw):
    """The dtype each Newton-Schulz call computed in, recorded from functional.orthogonalize."""
    seen = []
    real = meqmuon.functional.orthogonalize

    def spy(x, steps, coefficients, dtype, *a, **k):
        seen.append(dtype)
        return real(x, steps, coefficients, dtype, *a, **k)

    monkeypatch.setattr(meqmuon.functional, "orthogonalize", spy)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 8))
    opt = opt_cls([{"params": [w], "kind": "hidden"}], lr=1e-2, **kw)
    w.grad = torch.randn_like(w)
    opt.step()
    return seen


@pytest.mark.parametrize("opt_cls", [meqmuon.MeqMuon, meqmuon.Muon, meqmuon.NorMuon])
def test_optimizer_default_ns_dtype_is_auto_and_resolved_at_step(opt_cls, monkeypatch):
    """The presets default to ns_dtype=None, and the step computes in the resolver's dtype for the
    parameter's device (here the CPU, with its capability injected both ways)."""
    import inspect

    assert inspect.signature(opt_cls).parameters["ns_dtype"].default is None
    for cap, want in ((AVX2, torch.float32), (AVX512_BF16, torch.bfloat16)):
        monkeypatch.setattr(P, "detect_cpu_capability", lambda cap=cap: cap)
        assert _ns_dtypes_used(opt_cls, monkeypatch) == [want]
    # explicit dtype wins over the capability
    assert _ns_dtypes_used(opt_cls, monkeypatch, ns_dtype=torch.float64) == [torch.float64]
