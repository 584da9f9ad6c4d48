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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DELTA", "NS_COEFFICIENTS", "NS_SCHEDULES", "NS_STEPS", "POLAR_EXPRESS", "POLAR_EXPRESS_SPEEDRUN",
    "canonical_coefficients", "ns_schedule", "orthogonalize", "orthogonalize_stack", "ns_step", "row_rms",
    "GRAM_RESTARTS", "gram_orthogonalize", "aol_orthogonalize", "CUBIC5", "cubic_schedule", "cubic_orthogonalize",
    "col_rms", "cv", "cv_of_norms", "MUONEQ_MODES", "muoneq_equilibrate", "row_col_cv", "row_normalize",
    "col_normalize", "equilibrate", "rms_normalize", "adaptive_normalize",
    "as_matrix", "choose_rows", "rms_of_sumsq", "inverse_rms", "row_factors",
    "divisor_of_norms", "momentum_", "direction_input", "decay_", "decay_and_update_",
]

#: RMS values at or below this are treated as zero (paper, text below eq. 5).
DELTA = 1e-7
#: Quintic Newton-Schulz coefficients (a, b, c) of Jordan et al. (2024), used by Moonlight,
#: torch.optim.Muon and the paper (section 2, eq. 3).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: Number of Newton-Schulz iterations K (paper, section 2 and section 4).
NS_STEPS = 5

#: Polar Express (Amsel, Persson, Musco, Gower, arXiv 2505.16932, Algorithm 1; the authors' code
#: NoahAmsel/PolarExpress 7f0fb57 ``polar_express/basic.py``): one quintic ``(a, b, c)`` per
#: iteration, optimal for singular values in [1e-3, 1], before the safety factor. The last entry is
#: the one later iterations repeat (the authors' rule for more than 8 steps).
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
#: Safety factor of Polar Express (paper section 4.4): every polynomial but the last becomes
#: ``x -> p(x / 1.01)``, i.e. ``(a / 1.01, b / 1.01^3, c / 1.01^5)``, and the input is divided by
#: ``1.01 ||X||_F``, so that bf16 rounding cannot push a singular value past the interval.
POLAR_EXPRESS_SAFETY = 1.01
#: The schedule ``ns_coefficients="polar_express"`` runs, safety factor applied.
POLAR_EXPRESS = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)
#: The 5-step list of KellerJordan/modded-nanogpt ``train_gpt.py`` (0016a3c) and karpathy/nanochat
#: ``nanochat/optim.py``: the same method generated for 5 iterations with a 1.02 safety factor folded
#: into the recursion (their inputs are divided by ``1.02 ||X||_F``). Pass it as an explicit list
#: (``ns_coefficients=POLAR_EXPRESS_SPEEDRUN``) to compare with those stacks.
POLAR_EXPRESS_SPEEDRUN = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
#: Named coefficient schedules accepted as ``ns_coefficients``.
NS_SCHEDULES = ("polar_express",)

Coefficients = tuple[float, float, float] | str | tuple[tuple[float, float, float], ...]


def ns_schedule(coefficients: Any, steps: int) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """The per-iteration coefficients and the input scale of ``steps`` Newton-Schulz iterations.

    ``coefficients`` is one ``(a, b, c)`` (repeated every iteration: Jordan et al.'s quintic, the
    default), ``"polar_express"`` (:data:`POLAR_EXPRESS`: its first ``steps`` entries, the last
    repeated beyond 8, and the input divided by ``1.01 ||X||_F``), or an explicit sequence of
    ``steps`` triples. Returns ``(schedule, scale)``: the input is divided by ``max(scale ||X||_F, eps)``.

    Raises:
        ValueError: for anything else, naming the valid forms.
    """
    valid = (f"valid: three numbers (a, b, c), one of {list(NS_SCHEDULES)}, or a list of {steps} "
             "(a, b, c) triples (one per ns_steps iteration)")
    if isinstance(coefficients, str):
        if coefficients != "polar_express":
            raise ValueError(f"unknown ns_coefficients {coefficients!r}; {valid}")
        schedule = POLAR_EXPRESS[:steps] + (POLAR_EXPRESS[-1],) * max(0, steps - len(POLAR_EXPRESS))
        return schedule, POLAR_EXPRESS_SAFETY

    def triple(t: Any) -> bool:
        return (isinstance(t, tuple | list) and len(t) == 3
                and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in t))

    if triple(coefficients):
        return (tuple(float(v) for v in coefficients),) * steps, 1.0
    if isinstance(coefficients, tuple | list) and coefficients and all(triple(t) for t in coefficients):
        if len(coefficients) != steps:
            raise ValueError(f"ns_coefficients has {len(coefficients)} (a, b, c) triples for ns_steps={steps}; {valid}")
        return tuple(tuple(float(v) for v in t) for t in coefficients), 1.0
    raise ValueError(f"invalid ns_coefficients {coefficients!r}; {valid}")


