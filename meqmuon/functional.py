"""Pure tensor maths of MeqMuon and its baselines: no state, no parameters, no torch.optim.

Every function here works on a matrix ``x`` of shape ``(m, n)`` or on a batch of matrices of shape
``(..., m, n)``, and returns tensors of matching batch shape. Equation numbers refer to the paper
*MeqMuon: Matrix-Equilibrating Muon for LLM Pretraining* (Shi, Wang, Li), section 2-3.

Layout convention (paper, section 3.1): for ``nn.Linear`` weights rows are output features and
columns are input features; for embedding matrices and LM heads rows are vocabulary entries.

Zero handling (paper, eq. 5 and below): a row or column whose RMS is at or below
``DELTA = 1e-7`` is treated as zero. It is excluded from the coefficients of variation and the
normalisation operators map it to zero, so zero gradients, zero rows and tiny values never produce
NaN or Inf.

All statistics are computed in at least float32, whatever the input dtype (bf16 inputs are
upcast), and normalised outputs are returned in that computation dtype; callers cast back.

Sharded rows (FSDP2). Functions whose statistics sum over rows (column RMS, CVs over the row
vector, the global RMS) accept ``psum`` and the global row count ``rows``: ``x`` then holds a
contiguous block of rows of the full matrix, ``psum(t)`` sums a tensor of partial sums over all
blocks (an all-reduce), and the result equals the unsharded one up to the rounding of the partial
sums. Sums within a row are local, so row statistics never communicate. With ``psum=None``
(the default) the code path is exactly the unsharded one.

Newton-Schulz orthogonalisation (eq. 3, its schedules, and the other methods an ``ns_method`` names) lives in
:mod:`meqmuon.orthogonalization`; its public names are re-exported here, so ``meqmuon.functional.orthogonalize``
and the rest keep working.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .orthogonalization import (  # noqa: F401  (re-exported: meqmuon.functional.orthogonalize and the rest)
    CUBIC5,
    GRAM_RESTARTS,
    NS_COEFFICIENTS,
    NS_EPS,
    NS_SCHEDULES,
    NS_STEPS,
    POLAR_EXPRESS,
    POLAR_EXPRESS_SAFETY,
    POLAR_EXPRESS_SPEEDRUN,
    SYMMETRIC_MIN,
    Coefficients,
    aol_orthogonalize,
    canonical_coefficients,
    cubic_orthogonalize,
    cubic_schedule,
    gram_orthogonalize,
    ns_schedule,
    ns_step,
    orthogonalize,
    orthogonalize_stack,
)

__all__ = [
    "DELTA", "NS_COEFFICIENTS", "NS_SCHEDULES", "NS_STEPS", "POLAR_EXPRESS", "POLAR_EXPRESS_SPEEDRUN",
    "canonical_coefficients", "ns_schedule", "orthogonalize", "orthogonalize_stack", "ns_step", "row_rms",
    "GRAM_RESTARTS", "gram_orthogonalize", "aol_orthogonalize", "CUBIC5", "cubic_schedule", "cubic_orthogonalize",
    "col_rms", "cv", "cv_of_norms", "MUONEQ_MODES", "muoneq_equilibrate", "row_col_cv", "row_normalize",
    "col_normalize", "equilibrate", "rms_normalize", "adaptive_normalize", "adaptive_normalize_factors",
    "apply_factors", "stat_dtype",
    "as_matrix", "choose_rows", "rms_of_sumsq", "inverse_rms", "row_factors",
    "divisor_of_norms", "momentum_", "direction_input", "decay_", "decay_and_update_",
]

#: RMS values at or below this are treated as zero (paper, text below eq. 5).
DELTA = 1e-7

#: Sums partial statistics over all row shards of a matrix (an all-reduce); ``None``: unsharded.
PSum = Callable[[Tensor], Tensor] | None


def on_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """A tensor of Python ``values`` on ``device``, without a host-device synchronisation.

    ``torch.tensor(values, device="cuda")`` copies with a blocking ``cudaMemcpy``: the host waits for
    every kernel queued before it, which ``torch.cuda.set_sync_debug_mode("error")`` reports as a
    synchronising operation (seen on an H200, tests/test_cuda.py). Built on the CPU in pinned memory and
    copied with ``non_blocking=True``, the copy is a ``cudaMemcpyAsync`` that returns at once: from
    pageable memory "the driver may synchronize with the stream" to stage it (CUDA's "API synchronization
    behavior"), and torch's pinned-memory cache keeps the block until the copy has run. On the CPU (and
    ``meta``) it is ``torch.tensor`` itself, moved.
    """
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t if device.type == "cpu" else t.to(device)
    if torch.compiler.is_compiling():  # traced into a graph, as on GPUs it has run (calls 2-6, issue 49)
        return t.to(device, non_blocking=True)
    return t.pin_memory().to(device, non_blocking=True)


def stat_dtype(x: Tensor) -> torch.dtype:
    """Dtype for statistics: float64 stays float64, everything else is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def as_matrix(x: Tensor) -> Tensor:
    """View a parameter-shaped tensor as the matrix the optimizer works on.

    2-D tensors are returned unchanged; 3-D+ tensors (convolutions) become ``(shape[0], -1)``,
    as in Muon implementations (Jordan et al., 2024).
    """
    if x.ndim < 2:
        raise ValueError(f"as_matrix needs a tensor with at least 2 dimensions, got shape {tuple(x.shape)}")
    # Explicit column count (not -1) so that an empty row shard (0 rows under FSDP2) still reshapes.
    return x if x.ndim == 2 else x.reshape(x.shape[0], math.prod(x.shape[1:]))


