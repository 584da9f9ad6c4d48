"""The table of Newton-Schulz methods, what each costs, and where a stack of them runs as one call.

A method is one entry of :data:`NS_METHODS` (a group's ``ns_method``, validated by
:class:`~meqmuon.optim.driver.HiddenRule`), as optax's ``ns_iterators`` and microsoft/dion's
``newton_schulz_func``: a function of ``functional.py`` with :func:`meqmuon.functional.orthogonalize`'s
signature. Adding one is that function and its entry here (and an entry of :data:`NS_SCHEDULES` if it
reads ``ns_steps``/``ns_coefficients`` otherwise than the quintic). The seam that looks a method up,
``pre -> Newton-Schulz -> post`` (:func:`meqmuon.optim.driver.directions`), is the driver's. Besides: a
method's cost (:func:`ns_flops`, for balancing DDP and FSDP2 owners) and the devices where a shape bucket
runs as one batched call (:data:`BATCHED_NS_DEVICES`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import functional as F

__all__ = ["BATCHED_NS_DEVICES", "NS_METHODS", "NS_SCHEDULES", "batched_ns", "ns_flops"]

#: Newton-Schulz methods by name, a group's ``ns_method`` (default ``"quintic"``). Each is called as
#: ``f(X, steps, coefficients, dtype, *, batched, inplace, workspace, out)`` with ``X`` a stack ``(K, m, n)``
#: (:func:`meqmuon.functional.orthogonalize`'s signature) and returns ``Orth(X)`` ``(K, m, n)`` in ``dtype``:
#: ``batched`` one batched call for the stack (``X`` scratch if ``inplace``), else matrix by matrix into
#: ``out`` with buffers kept in ``workspace``.
#: ``"quintic"``: paper eq. 3, fixed coefficients (Jordan et al.) or Polar Express's schedule (``ns_coefficients``).
#: ``"gram"``: the same iteration on the Gram matrix with a restart (:func:`meqmuon.functional.gram_orthogonalize`).
#: ``"aol"``: AOL-preconditioned, ``ns_steps - 1`` iterations (:func:`meqmuon.functional.aol_orthogonalize`).
#: ``"cubic"``: cubic5, ``aX + b(XX^T)X``, 5 fixed steps (:func:`meqmuon.functional.cubic_orthogonalize`).
NS_METHODS: dict[str, Callable[..., Tensor]] = {"quintic": F.orthogonalize, "gram": F.gram_orthogonalize,
                                                "aol": F.aol_orthogonalize, "cubic": F.cubic_orthogonalize}

#: The check of ``ns_coefficients`` and ``ns_steps`` of a method that reads them otherwise than the quintic's
#: schedule (:func:`meqmuon.functional.ns_schedule`, every method without an entry): raises ``ValueError``
#: when the optimizer is built (``HiddenRule.validate``), not at its first step.
NS_SCHEDULES: dict[str, Callable[[Any, int], object]] = {"cubic": F.cubic_schedule}

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