#: :func:`ns_schedule` computed once per ``(coefficients, steps)``: a step asks for it per matrix.
_cached_schedule = functools.lru_cache(maxsize=64)(ns_schedule)


def _schedule(coefficients: Any, steps: int) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """:func:`ns_schedule`, cached; lists (unhashable) are looked up as their tuples.

    Under ``torch.compile`` the schedule is computed directly: Dynamo runs plain Python once, at
    trace time, so the cache saves nothing there, and tracing through an ``lru_cache`` wrapper makes
    Dynamo print an 8-line warning on every ``compile=True`` optimizer (``tests/test_compile.py``)."""
    if torch.compiler.is_compiling():
        return ns_schedule(coefficients, steps)
    hashable = isinstance(coefficients, str) or not any(isinstance(t, list) for t in (coefficients, *coefficients))
    return _cached_schedule(coefficients if hashable else canonical_coefficients(coefficients), steps)


def canonical_coefficients(coefficients: Any) -> Coefficients:
    """``ns_coefficients`` as stored in a param group: a name, one triple, or a tuple of triples
    (lists become tuples, so that groups compare and hash the same whatever the caller passed)."""
    if isinstance(coefficients, str):
        return coefficients
    if isinstance(coefficients, tuple | list) and coefficients and isinstance(coefficients[0], tuple | list):
        return tuple(tuple(t) for t in coefficients)
    return tuple(coefficients)
#: Sums partial statistics over all row shards of a matrix (an all-reduce); ``None``: unsharded.
PSum = Callable[[Tensor], Tensor] | None

#: Lower bound on the Frobenius norm in the Newton-Schulz pre-normalisation; torch.optim.Muon
#: clamps the norm at this value (``eps=1e-7``), so a zero matrix maps to zero. The official repos
#: add it instead (``||X|| + 1e-7``): 1.9e-3 relative apart at ``||X|| = 1e-4`` (docs/algorithm.md).
NS_EPS = 1e-7


def on_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """A tensor of Python ``values`` on ``device``, without a host-device synchronisation.

    ``torch.tensor(values, device="cuda")`` copies with a blocking ``cudaMemcpy``: the host waits for
    every kernel queued before it, which ``torch.cuda.set_sync_debug_mode("error")`` reports as a
    synchronising operation (seen on an H200, tests/test_cuda.py). Built on the CPU and copied with
    ``non_blocking=True``, the copy is a ``cudaMemcpyAsync`` from pageable memory, which CUDA stages
    at once without waiting for the stream. On the CPU it is ``torch.tensor`` itself.
    """
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _stat_dtype(x: Tensor) -> torch.dtype:
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