def row_rms(x: Tensor) -> Tensor:
    r"""Row RMS magnitudes ``r_i = \|X_{i,:}\|_2 / \sqrt{n}`` (paper eq. 4); shape ``(..., m)``."""
    # vector_norm reduces in one pass with a float32 (or float64) accumulator, without
    # materialising x**2: the squares dominated the eager step (benchmarks/step_time.py profile).
    return torch.linalg.vector_norm(x, dim=-1, dtype=stat_dtype(x)) / math.sqrt(x.shape[-1])


def col_rms(x: Tensor, psum: PSum = None, rows: int | None = None) -> Tensor:
    r"""Column RMS magnitudes ``c_j = \|X_{:,j}\|_2 / \sqrt{m}`` (paper eq. 4); shape ``(..., n)``.

    With ``psum`` (rows sharded), ``m = rows`` is the global row count and the column sums of
    squares are summed over shards.
    """
    x = x.to(stat_dtype(x))
    # Not vector_norm(dim=-2): its strided column reduction is ~2x slower on CPU (docs/benchmarks.md).
    return rms_of_sumsq((x * x).sum(dim=-2), x.shape[-2] if psum is None else rows, psum)


def rms_of_sumsq(sumsq: Tensor, count: int, psum: PSum = None) -> Tensor:
    r"""RMS magnitudes ``\sqrt{s / count}`` from sums of squares ``s`` (paper eq. 4); with ``psum`` the
    sums are partial (one row shard's) and are summed over shards first (``count``: global)."""
    return ((sumsq if psum is None else psum(sumsq)) / count).sqrt()


def cv(v: Tensor, delta: float = DELTA) -> Tensor:
    r"""Coefficient of variation of the entries of ``v`` above ``delta`` (paper eq. 5).

    .. math::
        \bar v = \frac{1}{k_+}\sum_{i: v_i > \delta} v_i,\qquad
        \gamma = \frac{\sqrt{\frac{1}{k_+}\sum_{i: v_i>\delta}(v_i-\bar v)^2}}{\bar v}

    The standard deviation is the population one (``1/k_+``). Reduces over the last dimension. If no
    entry exceeds ``delta`` the CV is defined as 0 (nothing to balance). Computed by
    :func:`cv_of_norms`, the one implementation of eq. 5 (RMS values are norms at scale 1).
    """
    return cv_of_norms(v.to(stat_dtype(v)), delta)


