"""Which compute dtype is fast on this hardware: bf16 where it runs natively, float32 elsewhere.

bf16 is only a speed-up where the hardware multiplies bf16 natively. On an x86 CPU without
AVX512-BF16/AMX (torch capability ``AVX2``) PyTorch falls back to a scalar bf16 GEMM, ~170x
slower than float32 (docs/benchmarks.md), whereas CPUs with AVX512-BF16 run it ~4x
faster. So the package's "auto" choices (``ns_dtype=None`` of the Muon-family optimizers,
``--precision auto`` of the harness) ask this module, which decides from what the hardware
*reports*, never from a timing, so the decision is the same in every process on a machine and can
be tested by injecting the report:

* CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and newer).
* CPU: :func:`detect_cpu_capability`, torch's vectorisation level (``torch.backends.cpu.get_cpu_capability()``:
  ``AVX2``, ``AVX512``, ``SVE256``, ...) extended with ``+AVX512_BF16`` / ``+AMX_BF16`` (x86, from
  cpuinfo via ``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``) or ``+BF16``
  (other architectures, from oneDNN's ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``). bf16 is
  native when the string carries a ``BF16`` feature (:func:`cpu_native_bf16`). Plain ``AVX512``
  is *not* native: oneDNN emulates bf16 there by conversions, no faster than float32.
* Any other device type: float32 (not timed).

Core module: imports torch only. The CPU answer is computed once per process (``functools.cache``).

``MEQMUON_CPU_CAPABILITY`` (e.g. ``AVX2``) replaces the CPU's report, as ``ATEN_CPU_CAPABILITY`` replaces
torch's kernel choice: with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MEQMUON_CPU_CAPABILITY=AVX2
TORCHINDUCTOR_CPP_MARCH=haswell`` a CPU with native bf16 runs the package as an AVX2-only CPU would (float32
"auto" choices, emulated bf16 where a test asks for bf16, AVX2 kernels), so the suite can be checked for
both kinds on one machine. The last one matters: Inductor compiles its CPU code with ``-march=native``,
and AVX2 vector code built for an AVX-512 target wrote NaN into parameters (torch 2.13.0).
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any

import torch

__all__ = [
    "CAPABILITY_ENV",
    "PRECISIONS",
    "BF16_SLOWDOWN_NO_NATIVE",
    "detect_cpu_capability",
    "cpu_native_bf16",
    "detect_cuda_bf16",
    "native_bf16",
    "resolve_ns_dtype",
    "resolve_precision",
    "bf16_warning",
    "describe",
]

#: The environment variable that replaces the CPU's report (:func:`detect_cpu_capability`).
CAPABILITY_ENV = "MEQMUON_CPU_CAPABILITY"

#: Values of the harness's ``precision``: ``auto`` resolves to ``bf16`` or ``fp32`` per device.
PRECISIONS = ("auto", "bf16", "fp32")

#: How much slower a bf16 matmul is than a float32 one on a CPU without native bf16, for the
#: warning (a 1024 x 1024 matmul, capability AVX2; docs/benchmarks.md).
BF16_SLOWDOWN_NO_NATIVE = 170


@functools.cache
def detect_cpu_capability() -> str:
    """This CPU as torch reports it, e.g. ``"AVX2"`` or ``"AVX512+AVX512_BF16+AMX_BF16"``.

    The base is ``torch.backends.cpu.get_cpu_capability()`` (which never says whether bf16 is
    native); the ``+`` features are the bf16 instruction sets the CPU reports. Cached per process.
    :data:`CAPABILITY_ENV`, where set, is the answer instead (see the module docstring).
    """
    forced = os.environ.get(CAPABILITY_ENV, "").strip()
    if forced:
        return forced
    base = torch.backends.cpu.get_cpu_capability()
    feats: list[str] = []
    cpu = getattr(torch, "cpu", None)
    if callable(getattr(cpu, "_is_avx512_bf16_supported", None)):  # x86 (cpuinfo); False elsewhere
        if cpu._is_avx512_bf16_supported():
            feats.append("AVX512_BF16")
        if cpu._is_amx_tile_supported():
            feats.append("AMX_BF16")
    is_x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
    if not feats and not is_x86 and _mkldnn_bf16():
        feats.append("BF16")  # e.g. aarch64 with BFMMLA (oneDNN checks cpuinfo_has_arm_bf16)
    return "+".join([base, *feats])


def _mkldnn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def cpu_native_bf16(capability: str) -> bool:
    """Whether a CPU with this :func:`detect_cpu_capability` string multiplies bf16 natively (pure).

    True when one of its features ends in ``BF16`` (``"AVX512+AVX512_BF16"``, ``"AVX512_BF16"``,
    ``"SVE256+BF16"``); False for ``"AVX2"``, ``"AVX512"``, ``"DEFAULT"``.
    """
    return any(part.strip().upper().endswith("BF16") for part in capability.split("+"))


@functools.cache
def _cuda_bf16(index: int) -> bool:
    with torch.cuda.device(index):
        return bool(torch.cuda.is_bf16_supported())


def detect_cuda_bf16(device: torch.device | str | None = None) -> bool:
    """``torch.cuda.is_bf16_supported()`` for ``device`` (cached per device index)."""
    if not torch.cuda.is_available():
        return False
    d = torch.device(device) if device is not None else torch.device("cuda")
    return _cuda_bf16(d.index if d.index is not None else torch.cuda.current_device())


def _device_type(device: torch.device | str) -> str:
    """``"cuda"`` for ``"cuda:1"`` or ``torch.device("cuda", 1)``."""
    return (device if isinstance(device, str) else device.type).split(":")[0]


def native_bf16(device: torch.device | str, *, cpu_capability: str | None = None,
                cuda_bf16: bool | None = None) -> bool:
    """Whether ``device`` runs bf16 matmuls natively (see the module docstring for the rule).

    ``cpu_capability`` / ``cuda_bf16`` inject the hardware report (tests); ``None`` asks the hardware.
    """
    dev_type = _device_type(device)
    if dev_type == "cuda":
        return detect_cuda_bf16(device) if cuda_bf16 is None else bool(cuda_bf16)
    if dev_type == "cpu":
        return cpu_native_bf16(detect_cpu_capability() if cpu_capability is None else cpu_capability)
    return False


def resolve_ns_dtype(ns_dtype: torch.dtype | None, device: torch.device | str, *,
                     cpu_capability: str | None = None, cuda_bf16: bool | None = None) -> torch.dtype:
    """The Newton-Schulz compute dtype: ``ns_dtype`` itself when given, else (``None``, "auto")
    bf16 where :func:`native_bf16` holds for ``device`` and float32 elsewhere.

    Called by the optimizers per matrix at step time, so a ``None`` group follows the device its
    parameters live on. An explicit dtype is always honoured, even where it is slow.
    """
    if ns_dtype is not None:
        return ns_dtype
    native = native_bf16(device, cpu_capability=cpu_capability, cuda_bf16=cuda_bf16)
    return torch.bfloat16 if native else torch.float32


def resolve_precision(precision: str, device: torch.device | str, *, cpu_capability: str | None = None,
                      cuda_bf16: bool | None = None) -> str:
    """The harness's autocast precision: ``"auto"`` -> ``"bf16"`` where native, else ``"fp32"``;
    ``"bf16"`` and ``"fp32"`` are returned as given (see :func:`bf16_warning`). Other values raise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    native = native_bf16(device, cpu_capability=cpu_capability, cuda_bf16=cuda_bf16)
    return "bf16" if native else "fp32"


def bf16_warning(device: torch.device | str, *, what: str = "bf16", cpu_capability: str | None = None) -> str | None:
    """One warning line when bf16 (``what``, e.g. "bf16 autocast") is asked for on a CPU without
    native bf16, else ``None``."""
    if _device_type(device) != "cpu":
        return None
    cap = detect_cpu_capability() if cpu_capability is None else cpu_capability
    if cpu_native_bf16(cap):
        return None
    return (f"{what} on a CPU without native bf16 (capability {cap}): bf16 matmuls run ~{BF16_SLOWDOWN_NO_NATIVE}x "
            "slower than float32 here")


def describe(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What this process decided for ``device``: the record the harness writes into a run."""
    dev = torch.device(device)
    return {
        "device": str(dev),
        "cpu_capability": detect_cpu_capability(),
        "native_bf16": native_bf16(dev),
        "auto_precision": resolve_precision("auto", dev),
        "auto_ns_dtype": str(resolve_ns_dtype(None, dev)).removeprefix("torch."),
        "cuda_device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
    }
