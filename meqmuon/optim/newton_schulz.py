"""The table of Newton-Schulz methods, what each costs, and where a stack of them runs as one call.

A method is one record of :data:`NS_METHODS` (a group's ``ns_method``, validated by
:class:`~meqmuon.optim.driver.HiddenRule`), as optax's ``ns_iterators`` and microsoft/dion's
``newton_schulz_func``: an :class:`NSMethod` holding its function (in ``meqmuon/orthogonalization.py``, with
:func:`meqmuon.functional.orthogonalize`'s signature), the check of its schedule (``ns_steps`` and
``ns_coefficients``) and its cost in FLOPs, which balancing DDP, FSDP2 and owner-path work reads
(:func:`method_flops`). Adding a method is its function and its record here. The seam that looks a method
up, ``pre -> Newton-Schulz -> post`` (:func:`meqmuon.optim.driver.directions`), is the driver's. Besides:
the devices where a shape bucket runs as one batched call (:data:`BATCHED_NS_DEVICES`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import functional as F

__all__ = ["BATCHED_NS_DEVICES", "NS_METHODS", "NSMethod", "batched_ns", "ns_flops"]


def ns_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` quintic Newton-Schulz iterations on an ``m x n`` matrix (wide orientation).

    Per iteration with ``a = min(m, n)``, ``b = max(m, n)``: ``A = X X^T`` (``2 a^2 b``),
    ``A A`` (``2 a^3``) and ``B X`` (``2 a^2 b``).
    """
    a, b = min(m, n), max(m, n)
    return steps * (4 * a * a * b + 2 * a**3)


def gram_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of :func:`meqmuon.functional.gram_orthogonalize`, counted along its iteration.

    ``R = X X^T`` and the final ``Q X`` (``2 a^2 b`` each); per iteration ``P = a I + b R + c R^2`` (``2 a^3``),
    ``Q <- P Q`` (``2 a^3``, not the first after a start), ``R <- P R P`` (``4 a^3``, not before the last
    iteration or a restart) and, at a restart (:data:`~meqmuon.functional.GRAM_RESTARTS`), ``X <- Q X`` and
    ``R = X X^T`` (``4 a^2 b``). A square matrix runs the quintic (:func:`ns_flops`).
    """
    a, b = min(m, n), max(m, n)
    if a == b:
        return ns_flops(m, n, steps)
    flops, started = 4 * a * a * b, False
    for k in range(steps):
        if k in F.GRAM_RESTARTS and started:
            flops, started = flops + 4 * a * a * b, False
        flops += 2 * a**3 + (2 * a**3 if started else 0)
        started = True
        if k < steps - 1 and k + 1 not in F.GRAM_RESTARTS:
            flops += 4 * a**3
    return flops


def aol_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of :func:`meqmuon.functional.aol_orthogonalize`: ``steps - 1`` quintic iterations (the
    scaling's ``A = X X^T`` is the first iteration's Gram matrix)."""
    return ns_flops(m, n, steps - 1)


def cubic_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of :func:`meqmuon.functional.cubic_orthogonalize`: per iteration ``A = X X^T`` and ``A X``
    (``2 a^2 b`` each, ``a = min(m, n)``, ``b = max(m, n)``)."""
    a, b = min(m, n), max(m, n)
    return steps * 4 * a * a * b


@dataclass(frozen=True)
class NSMethod:
    """One Newton-Schulz method: everything the optimizer knows of it, in one record.

    Attributes:
        function: called as ``f(X, steps, coefficients, dtype, *, batched, inplace, workspace, out)`` with
            ``X`` a stack ``(K, m, n)`` (:func:`meqmuon.functional.orthogonalize`'s signature); returns
            ``Orth(X)`` ``(K, m, n)`` in ``dtype``: ``batched`` one batched call for the stack (``X`` scratch if
            ``inplace``), else matrix by matrix into ``out`` with buffers kept in ``workspace``.
        schedule: the check of ``ns_coefficients`` and ``ns_steps`` (raises ``ValueError``), run when the
            optimizer is built (``HiddenRule.validate``), not at its first step; the quintic's
            (:func:`meqmuon.functional.ns_schedule`) unless the method reads them otherwise.
        flops: ``flops(m, n, steps)``, the matmul FLOPs of one ``m x n`` matrix: the cost by which DDP,
            FSDP2 and owner-path work is balanced over ranks.
    """

    function: Callable[..., Tensor]
    schedule: Callable[[Any, int], object] = F.ns_schedule
    flops: Callable[[int, int, int], int] = ns_flops


#: Newton-Schulz methods by name, a group's ``ns_method`` (default ``"quintic"``); one :class:`NSMethod` each.
#: ``"quintic"``: paper eq. 3, fixed coefficients (Jordan et al.) or Polar Express's schedule (``ns_coefficients``).
#: ``"gram"``: the same iteration on the Gram matrix with a restart (:func:`meqmuon.functional.gram_orthogonalize`).
#: ``"aol"``: AOL-preconditioned, ``ns_steps - 1`` iterations (:func:`meqmuon.functional.aol_orthogonalize`).
#: ``"cubic"``: cubic5, ``aX + b(XX^T)X``, 5 fixed steps (:func:`meqmuon.functional.cubic_orthogonalize`).
#: ``"quintic+1e-7"``, ``"quintic+1e-8"``: the quintic with the official codes' normalisation ``X / (||X||_F + eps)``
#: (``eps_added``; ours: ``X / max(||X||_F, 1e-7)``): Keller Jordan's ``zeropower_via_newtonschulz5`` and its
#: copies in Muon+, Muon-VS and Aurora (1e-7), levanter's (its ``muon_epsilon``, 1e-8). The 2026 field's presets
#: take them, so that they equal their official codes also where ``||X||_F`` is small (issue 58).
NS_METHODS: dict[str, NSMethod] = {
    "quintic": NSMethod(F.orthogonalize),
    "quintic+1e-7": NSMethod(functools.partial(F.orthogonalize, eps=1e-7, eps_added=True)),
    "quintic+1e-8": NSMethod(functools.partial(F.orthogonalize, eps=1e-8, eps_added=True)),
    "gram": NSMethod(F.gram_orthogonalize, flops=gram_flops),
    "aol": NSMethod(F.aol_orthogonalize, flops=aol_flops),
    "cubic": NSMethod(F.cubic_orthogonalize, schedule=F.cubic_schedule, flops=cubic_flops),
}


def method_flops(group: dict, m: int, n: int) -> int:
    """The matmul FLOPs of ``group``'s Newton-Schulz method (``ns_method``, ``ns_steps``) on an ``m x n`` matrix."""
    return NS_METHODS[group["ns_method"]].flops(m, n, group["ns_steps"])


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