#: MuonEq's equilibration modes (arXiv 2603.28254; MaeChd/muon-eq 99b6c8b, ``muoneq.py``): rows,
#: columns, or both.
MUONEQ_MODES = ("R", "C", "RC")
#: MuonEq adds this to the squared row/column norms before the power -1/2 (``rowcol_eps``).
MUONEQ_EPS = 1e-8


def muoneq_equilibrate(x: Tensor, mode: str) -> Tensor:
    r"""MuonEq's pre-Newton-Schulz equilibration of the direction input (a new tensor, >= float32).

    With row and column squared norms ``s_i = \sum_j X_ij^2``, ``t_j = \sum_i X_ij^2`` of the same
    input (MaeChd/muon-eq 99b6c8b ``muoneq.py``, exponent -1/2, ``rowcol_eps = 1e-8``, no clipping):

    - ``"R"``:  ``X_ij (s_i + eps)^{-1/2}``  (every row to unit L2 norm)
    - ``"C"``:  ``X_ij (t_j + eps)^{-1/2}``
    - ``"RC"``: ``X_ij (s_i + eps)^{-1/2} (t_j + eps)^{-1/2}``: one two-sided scaling, both from the
      original ``X`` (not sequential, not Sinkhorn).

    Batched over leading dimensions.
    """
    if mode not in MUONEQ_MODES:
        raise ValueError(f"unknown MuonEq mode {mode!r}; valid modes: {', '.join(MUONEQ_MODES)}")
    x = x.to(stat_dtype(x))
    sq = x.square()
    out = x
    if mode in ("R", "RC"):
        out = out * (sq.sum(dim=-1, keepdim=True) + MUONEQ_EPS).rsqrt()
    if mode in ("C", "RC"):
        out = out * (sq.sum(dim=-2, keepdim=True) + MUONEQ_EPS).rsqrt()
    return out


def cv_of_norms(norms: Tensor, threshold: Tensor | float, mask: Tensor | None = None) -> Tensor:
    r"""The CV (eq. 5) of RMS magnitudes given as norms: ``cv(norms / s)`` for any ``s > 0``.

    A CV is invariant to a common scale, so the row (or column) Euclidean norms give the CV of the
    row RMS vector ``r = norms / sqrt(n)`` without dividing. An entry counts as zero where its norm
    is at or below ``threshold`` (``delta * sqrt(n)``, i.e. ``r_i <= delta``); zero padding is
    therefore excluded too, which lets vectors of several lengths share one padded tensor (the
    batched MeqMuon step computes every hidden matrix's row and column CVs in one call this way).
    Reduces over the last dimension; 0 where no entry counts. Same maths as :func:`cv`, with the
    standard deviation taken as the norm of the masked deviations. ``mask``: ``norms > threshold``, if
    the caller has it already.
    """
    mask = norms > threshold if mask is None else mask
    count = mask.sum(dim=-1, dtype=norms.dtype).clamp_(min=1.0)
    kept = norms * mask
    mean = kept.sum(dim=-1) / count
    spread = torch.linalg.vector_norm((kept - mean.unsqueeze(-1)).mul_(mask), dim=-1)
    # Where nothing counts, spread and mean are both 0: the clamp makes the CV 0 (as `cv`), and it
    # never binds otherwise (mean > threshold >= 0 there, and threshold is a norm of a kept entry).
    return spread / (count.sqrt_() * mean).clamp_(min=torch.finfo(norms.dtype).tiny)


def row_col_cv(x: Tensor, delta: float = DELTA) -> tuple[Tensor, Tensor]:
    """Row and column CVs ``(gamma_r, gamma_c)`` of ``x`` (paper eq. 4-5); each of shape ``x.shape[:-2]``."""
    return cv(row_rms(x), delta), cv(col_rms(x), delta)


def inverse_rms(v: Tensor, delta: float = DELTA) -> Tensor:
    """``1/v`` where ``v > delta``, else 0: rows/columns treated as zero are mapped to zero (eq. 5, 7);
    the reciprocal of :func:`divisor_of_norms`, the one zero rule."""
    return divisor_of_norms(v, delta).reciprocal()


