"""Newton-Schulz facts the driver and the distributed forms share: its cost and where it batches.

The iteration itself (paper eq. 3: quintic Newton-Schulz, symmetric Gram blocks on CPU, Polar
Express schedules) is pure maths in :func:`meqmuon.functional.orthogonalize`; the form a step calls
(one batched call per shape bucket, or matrix by matrix with fused ``addmm``) is chosen by the
driver's body, :func:`meqmuon.optim.driver.directions`. FSDP2's owners batch on the devices of
:data:`BATCHED_NS_DEVICES`.
"""

from __future__ import annotations

import torch

__all__ = ["BATCHED_NS_DEVICES", "batched_ns", "ns_flops"]

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


def ns_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` quintic Newton-Schulz iterations on an ``m x n`` matrix (wide orientation).

    Per iteration with ``a = min(m, n)``, ``b = max(m, n)``: ``A = X X^T`` (``2 a^2 b``),
    ``A A`` (``2 a^3``) and ``B X`` (``2 a^2 b``).
    """
    a, b = min(m, n), max(m, n)
    return steps * (4 * a * a * b + 2 * a**3)
