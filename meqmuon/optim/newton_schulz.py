"""Newton-Schulz dispatch of the hidden-matrix rules: which dtype, per matrix or batched, which buffers.

The iteration itself (paper eq. 3: quintic Newton-Schulz, symmetric Gram blocks on CPU, Polar
Express schedules) is pure maths and lives in :func:`meqmuon.functional.orthogonalize`; this module
decides how a step calls it (:func:`orthogonalize`): the batched step runs a shape bucket as one
batched call, the per-tensor step matrix by matrix with fused ``addmm`` (torch.optim.Muon's form:
faster on CPU, and each matrix's bits are independent of its neighbours, which the DDP split relies
on). FSDP2's owners batch on the devices of :data:`BATCHED_NS_DEVICES`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import functional as F
from ..precision import resolve_ns_dtype

__all__ = ["BATCHED_NS_DEVICES", "batched_ns", "ns_dtype_of", "ns_flops", "orthogonalize"]

#: Device types on which same-shape matrices are orthogonalised as one batched call (a stack per
#: shape bucket; ``functional.orthogonalize(batched=True)``). GPUs: one matmul kernel per matrix is
#: launch-bound for small models (Llama-60M has 56 hidden matrices, so 840 matmul launches per
#: step), and GPU Muon implementations batch by shape (microsoft/dion's megabatch, modded-nanogpt, nanochat); not yet
#: timed on a GPU. CPU: one ``addmm`` per matrix is faster (docs/benchmarks.md), and it makes a
#: matrix's bits independent of the batch it travels in, which the bit-exact DDP split relies on.
BATCHED_NS_DEVICES: frozenset[str] = frozenset({"cuda"})


def batched_ns(device: torch.device) -> bool:
    """Whether Newton-Schulz runs a shape bucket as one batched call on ``device``."""
    return device.type in BATCHED_NS_DEVICES


def ns_dtype_of(group: dict, x: Tensor) -> torch.dtype:
    """The dtype Newton-Schulz runs in for ``x`` under ``group``'s ``ns_dtype``: an explicit dtype as
    given; ``None`` resolved from what ``x``'s device reports (:func:`meqmuon.precision.resolve_ns_dtype`)."""
    return resolve_ns_dtype(group["ns_dtype"], x.device)


def ns_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` quintic Newton-Schulz iterations on an ``m x n`` matrix (wide orientation).

    Per iteration with ``a = min(m, n)``, ``b = max(m, n)``: ``A = X X^T`` (``2 a^2 b``),
    ``A A`` (``2 a^3``) and ``B X`` (``2 a^2 b``).
    """
    a, b = min(m, n), max(m, n)
    return steps * (4 * a * a * b + 2 * a**3)


def orthogonalize(X: Tensor, group: dict, *, batched: bool, workspace: dict | None = None,
                  out: Tensor | None = None) -> Tensor:
    """Newton-Schulz of a stack ``X`` ``(K, m, n)`` under ``group``'s settings: the one dispatcher.

    ``batched``: one batched call for the stack (the batched step's form; ``X`` is scratch and is
    consumed when it is already in the Newton-Schulz dtype); else matrix by matrix with fused ``addmm``
    and the buffers of ``workspace`` (the per-tensor form, and the owners of the distributed forms: a
    matrix's bits then never depend on its neighbours). ``out``: the result's buffer (per-matrix form).
    """
    dtype = ns_dtype_of(group, X)
    if batched:
        return F.orthogonalize_stack(X.to(dtype), group["ns_steps"], group["ns_coefficients"], inplace=True)
    return F.orthogonalize(X, group["ns_steps"], group["ns_coefficients"], dtype, workspace=workspace, out=out)