def row_factors(x: Tensor, delta: float = DELTA) -> Tensor:
    r"""The factors ``r^{-1}`` of ``N_r`` (paper eq. 7): one per row, 0 for zero rows; shape ``(..., m)``."""
    return inverse_rms(row_rms(x), delta)


def divisor_of_norms(norms: Tensor, threshold: float) -> Tensor:
    """``norms`` as divisors that zero what they divide where ``norms <= threshold`` (x / inf = 0): the
    zero rule of eq. 5, written once (``r_i <= delta`` is ``||X_i,:|| <= delta sqrt(n)``; :func:`inverse_rms`
    is its reciprocal)."""
    return norms.masked_fill(norms <= threshold, math.inf)


def row_normalize(x: Tensor, delta: float = DELTA) -> Tensor:
    r"""``N_r(X) = diag(r^{-1}) X`` (paper eq. 7): every nonzero row rescaled to unit RMS."""
    x = x.to(stat_dtype(x))
    return x * row_factors(x, delta).unsqueeze(-1)


def col_normalize(x: Tensor, delta: float = DELTA, psum: PSum = None, rows: int | None = None) -> Tensor:
    r"""``N_c(X) = X diag(c^{-1})`` (paper eq. 7): every nonzero column rescaled to unit RMS."""
    x = x.to(stat_dtype(x))
    return x * inverse_rms(col_rms(x, psum, rows), delta).unsqueeze(-2)


def equilibrate(x: Tensor, delta: float = DELTA, psum: PSum = None, rows: int | None = None, *,
                scale: float = 1.0, inplace: bool = False) -> Tensor:
    r"""Two-sided normalisation ``scale N_c(N_r(X))`` (paper eq. 9), for embeddings and LM heads; batched
    over leading dimensions. The one implementation of eq. 9: the batched and compiled steps call it on
    stacks, the per-tensor step's row-blocked form (``optim/blockwise.py``) takes the same statistics
    block by block.

    With ``Y = X / ||X_i,:||`` (each row to unit norm), ``N_c(N_r(X)) = sqrt(m) Y / ||Y_:,j||``, so only
    norms and two scalings touch ``X``; the zero rule (eq. 5) is ``r_i <= delta`` <=> ``||X_i,:|| <= delta
    sqrt(n)`` and ``c_j <= delta`` <=> ``||Y_:,j|| <= delta sqrt(m / n)`` (:func:`divisor_of_norms`).
    The result has unit-RMS columns (column CV 0) and, for a non-degenerate input, overall RMS 1 (times
    ``scale``).

    ``psum``, ``rows``: ``x`` is a row shard of a matrix of ``rows`` rows; column statistics are summed
    over shards. ``inplace``: ``x`` (float32 or float64) is scratch and becomes the result.
    """
    x = x if inplace else x.to(stat_dtype(x), copy=True)
    m, n = (x.shape[-2] if psum is None else rows), x.shape[-1]
    x.div_(divisor_of_norms(torch.linalg.vector_norm(x, dim=-1), delta * math.sqrt(n)).unsqueeze(-1))
    col = torch.linalg.vector_norm(x, dim=-2) if psum is None else psum(x.square().sum(dim=-2)).sqrt_()
    # The scale rides on the column divisor: no pass of its own over X.
    x.div_(divisor_of_norms(col, delta * math.sqrt(m / n)).div_(scale * math.sqrt(m)).unsqueeze(-2))
    return x