def orthogonalize(
    x: Tensor,
    steps: int = NS_STEPS,
    coefficients: Coefficients = NS_COEFFICIENTS,
    dtype: torch.dtype | None = torch.bfloat16,
    eps: float = NS_EPS,
    workspace: dict | None = None,
    out: Tensor | None = None,
    batched: bool = False,
    inplace: bool = False,
) -> Tensor:
    r"""Approximate ``Orth(x) = P Q^T`` (for ``x = P S Q^T``) with quintic Newton-Schulz (paper eq. 3).

    .. math::
        X_0 = X / \max(\|X\|_F, \epsilon),\quad A_k = X_k X_k^\top,\quad
        X_{k+1} = a X_k + (b A_k + c A_k^2) X_k,\quad k = 0..K-1.

    ``A_k`` is the smaller Gram matrix: for a tall input the iteration uses ``X_k^T X_k`` on the
    right, which equals torch.optim.Muon's and Keller Jordan's ``zeropower_via_newtonschulz5``
    transpose-iterate-transpose without the transposing copies. Leading dimensions are a batch,
    iterated matrix by matrix unless ``batched``.

    Args:
        x: matrix ``(m, n)`` or batch ``(..., m, n)``.
        steps: number of iterations ``K`` (>= 1).
        coefficients: ``(a, b, c)`` for every iteration, ``"polar_express"``, or one triple per
            iteration (see :func:`ns_schedule`).
        dtype: compute dtype of the iteration; ``None`` keeps ``x.dtype``. bf16 is the default of
            torch.optim.Muon and Moonlight; use float32/float64 for reference computations.
        eps: lower bound on the Frobenius norm (a zero input returns zero).
        workspace: optional dict in which the iteration keeps its buffers between calls; pass the
            same dict for a series of matrices to reuse them.
        out: optional contiguous tensor of ``x``'s shape in ``dtype`` for the result (else a new
            one). Reusing one for a series of matrices avoids a fresh allocation per matrix, which
            on CPU costs page faults.
        batched: iterate a batch as one stack (``bmm``/``baddbmm``, three batched matmuls per
            iteration) instead of matrix by matrix. Fewer, larger kernels: what GPUs want when
            there are many small matrices. On CPU the per-matrix loop is faster, and it
            keeps each matrix's bits independent of the batch it travels in (see below).
        inplace: with ``batched``, ``x`` is scratch: a 3-D ``x`` in ``dtype`` is iterated in place
            (:func:`orthogonalize_stack`) instead of copied first.

    Returns:
        The approximate orthogonalisation, same shape as ``x``, in ``dtype``.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    if steps < 1:
        raise ValueError(f"orthogonalize: steps must be >= 1, got {steps}")
    dtype = dtype or x.dtype
    if out is not None and (out.shape != x.shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(
            f"orthogonalize: out must be a contiguous {tuple(x.shape)} tensor of dtype {dtype}, "
            f"got {tuple(out.shape)} {out.dtype} (contiguous={out.is_contiguous()})"
        )
    if x.ndim > 2 and batched:
        stack = x.reshape(-1, *x.shape[-2:]).to(dtype, copy=not inplace)
        X = orthogonalize_stack(stack, steps, coefficients, eps, inplace=True).reshape(x.shape)
        return X if out is None else out.copy_(X)
    schedule = _schedule(coefficients, steps)
    if x.ndim == 2:
        return _orthogonalize_matrix(x, schedule, dtype, eps, workspace, out)
    # One matrix at a time with fused addmm, exactly torch.optim.Muon's iteration: faster on CPU than
    # one batched call (docs/benchmarks.md). It also makes each matrix's bits independent of the
    # batch it travels in, which the DDP split relies on for bit-exactness with one process (a
    # batched baddbmm broke that for some inputs).
    flat = x.reshape(-1, *x.shape[-2:])
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    flat_out = out.view(flat.shape)
    for i in range(flat.shape[0]):
        _orthogonalize_matrix(flat[i], schedule, dtype, eps, workspace, flat_out[i])
    return out


def _orthogonalize_matrix(
    x: Tensor,
    schedule: tuple[tuple[tuple[float, float, float], ...], float],
    dtype: torch.dtype,
    eps: float,
    workspace: dict | None = None,
    result: Tensor | None = None,
) -> Tensor:
    """:func:`orthogonalize` of one 2-D matrix into ``result`` (contiguous), or a new tensor.

    Tall matrices are not transposed: :func:`ns_step` uses the right Gram matrix for them (strided
    transposing copies cost time; docs/benchmarks.md). With a
    ``workspace`` dict the intermediates live in buffers kept there (keyed by shape, dtype and
    device) and reused by the next same-shape matrix: on CPU, fresh temporaries are page faults.
    """
    m, n = x.shape
    k = min(m, n)
    key = (m, n, k, dtype, x.device)
    ws = None if workspace is None else workspace.get(key)
    if ws is None:
        new = {"dtype": dtype, "device": x.device}
        ws = {"X": torch.empty((m, n), **new), "Y": (torch.empty((m, n), **new), torch.empty((m, n), **new)),
              "A": torch.empty((k, k), **new), "B": torch.empty((k, k), **new)}
        if workspace is not None:
            workspace[key] = ws
    X = ws["X"].copy_(x)  # the input in the compute dtype, contiguous
    coefficients, scale = schedule
    norm = torch.linalg.vector_norm(X)
    X.div_((norm if scale == 1.0 else norm * scale).clamp(min=eps))
    if result is None:
        result = torch.empty((m, n), dtype=dtype, device=x.device)
    steps = len(coefficients)
    for i, abc in enumerate(coefficients):
        out = result if i == steps - 1 else ws["Y"][i % 2]
        ns_step(X, abc, out=out, scratch=(ws["A"], ws["B"]))
        X = out
    return result


def orthogonalize_stack(
    x: Tensor,
    steps: int = NS_STEPS,
    coefficients: Coefficients = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    inplace: bool = False,
) -> Tensor:
    r"""Quintic Newton-Schulz (paper eq. 3) of a stack ``(K, m, n)`` in ``x.dtype``: each iteration is
    three batched matmuls over all ``K`` matrices, with the smaller Gram matrix as in :func:`ns_step`.

    The batched step's form (``foreach=True``): 3 kernels per iteration for a whole shape bucket,
    where the per-matrix loop launches 3 per matrix. ``inplace``: ``x`` is a scratch stack (the
    bucket's workspace) and is normalised in place instead of copied.
    """
    if x.ndim != 3 or steps < 1:
        raise ValueError(f"orthogonalize_stack needs a (K, m, n) stack and steps >= 1, got {tuple(x.shape)}, {steps}")
    X = x if inplace else x.clone()
    coefficients, scale = _schedule(coefficients, steps)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    X.div_((norm if scale == 1.0 else norm.mul_(scale)).clamp_(min=eps))
    tall = X.shape[-2] > X.shape[-1]
    for a, b, c in coefficients:
        A = torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X


#: Iterations before which Gram Newton-Schulz restarts (``X <- Q X``, ``R = X X^T``, ``Q = I``): after
#: iteration 2, the position Dao-AILab/gram-newton-schulz's README gives for 5 steps (its
#: ``restart_autotune.py`` chooses positions offline; one restart for 5 steps).
GRAM_RESTARTS = (2,)


def _method_stacks(x: Tensor, dtype: torch.dtype | None, out: Tensor | None, batched: bool, inplace: bool,
                   core: Any) -> Tensor:
    """Run ``core`` (a function of a wide stack ``(K, m, n)``, ``m <= n``, in the compute dtype) on ``x``:
    tall matrices as their transposes (views), a batch as one stack (``batched``) or matrix by matrix
    (each matrix's bits independent of its neighbours, as :func:`orthogonalize`'s per-matrix loop)."""
    if x.ndim < 2:
        raise ValueError(f"orthogonalization needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    dtype = dtype or x.dtype
    flat = x.reshape(-1, *x.shape[-2:])
    flat = flat.to(dtype, copy=not (inplace and batched))
    tall = flat.shape[-2] > flat.shape[-1]
    run = (lambda s: core(s.mT).mT) if tall else core  # noqa: E731
    if batched:
        U = run(flat)
    else:
        U = torch.stack([run(flat[i : i + 1])[0] for i in range(flat.shape[0])]) if flat.shape[0] else flat
    U = U.reshape(x.shape)
    return U if out is None else out.copy_(U)


def _frobenius_normalized(X: Tensor, scale: float, eps: float) -> Tensor:
    """``X / max(scale ||X||_F, eps)`` per matrix, the norm taken in at least float32."""
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(X.dtype, torch.float32))
    return X / (norm * scale).clamp(min=eps).to(X.dtype)


def gram_orthogonalize(
    x: Tensor,
    steps: int = NS_STEPS,
    coefficients: Coefficients = NS_COEFFICIENTS,
    dtype: torch.dtype | None = torch.bfloat16,
    eps: float = NS_EPS,
    workspace: dict | None = None,
    out: Tensor | None = None,
    batched: bool = False,
    inplace: bool = False,
    restarts: Sequence[int] = GRAM_RESTARTS,
) -> Tensor:
    r"""Gram Newton-Schulz (Dao-AILab/gram-newton-schulz; blog dao-lab.ai/blog/2026/gram-newton-schulz):
    the quintic iteration of :func:`orthogonalize` carried out on the small Gram matrix.

    With ``X_{k+1} = p_k(R_k) X_k``, ``p_k(R) = a I + b R + c R^2`` and ``R_k = X_k X_k^\top`` (``m x m``,
    ``m <= n``), every ``p_k(R_k)`` commutes with ``R_k``, so

    .. math::
        R_{k+1} = p_k(R_k)\, R_k\, p_k(R_k),\qquad Q_{k+1} = p_k(R_k)\, Q_k,\qquad X_K = Q_K X_0,

    which in exact arithmetic is :func:`orthogonalize`'s result: ``4 m^3`` FLOPs an iteration and
    ``2 m^2 n`` at each end, instead of ``2 m^2 n + m^3`` an iteration; fewer for ``n`` well above ``m``.
    Rounding drifts ``R`` away from ``X X^T`` (spurious negative eigenvalues, eigenvector drift), so
    before each iteration of ``restarts`` the iteration restarts from ``X = Q X``. A square matrix gains
    nothing (``4 m^3`` against ``3 m^3`` an iteration): square matrices take :func:`orthogonalize`'s plain
    iteration, as the reference implementation falls back (1.3-1.5x the quintic's time at 512 and 1024
    without it, docs/benchmarks.md). Arguments as :func:`orthogonalize`; ``workspace`` is used by the
    square fallback only.
    """
    if x.ndim >= 2 and x.shape[-2] == x.shape[-1]:
        return orthogonalize(x, steps, coefficients, dtype, eps, workspace, out, batched, inplace)
    schedule, scale = _schedule(coefficients, steps)
    last = len(schedule) - 1

    def core(X: Tensor) -> Tensor:
        X = _frobenius_normalized(X, scale, eps)
        eye = torch.eye(X.shape[-2], dtype=X.dtype, device=X.device)
        R, Q = torch.bmm(X, X.mT), None
        for k, (a, b, c) in enumerate(schedule):
            if k in restarts and Q is not None:
                X, Q = torch.bmm(Q, X), None
                R = torch.bmm(X, X.mT)
            P = torch.baddbmm(R, R, R, beta=b, alpha=c).add_(eye, alpha=a)  # a I + b R + c R^2
            Q = P if Q is None else torch.bmm(P, Q)
            if k < last and k + 1 not in restarts:
                R = torch.bmm(P, torch.bmm(R, P))
        return torch.bmm(Q, X)

    return _method_stacks(x, dtype, out, batched, inplace, core)


def aol_orthogonalize(
    x: Tensor,
    steps: int = NS_STEPS,
    coefficients: Coefficients = NS_COEFFICIENTS,
    dtype: torch.dtype | None = torch.bfloat16,
    eps: float = NS_EPS,
    workspace: dict | None = None,
    out: Tensor | None = None,
    batched: bool = False,
    inplace: bool = False,
) -> Tensor:
    r"""Quintic Newton-Schulz after AOL preconditioning (Turbo-Muon, arXiv 2512.04632;
    KellerJordan/modded-nanogpt#155; AOL: Prach and Lampert 2022), ``steps - 1`` iterations.

    For a wide ``X`` (``m <= n``) with Gram matrix ``A = X X^\top``, the diagonal scaling

    .. math::
        D = \operatorname{diag}\Big(\sum_j |A_{ij}|\Big)^{-1/2},\qquad X_1 = D X,\qquad A_1 = D A D

    guarantees ``||X_1||_2 <= 1`` (AOL's bound) in place of the Frobenius normalisation, and ``A_1`` is the
    first iteration's Gram matrix at no extra matmul. The scaling brings the singular values nearer 1
    than the Frobenius normalisation does, so ``steps - 1`` iterations (4 for the default 5) of the
    schedule's first ``steps - 1`` coefficients stand in for ``steps`` (Turbo-Muon's claim). Note that
    ``Orth(D X)`` is not ``Orth(X)``: the result is an orthogonal factor of the rescaled rows.
    Arguments as :func:`orthogonalize`; ``workspace`` is unused.
    """
    if steps < 2:
        raise ValueError(f"aol_orthogonalize: steps must be >= 2 (the scaling stands in for one), got {steps}")
    schedule, _ = _schedule(coefficients, steps - 1)

    def core(X: Tensor) -> Tensor:
        A = torch.bmm(X, X.mT)
        d = A.abs().sum(dim=-1).clamp(min=eps).rsqrt()
        X = X * d[..., :, None]
        A = A * d[..., :, None] * d[..., None, :]
        for k, (a, b, c) in enumerate(schedule):
            if k:
                A = torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
        return X

    return _method_stacks(x, dtype, out, batched, inplace, core)


#: cubic5 (Hua Huang, "How Much Orthogonalization Does Muon Need?", arXiv 2606.00371), as merged in
#: NVIDIA-NeMo/Emerging-Optimizers PR #217 (commit a4c2c262aa1342e461fa4a5ed71697466b074736, unchanged
#: at fd7729267109a8848709e9406bf19e53e970c3f4), ``emerging_optimizers/orthogonalized_optimizers/
#: muon_utils.py`` ``_COEFFICIENT_SETS["cubic5"]``: one ``(a, b, c)`` per iteration with ``c = 0`` (the cubic
#: ``a X + b (X X^T) X``), optimised for a relaxed singular-value band with an effective bf16 lower bound
#: ``l0 = 7e-3``. A fixed 5-step schedule.
CUBIC5 = (
    (3.3656576, -3.3420992, 0.0),
    (2.5744352, -1.4957376, 0.0),
    (2.5368962, -1.4312570, 0.0),
    (2.4418906, -1.2764040, 0.0),
    (2.2230472, -0.9630650, 0.0),
)


def cubic_schedule(coefficients: Any, steps: int) -> tuple[tuple[float, float], ...]:
    """The ``(a, b)`` per iteration of :func:`cubic_orthogonalize` from a group's ``ns_coefficients`` and ``ns_steps``.

    ``ns_coefficients`` at its default (:data:`NS_COEFFICIENTS`, Jordan's quintic triple, i.e. not chosen):
    :data:`CUBIC5`, which needs ``steps == 5`` (it is a fixed schedule, as upstream refuses other counts).
    Otherwise any form :func:`ns_schedule` takes whose every ``c`` is 0: one ``(a, b, 0)`` for every
    iteration or a list of ``steps`` of them (e.g. ``CUBIC5`` itself). The input scale is 1.

    Raises:
        ValueError: ``steps != 5`` with the default, a named schedule (``"polar_express"``: quintic), or a
            triple with ``c != 0`` (a quintic: ``ns_method="quintic"``).
    """
    if not isinstance(coefficients, str) and len(coefficients) == 3 and tuple(coefficients) == NS_COEFFICIENTS:
        if steps != len(CUBIC5):
            raise ValueError(f"ns_method='cubic' runs cubic5, a fixed {len(CUBIC5)}-step schedule; got ns_steps="
                             f"{steps}. Use ns_steps=5, or pass ns_coefficients as {steps} (a, b, 0) triples")
        return tuple((a, b) for a, b, _ in CUBIC5)
    if isinstance(coefficients, str):
        raise ValueError(f"ns_method='cubic' takes no named schedule ({coefficients!r} is a quintic one); leave "
                         "ns_coefficients at its default (cubic5) or pass (a, b, 0) triples")
    schedule, _ = _schedule(coefficients, steps)
    if any(c != 0.0 for _, _, c in schedule):
        raise ValueError(f"ns_method='cubic' needs c = 0 in every (a, b, c) triple, got {coefficients!r} (a "
                         "quintic: use ns_method='quintic'), or leave ns_coefficients at its default (cubic5)")
    return tuple((a, b) for a, b, _ in schedule)


def cubic_orthogonalize(
    x: Tensor,
    steps: int = NS_STEPS,
    coefficients: Coefficients = NS_COEFFICIENTS,
    dtype: torch.dtype | None = torch.bfloat16,
    eps: float = NS_EPS,
    workspace: dict | None = None,
    out: Tensor | None = None,
    batched: bool = False,
    inplace: bool = False,
) -> Tensor:
    r"""Cubic Newton-Schulz with the cubic5 schedule (Huang, arXiv 2606.00371; NVIDIA-NeMo/Emerging-Optimizers
    PR #217, commit a4c2c262aa1342e461fa4a5ed71697466b074736, ``muon_utils.py``: ``newton_schulz(...,
    coefficient_type="cubic5")``, whose ``c = 0`` path is ``addmm(X, A, X, beta=a, alpha=b)``).

    .. math::
        X_0 = X / \max(\|X\|_F, \epsilon),\quad A_k = X_k X_k^\top,\quad
        X_{k+1} = a_k X_k + b_k A_k X_k,\quad k = 0..4,

    ``(a_k, b_k)`` from :data:`CUBIC5` (:func:`cubic_schedule` says how ``steps`` and ``coefficients`` map
    onto it). Two matmuls an iteration (``A_k`` and ``A_k X_k``), 10 for the schedule instead of the
    quintic's 15; the schedule aims at a relaxed singular-value band, not the polar factor (the paper:
    training parity with the quintic within about 1e-3 validation loss). ``A_k`` is the smaller Gram
    matrix (tall inputs iterate ``X_k (X_k^\top X_k)``, the transpose of the wide iteration, as upstream's
    transpose-iterate-transpose). The normalisation is :func:`orthogonalize`'s (the norm clamped at ``eps``;
    upstream's ``F.normalize`` clamps at 1e-15). Arguments as :func:`orthogonalize`: per matrix with fused
    ``addmm`` and ``workspace`` buffers, or one stack of ``bmm``/``baddbmm`` (``batched``).
    """
    if x.ndim < 2:
        raise ValueError(f"cubic_orthogonalize needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    dtype = dtype or x.dtype
    if out is not None and (out.shape != x.shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(
            f"cubic_orthogonalize: out must be a contiguous {tuple(x.shape)} tensor of dtype {dtype}, "
            f"got {tuple(out.shape)} {out.dtype} (contiguous={out.is_contiguous()})"
        )
    schedule = cubic_schedule(coefficients, steps)
    if x.ndim > 2 and batched:
        X = x.reshape(-1, *x.shape[-2:]).to(dtype, copy=not inplace)
        X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp_(min=eps))
        tall = X.shape[-2] > X.shape[-1]
        for a, b in schedule:
            if tall:
                X = torch.baddbmm(X, X, torch.bmm(X.mT, X), beta=a, alpha=b)
            else:
                X = torch.baddbmm(X, torch.bmm(X, X.mT), X, beta=a, alpha=b)
        X = X.reshape(x.shape)
        return X if out is None else out.copy_(X)
    if x.ndim == 2:
        return _cubic_matrix(x, schedule, dtype, eps, workspace, out)
    flat = x.reshape(-1, *x.shape[-2:])
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    flat_out = out.view(flat.shape)
    for i in range(flat.shape[0]):
        _cubic_matrix(flat[i], schedule, dtype, eps, workspace, flat_out[i])
    return out


def _cubic_matrix(x: Tensor, schedule: tuple[tuple[float, float], ...], dtype: torch.dtype, eps: float,
                  workspace: dict | None = None, result: Tensor | None = None) -> Tensor:
    """:func:`cubic_orthogonalize` of one 2-D matrix into ``result`` (or a new tensor), as
    :func:`_orthogonalize_matrix`: buffers kept in ``workspace``, the Gram matrix on the smaller side
    (block-symmetric on CPU from ``SYMMETRIC_MIN``, as :func:`ns_step`), one ``addmm`` per iteration."""
    m, n = x.shape
    tall, k = m > n, min(m, n)
    key = ("cubic", m, n, dtype, x.device)
    ws = None if workspace is None else workspace.get(key)
    if ws is None:
        new = {"dtype": dtype, "device": x.device}
        ws = {"X": torch.empty((m, n), **new), "Y": (torch.empty((m, n), **new), torch.empty((m, n), **new)),
              "A": torch.empty((k, k), **new)}
        if workspace is not None:
            workspace[key] = ws
    X = ws["X"].copy_(x)
    X.div_(torch.linalg.vector_norm(X).clamp(min=eps))
    if result is None:
        result = torch.empty((m, n), dtype=dtype, device=x.device)
    symmetric = x.device.type == "cpu" and k >= SYMMETRIC_MIN
    for i, (a, b) in enumerate(schedule):
        o = result if i == len(schedule) - 1 else ws["Y"][i % 2]
        Z = X.T if tall else X
        A = _symmetric_addmm(None, Z, Z.T, out=ws["A"]) if symmetric else torch.mm(Z, Z.T, out=ws["A"])
        if tall:
            torch.addmm(X, X, A, beta=a, alpha=b, out=o)
        else:
            torch.addmm(X, A, X, beta=a, alpha=b, out=o)
        X = o
    return result


#: Smallest Gram size ``k = min(m, n)`` at which :func:`ns_step` computes its two symmetric products
#: (``A = YY^T`` and ``bA + cA^2``) block-wise on CPU: 3 of the 4 blocks, the fourth mirrored, so
#: each costs 3/4 of its FLOPs. On CPU it loses below k = 320, breaks even up to 576 and wins from
#: 768 (``benchmarks/ns_blocks.py``; docs/benchmarks.md). Other devices keep the plain products.
SYMMETRIC_MIN = 576


def ns_step(
    Y: Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    *,
    out: Tensor | None = None,
    scratch: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """One quintic Newton-Schulz iteration on a 2-D ``Y`` (paper eq. 3), with the smaller Gram matrix.

    Wide (``m <= n``): ``aY + (bA + cA^2)Y`` with ``A = YY^T``. Tall: ``aY + Y(bA + cA^2)`` with
    ``A = Y^TY``, which is the wide iteration applied to ``Y^T``, transposed back. ``out`` (not
    ``Y``) and ``scratch`` (two ``k x k`` buffers, ``k = min(m, n)``) avoid allocations.

    ``A`` and ``bA + cA^2`` are symmetric; on CPU from ``k >= SYMMETRIC_MIN`` only their upper
    three blocks are multiplied (the symmetric-tile idea of flash-muon and modded-nanogpt's Triton
    kernels, here with plain BLAS calls on blocks). Each computed entry is the same dot product
    as in the full product; the mirrored block makes the result exactly symmetric.
    """
    a, b, c = coefficients
    tall = Y.shape[0] > Y.shape[1]
    Z = Y.T if tall else Y  # rows of Z: the k vectors whose Gram matrix is A
    k = Z.shape[0]
    A, B = scratch if scratch is not None else (None, None)
    if Y.device.type == "cpu" and k >= SYMMETRIC_MIN:
        A = _symmetric_addmm(None, Z, Z.T, out=A)
        B = _symmetric_addmm(A, A, A, beta=b, alpha=c, out=B)
    else:
        A = torch.mm(Z, Z.T, out=A)
        B = torch.addmm(A, A, A, beta=b, alpha=c, out=B)
    if tall:
        return torch.addmm(Y, Y, B, beta=a, out=out)
    return torch.addmm(Y, B, Y, beta=a, out=out)


def _symmetric_addmm(
    C: Tensor | None, L: Tensor, R: Tensor, *, beta: float = 1.0, alpha: float = 1.0, out: Tensor | None = None
) -> Tensor:
    """``beta C + alpha L R`` (``C`` symmetric, or ``None`` for ``L R``) for a product known to be
    symmetric: the top block rows and the bottom-right block, then the bottom-left block mirrored."""
    k = L.shape[0]
    h = k // 2
    if out is None:
        out = torch.empty((k, k), dtype=L.dtype, device=L.device)
    if C is None:
        torch.mm(L[:h], R, out=out[:h])
        torch.mm(L[h:], R[:, h:], out=out[h:, h:])
    else:
        torch.addmm(C[:h], L[:h], R, beta=beta, alpha=alpha, out=out[:h])
        torch.addmm(C[h:, h:], L[h:], R[:, h:], beta=beta, alpha=alpha, out=out[h:, h:])
    out[h:, :h].copy_(out[:h, h:].T)
    return out


def row_rms(x: Tensor) -> Tensor:
    r"""Row RMS magnitudes ``r_i = \|X_{i,:}\|_2 / \sqrt{n}`` (paper eq. 4); shape ``(..., m)``."""
    # vector_norm reduces in one pass with a float32 (or float64) accumulator, without
    # materialising x**2: the squares dominated the eager step (benchmarks/step_time.py profile).
    return torch.linalg.vector_norm(x, dim=-1, dtype=_stat_dtype(x)) / math.sqrt(x.shape[-1])


def col_rms(x: Tensor, psum: PSum = None, rows: int | None = None) -> Tensor:
    r"""Column RMS magnitudes ``c_j = \|X_{:,j}\|_2 / \sqrt{m}`` (paper eq. 4); shape ``(..., n)``.

    With ``psum`` (rows sharded), ``m = rows`` is the global row count and the column sums of
    squares are summed over shards.
    """
    x = x.to(_stat_dtype(x))
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
    return cv_of_norms(v.to(_stat_dtype(v)), delta)


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
    x = x.to(_stat_dtype(x))
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
    x = x.to(_stat_dtype(x))
    return x * row_factors(x, delta).unsqueeze(-1)


def col_normalize(x: Tensor, delta: float = DELTA, psum: PSum = None, rows: int | None = None) -> Tensor:
    r"""``N_c(X) = X diag(c^{-1})`` (paper eq. 7): every nonzero column rescaled to unit RMS."""
    x = x.to(_stat_dtype(x))
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
    x = x if inplace else x.to(_stat_dtype(x), copy=True)
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
    x = x if inplace else x.to(_stat_dtype(x), copy=True)
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
    columns) multiply the chosen side, 1 the other: two passes over each stack.

    Returns:
        the normalised stacks (float32, or float64) and ``chose_rows`` ``(K,)`` bool, stack by stack.
    """
    dtype, device = torch.float64 if us[0].dtype == torch.float64 else torch.float32, us[0].device  # _stat_dtype
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
        x = u.to(dtype, copy=True) if cpu else u
        xs.append(x)
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
        o += k
    if cpu:
        norms[:, 1].sqrt_()  # the column norms from their sums of squares (padding: sqrt(0) = 0)
    counted = norms > threshold  # eq. 5: what is at or below delta counts as zero, and normalises to zero
    gamma = cv_of_norms(norms, threshold, counted)
    chose_rows = choose_rows(gamma[:, 0], gamma[:, 1])
    scales = torch.where(counted, torch.div(factor, norms), 0.0)
    scales.masked_fill_(chose_rows[:, None, None] != row_slot, 1.0)  # 1 on the side not chosen
    out, o = [], 0
    for u, x, (k, m, n) in zip(us, xs, shapes, strict=True):
        row, col = scales[o : o + k, 0, :m, None], scales[o : o + k, 1, None, :n]
        # >= float32; on CPU the float32 copy scaled in place: the same products as U times the factors
        # (bf16 -> float32 is exact), without a fresh matrix-sized temporary (page faults on CPU)
        out.append((x.mul_(row) if x is not u else torch.mul(u, row)).mul_(col))
        o += k
    return out, chose_rows


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
