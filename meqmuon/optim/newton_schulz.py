"""Newton-Schulz dispatch of the hidden-matrix rules: which dtype, per matrix or batched, which buffers.

The iteration itself (paper eq. 3: quintic Newton-Schulz, symmetric Gram blocks on CPU, Polar
Express schedules) is pure maths and lives in :func:`meqmuon.functional.orthogonalize`; this module
decides how a step calls it. On CPU it runs matrix by matrix with fused ``addmm`` (torch.optim.Muon's
form): faster there than one batched call per shape, and it makes each matrix's bits independent of
its neighbours, which the DDP split relies on. On the devices of :data:`BATCHED_NS_DEVICES` each
shape bucket is one batched call. Under FSDP2 the splitter (``distributed.ShardedSplit``) moves
whole matrices to owner ranks and calls :func:`orthogonalize_matrices` there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from .. import functional as F
from ..precision import resolve_ns_dtype

__all__ = ["BATCHED_NS_DEVICES", "batched_ns", "ns_dtype_of", "ns_flops", "orthogonalize_each",
           "orthogonalize_matrices", "orthogonalize_bucket"]

#: Device types on which same-shape matrices are orthogonalised as one batched call (a stack per
#: shape bucket; ``functional.orthogonalize(batched=True)``). GPUs: one matmul kernel per matrix is
#: launch-bound for small models (Llama-60M has 56 hidden matrices, so 840 matmul launches per
#: step), and every GPU Muon implementation we surveyed batches by shape (landscape.md); not yet
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


def _ns(x: Tensor, group: dict, workspace: dict | None = None, out: Tensor | None = None) -> Tensor:
    steps, coefficients, dtype = group["ns_steps"], group["ns_coefficients"], ns_dtype_of(group, x)
    batched = x.ndim > 2 and batched_ns(x.device)
    return F.orthogonalize(x, steps, coefficients, dtype, workspace=workspace, out=out, batched=batched)


def orthogonalize_matrices(mats: Tensor, group: dict, workspace: dict | None = None) -> Tensor:
    """NS of a stack ``(k, m, n)`` of same-shape matrices: one batched call where :func:`batched_ns`,
    else matrix by matrix, stacking the (bf16) outputs rather than the (fp32) inputs."""
    if batched_ns(mats.device):
        return _ns(mats, group)
    return torch.stack([_ns(x, group, workspace) for x in mats])


def orthogonalize_bucket(X: Tensor, group: dict) -> Tensor:
    """Newton-Schulz of a bucket's stack ``(k, m, n)`` (already in the NS dtype) in one batched call,
    the batched step's form (``foreach=True``); ``X`` is scratch and is consumed."""
    return F.orthogonalize_stack(X, group["ns_steps"], group["ns_coefficients"], inplace=True)


def orthogonalize_each(
    input_of: Callable[[int], Tensor], shapes: Sequence[tuple[int, int]], group: dict, workspace: dict
) -> Iterator[tuple[int, Tensor]]:
    """Newton-Schulz of every input matrix, yielded one by one as ``(i, Orth(X_i))``.

    Each output is valid until the next one is yielded: same-shape outputs share one buffer
    (a fresh matrix per output costs page faults on CPU), so a caller that keeps one must copy it.
    Where :func:`batched_ns` holds, all inputs are made first, each shape bucket is stacked
    (in the NS dtype) and orthogonalised in one call, and the outputs are yielded by bucket.

    Args:
        input_of: ``input_of(i)`` makes the ``i``-th input (any shape whose matrix view is
            ``shapes[i]``). Called lazily, so only one input need exist at a time.
        shapes: matrix shapes ``(m, n)``.
        group: the param group (``ns_steps``, ``ns_coefficients``, ``ns_dtype``).
        workspace: Newton-Schulz buffers reused by same-shape matrices (``F.orthogonalize``).
    """
    outputs: dict[tuple, Tensor] = {}
    for i in range(len(shapes)):
        x = F.as_matrix(input_of(i))
        if batched_ns(x.device):
            yield from _orthogonalize_buckets(x, input_of, shapes, group)
            return
        dtype = ns_dtype_of(group, x)
        key = (tuple(x.shape), dtype, x.device)
        if key not in outputs:
            outputs[key] = torch.empty(x.shape, dtype=dtype, device=x.device)
        yield i, _ns(x, group, workspace, out=outputs[key])


def _orthogonalize_buckets(
    first: Tensor, input_of: Callable[[int], Tensor], shapes: Sequence[tuple[int, int]], group: dict
) -> Iterator[tuple[int, Tensor]]:
    """Batched NS, one shape bucket at a time: the bucket's inputs are copied into one stack in
    the NS dtype and orthogonalised in one call. ``first`` is input 0, already made."""
    dtype = ns_dtype_of(group, first)
    buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, shape in enumerate(shapes):
        buckets[tuple(shape)].append(i)
    # Input 0 opens the first bucket and is copied before any other input is made, so an
    # input_of that reuses one buffer per shape cannot overwrite it first.
    for shape, idx in buckets.items():
        stack = torch.empty((len(idx), *shape), dtype=dtype, device=first.device)
        for j, i in enumerate(idx):
            stack[j].copy_(first if i == 0 else F.as_matrix(input_of(i)))
        yield from zip(idx, _ns(stack, group), strict=True)