def rms_normalize(x: Tensor, delta: float = DELTA, psum: PSum = None, numel: int | None = None, *,
                  scale: float = 1.0, inplace: bool = False) -> Tensor:
    r"""Global-RMS normalisation ``scale N(B) = scale B / (\|B\|_2 / \sqrt{d})`` (paper eq. 10) of each row
    of ``x`` ``(K, d)``, a stack of flattened 1-D parameters: the one implementation of eq. 10 (the
    per-tensor step hands a stack of one). A vector whose RMS is at or below ``delta`` maps to zero.

    ``psum``, ``numel``: each row is a shard of a vector of ``numel`` elements; sums of squares are summed
    over shards. ``inplace``: ``x`` (float32 or float64) is scratch and becomes the result.
    """
    x = x if inplace else x.to(stat_dtype(x), copy=True)
    d = x.shape[-1] if psum is None else numel
    norm = torch.linalg.vector_norm(x, dim=-1) if psum is None else psum(x.square().sum(dim=-1)).sqrt_()
    # The scale rides on the divisor: no pass of its own over x.
    return x.div_(divisor_of_norms(norm, delta * math.sqrt(d)).div_(scale * math.sqrt(d)).unsqueeze(-1))


def choose_rows(gamma_r: Tensor, gamma_c: Tensor, out: Tensor | None = None) -> Tensor:
    """MeqMuon's side choice (paper eq. 8): normalise rows where ``gamma_r >= gamma_c`` (ties: rows).

    A tensor, never a Python branch: no host-device synchronisation. ``out`` (e.g. int64) receives it."""
    return torch.ge(gamma_r, gamma_c, out=out)


def adaptive_normalize(u: Tensor, delta: float = DELTA, rho: float = 1.0) -> tuple[Tensor, Tensor]:
    r"""MeqMuon's adaptive one-sided normalisation of an orthogonalised update (paper eq. 8), times ``rho``.

    .. math::
        \tilde U = N_r(U)\ \text{if}\ \gamma_r(U) \ge \gamma_c(U)\ \text{else}\ N_c(U)

    Ties choose rows. Batched over leading dimensions: each matrix chooses independently
    (:func:`adaptive_normalize_stacks`, of which this is the one-stack form).

    Returns:
        ``(u_tilde, chose_rows)``: the normalised update (float32, or float64 for float64 input)
        and a bool tensor of shape ``u.shape[:-2]``, True where rows were normalised.
    """
    (out,), chose = adaptive_normalize_stacks([u.reshape(-1, *u.shape[-2:])], delta, rho)
    return out.reshape(u.shape), chose.reshape(u.shape[:-2])


#: Rows per block of the CPU column sums of squares in :func:`adaptive_normalize_stacks`: a 128-row block
#: of a float32 matrix of 512 columns is 256 KB, a temporary the allocator reuses block after block, where
#: a matrix-sized one costs page faults on CPU.
COL_BLOCK = 128


def _eq8_values(lengths: tuple[tuple[float, float], ...], delta: float, rho: float) -> list:
    return [[[delta * r, rho * r, 1.0], [delta * c, rho * c, 0.0]] for r, c in lengths]


@functools.lru_cache(maxsize=64)
def _eq8_constants(lengths: tuple[tuple[float, float], ...], delta: float, rho: float, device: torch.device,
                   dtype: torch.dtype) -> Tensor:
    """:func:`adaptive_normalize_stacks`' constants, made once per shapes and values and kept (read only): a
    step then copies nothing from the host, which a CUDA graph capture forbids (``cuda_graph=True``: "Cannot
    copy between CPU and CUDA tensors during CUDA graph capture", an H100) and which costs a launch."""
    return on_device(_eq8_values(lengths, delta, rho), device, dtype)


def adaptive_normalize_stacks(us: Sequence[Tensor], delta: float = DELTA,
                              rho: float = 1.0) -> tuple[list[Tensor], Tensor]:
    """Eq. 8 of every matrix of several stacks ``(k_i, m_i, n_i)`` at once, in a fixed number of kernels.

    The row and column norms of all ``K`` matrices go into one zero-padded ``(K, 2, L)`` buffer (slot 0:
    the ``m`` row norms of ``n`` entries each; slot 1: the ``n`` column norms), so one
    :func:`cv_of_norms` gives all ``2K`` CVs (eq. 5: norms at or below ``delta sqrt(length)``, i.e.
    RMS <= delta, and the padding count as zero). The factors ``rho / RMS`` (0 for zero rows or
    columns) multiply the chosen side, 1 the other: two passes over each stack, ``(U * row) * col``
    (:func:`apply_factors`; :func:`adaptive_normalize_factors` gives the factors alone).

    Returns:
        the normalised stacks (float32, or float64) and ``chose_rows`` ``(K,)`` bool, stack by stack.
    """
    xs, factors, chose_rows = _eq8(us, delta, rho, keep_copies=True)
    return [apply_factors(u, row, col, x) for u, x, (row, col) in zip(us, xs, factors, strict=True)], chose_rows


def adaptive_normalize_factors(us: Sequence[Tensor], delta: float = DELTA,
                               rho: float = 1.0) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """Eq. 8's factors of every matrix of stacks ``us`` without applying them: per stack ``(row, col)``,
    ``(k, m, 1)`` and ``(k, 1, n)`` (float32, or float64), one of the two all ones per matrix, such that
    :func:`apply_factors` gives :func:`adaptive_normalize_stacks`' output bit for bit, on the whole
    matrix or on any block of its rows and columns. An FSDP2 owner sends ``U`` in the Newton-Schulz dtype
    and these instead of a float32 ``D`` (``sharded.py``). Returns ``(factors, chose_rows)``."""
    _, factors, chose_rows = _eq8(us, delta, rho, keep_copies=False)
    return factors, chose_rows


def apply_factors(u: Tensor, row: Tensor, col: Tensor, x: Tensor | None = None, divide: bool = False,
                  out: Tensor | None = None) -> Tensor:
    """``(U * row) * col`` at least in float32: eq. 8's one product, each element ``u_ij`` times ``row_i``
    rounded, then times ``col_j`` (the order every rank that applies the factors to its block keeps);
    ``divide``: ``(U / row) * col`` (NorMuon's division, ``rules/normuon.py``). ``x``: ``U``'s float32 copy,
    scaled in place (CPU: the same products as ``U`` times the factors, since bf16 -> float32 is exact, without
    a fresh matrix-sized temporary, page faults on CPU); ``out``: where the product goes instead (``x`` None)."""
    op = torch.div if divide else torch.mul
    if x is None or x is u:
        # a transposed side (GPU): the first product written in the members' layout, so no copy follows
        x = op(u, row, out=out if out is not None else torch.empty(u.shape, dtype=row.dtype, device=u.device))
    else:
        x.div_(row) if divide else x.mul_(row)
    return x.mul_(col)


def _eq8(us: Sequence[Tensor], delta: float, rho: float, *,
         keep_copies: bool) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]], Tensor]:
    """Eq. 8's statistics of stacks ``us``: per stack the float32 copy its norms were taken from (CPU, where
    ``keep_copies``; else ``U`` itself), its ``(row, col)`` factors, and ``chose_rows`` ``(K,)``."""
    dtype, device = torch.float64 if us[0].dtype == torch.float64 else torch.float32, us[0].device  # stat_dtype
    shapes = [u.shape for u in us]
    L = max(max(m, n) for _, m, n in shapes)
    norms = torch.zeros((sum(k for k, _, _ in shapes), 2, L), dtype=dtype, device=device)
    # Per matrix, per slot: sqrt(length) (RMS = norm / sqrt(length)) times delta (the zero threshold) or rho.
    lengths = [(math.sqrt(n), math.sqrt(m)) for k, m, n in shapes for _ in range(k)]
    # One host-to-device copy for the three (K, 2, 1) constants: the zero thresholds, the factors' numerators
    # and which slot holds the rows (1.0, else 0.0; compared with the bool choice below, promoted).
    consts = (on_device(_eq8_values(tuple(lengths), delta, rho), device, dtype) if torch.compiler.is_compiling()
              else _eq8_constants(tuple(lengths), delta, rho, device, dtype))
    threshold, factor, row_slot = consts[..., :1], consts[..., 1:2], consts[..., 2:]
    # CPU: U is cast once into a float32 copy (a bf16 U: Newton-Schulz's output where the CPU runs bf16
    # natively), which gives the row norms, the column sums of squares block by block (COL_BLOCK rows) and
    # then becomes the result in place: torch.linalg.vector_norm(dim=-2) is a strided reduction that took
    # 7.9 ms for one bf16 1376 x 512 matrix against 0.6 ms, and a bf16 U times float32 factors casts U
    # through a fresh copy (docs/benchmarks.md, issue 35). Other devices reduce and scale U directly (the
    # form the op count, a proxy for GPU launches, counts).
    cpu = device.type == "cpu"
    xs, o = [], 0
    for u, (k, m, n) in zip(us, shapes, strict=True):
        # contiguous_format: a transposed side (a view) becomes its members' own layout in this one pass, which
        # the caller would otherwise copy again (driver.directions' .contiguous())
        x = u.to(dtype, copy=True, memory_format=torch.contiguous_format) if cpu else u
        for slot, dim, size in ((0, -1, m), (1, -2, n)):
            squares = cpu and slot == 1
            if torch.compiler.is_compiling():  # dynamo takes no strided out=
                norms[o : o + k, slot, :size] = torch.sum(x * x, dim=dim) if squares else \
                    torch.linalg.vector_norm(x, dim=dim, dtype=dtype)
            elif squares:
                acc = norms[o : o + k, slot, :size]
                for block in x.split(COL_BLOCK, dim=-2):
                    acc.add_(torch.sum(block * block, dim=-2))
            else:
                torch.linalg.vector_norm(x, dim=dim, dtype=dtype, out=norms[o : o + k, slot, :size])
        xs.append(x if keep_copies else u)
        o += k
    if cpu:
        norms[:, 1].sqrt_()  # the column norms from their sums of squares (padding: sqrt(0) = 0)
    counted = norms > threshold  # eq. 5: what is at or below delta counts as zero, and normalises to zero
    gamma = cv_of_norms(norms, threshold, counted)
    chose_rows = choose_rows(gamma[:, 0], gamma[:, 1])
    scales = torch.where(counted, torch.div(factor, norms), 0.0)
    scales.masked_fill_(chose_rows[:, None, None] != row_slot, 1.0)  # 1 on the side not chosen
    factors, o = [], 0
    for k, m, n in shapes:
        factors.append((scales[o : o + k, 0, :m, None], scales[o : o + k, 1, None, :n]))
        o += k
    return xs, factors, chose_rows


# ---- the step every momentum rule shares: momentum, direction input, decoupled decay and update ----
#
# Each takes lists, so that the per-tensor forms (lists of one), the batched forms (whole buckets)
# and the compiled graphs (0-D tensor hyperparameters) run the one definition.


def momentum_(bufs: Sequence[Tensor], grads: Sequence[Tensor], mu: float | Tensor, fused: bool = False) -> None:
    """``B <- mu B + G`` in place for every buffer (paper eq. 6; Moonlight's convention).

    ``fused``: one pass per tensor (``torch.add(G, B, alpha=mu, out=B)``), the per-tensor step's form;
    else two ``torch._foreach_*`` kernels for all buffers (the batched form; other rounding of the FMA).
    """
    if fused:
        for b, g in zip(bufs, grads, strict=True):
            torch.add(g, b, alpha=mu, out=b)
        return
    torch._foreach_mul_(list(bufs), mu)
    torch._foreach_add_(list(bufs), list(grads))


def direction_input(
    grads: Sequence[Tensor], bufs: Sequence[Tensor], mu: float | Tensor, nesterov: bool,
    out: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """The momentum rules' direction inputs: ``G + mu B`` with Nesterov, else ``B`` itself (eq. 6).

    ``out``: buffers that receive ``G + mu B`` (one per tensor; no fresh temporaries), else new tensors.
    """
    if not nesterov:
        return list(bufs)
    if isinstance(mu, Tensor):  # compiled graphs: a 0-D tensor mu, which ``alpha`` cannot take
        return torch._foreach_add(torch._foreach_mul(list(bufs), mu), list(grads))
    if out is not None:
        return [torch.add(g, b, alpha=mu, out=o) for g, b, o in zip(grads, bufs, out, strict=True)]
    return torch._foreach_add(list(grads), list(bufs), alpha=mu)


def decay_(params: Sequence[Tensor], factor: float | Tensor) -> None:
    """Decoupled weight decay ``W <- factor W`` with ``factor = 1 - lr wd``, for every parameter."""
    if isinstance(factor, Tensor) or all(p.dtype in (torch.float32, torch.float64) for p in params):
        torch._foreach_mul_(list(params), factor)
    else:  # one tensor at a time: torch._foreach_mul_ rounds the factor to bf16 (1 - 1e-3 became 1)
        for p in params:
            p.mul_(factor)


def decay_and_update_(
    params: Sequence[Tensor], directions: Sequence[Tensor], lr: float | Sequence[float] | Tensor,
    weight_decay: float | Sequence[float] | Tensor, scales: Sequence[float] | Tensor, col: Tensor | None = None,
) -> None:
    r"""``W <- (1 - lr wd) W - lr s D`` for every parameter (decoupled weight decay, unadjusted lr).

    ``lr``, ``weight_decay``: one value for all, or one per parameter; ``scales``: one ``s`` per
    parameter. One decay kernel per distinct ``1 - lr wd``, then one add per distinct ``lr s``.
    Compiled graphs pass 0-D tensors (values unknown while tracing): ``lr``, ``weight_decay`` and
    one ``scales`` for all. ``col``: a factor that multiplies every direction inside the add
    (``addcmul``), sparing a pass over the matrix.
    """
    if isinstance(lr, Tensor):
        decay_(params, 1 - lr * weight_decay)
        torch._foreach_add_(list(params), torch._foreach_mul(list(directions), -(lr * scales)))
        return
    lrs = lr if isinstance(lr, Sequence) else [lr] * len(params)
    wds = weight_decay if isinstance(weight_decay, Sequence) else [weight_decay] * len(params)
    if lrs and isinstance(lrs[0], Tensor):  # cuda_graph=True: each group's 0-D device tensors (optim/cuda_graph.py)
        _decay_and_update_on_device(params, directions, lrs, wds, scales)
        return
    decays: dict[float, list[Tensor]] = {}
    adds: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for p, d, lr_p, wd_p, s in zip(params, directions, lrs, wds, scales, strict=True):
        if wd_p != 0:
            decays.setdefault(1.0 - lr_p * wd_p, []).append(p)
        ps, ds = adds.setdefault(-lr_p * s, ([], []))
        ps.append(p)
        ds.append(d)
    for factor, ps in decays.items():
        decay_(ps, factor)
    for alpha, (ps, ds) in adds.items():
        if col is None:
            torch._foreach_add_(ps, ds, alpha=alpha)
        else:
            torch._foreach_addcmul_(ps, ds, [col] * len(ds), value=alpha)


def _decay_and_update_on_device(params: Sequence[Tensor], directions: Sequence[Tensor], lrs: Sequence[Tensor],
                                wds: Sequence[Tensor | float], scales: Sequence[float]) -> None:
    """:func:`decay_and_update_` with per-parameter 0-D tensor ``lr`` (and ``weight_decay``, or a number 0:
    no decay), one tensor per param group: one decay kernel per group, one scaled add per group and ``s``."""
    decays: dict[tuple[int, int], tuple[Tensor, Tensor | float, list[Tensor]]] = {}
    adds: dict[tuple[int, float], tuple[Tensor, float, list[Tensor], list[Tensor]]] = {}
    for p, d, lr_p, wd_p, s in zip(params, directions, lrs, wds, scales, strict=True):
        if isinstance(wd_p, Tensor) or wd_p != 0:
            decays.setdefault((id(lr_p), id(wd_p)), (lr_p, wd_p, []))[2].append(p)
        entry = adds.setdefault((id(lr_p), s), (lr_p, s, [], []))
        entry[2].append(p)
        entry[3].append(d)
    for lr_p, wd_p, ps in decays.values():
        torch._foreach_mul_(ps, 1 - lr_p * wd_p)
    for lr_p, s, ps, ds in adds.values():
        torch._foreach_add_(ps, torch._foreach_mul(ds, -(lr_p * s)))
