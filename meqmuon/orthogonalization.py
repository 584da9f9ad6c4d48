"""Newton-Schulz orthogonalisation: ``Orth(X) = P Q^T`` for ``X = P S Q^T`` (paper section 2, eq. 3).

The quintic iteration of Jordan et al. (2024) and its coefficient schedules (fixed, Polar Express, or one
triple per iteration), the per-matrix step :func:`ns_step` with its block-symmetric products on CPU, the
batched form :func:`orthogonalize_stack`, and the other methods a group's ``ns_method`` can name (Gram,
AOL-preconditioned, cubic5): the functions of :data:`meqmuon.optim.newton_schulz.NS_METHODS`. Pure tensor
maths, as :mod:`meqmuon.functional`, which re-exports every public name here (``meqmuon.functional.
orthogonalize`` is this module's ``orthogonalize``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "NS_COEFFICIENTS", "NS_EPS", "NS_SCHEDULES", "NS_STEPS", "POLAR_EXPRESS", "POLAR_EXPRESS_SAFETY",
    "POLAR_EXPRESS_SPEEDRUN", "Coefficients", "canonical_coefficients", "ns_schedule", "orthogonalize",
    "orthogonalize_stack", "ns_step", "frobenius_normalize_", "SYMMETRIC_MIN", "SYMMETRIC_STACK_MIN", "GRAM_RESTARTS",
    "gram_orthogonalize", "aol_orthogonalize", "CUBIC5", "cubic_schedule", "cubic_orthogonalize",
]

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


#: Lower bound on the Frobenius norm in the Newton-Schulz pre-normalisation; torch.optim.Muon
#: clamps the norm at this value (``eps=1e-7``), so a zero matrix maps to zero. The official repos
#: add it instead (``||X|| + 1e-7``): 1.9e-3 relative apart at ``||X|| = 1e-4`` (docs/algorithm.md).
NS_EPS = 1e-7


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
    eps_added: bool = False,
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
        inplace: ``x`` is scratch, read by nobody afterwards. With ``batched``, a 3-D ``x`` in ``dtype`` is
            iterated in place (:func:`orthogonalize_stack`) instead of copied first; matrix by matrix, each
            matrix of ``x`` that is contiguous and in ``dtype`` is its own first iterate (normalised in place
            and overwritten by later iterates, :func:`_matrix_iteration`) instead of copied into a buffer, so
            that it is not alive beside a copy of itself (an owner's received whole matrices). The same ops
            on the same values either way: the same bits.
        eps_added: normalise by ``||X||_F + eps`` instead of ``max(||X||_F, eps)``: the official codes' form
            (Keller Jordan's ``zeropower_via_newtonschulz5`` and the 2026 field's copies of it, eps 1e-7;
            levanter's, its ``muon_epsilon`` 1e-8), the ``ns_method`` ``"quintic+1e-7"`` and ``"quintic+1e-8"``
            (:data:`meqmuon.optim.newton_schulz.NS_METHODS`). The two differ by ``eps / ||X||_F`` relative, 5e-6 for
            a 24 x 16 gradient of entries 1e-3.

    Returns:
        The approximate orthogonalisation, same shape as ``x``, in ``dtype``.
    """
    if x.ndim >= 2 and steps < 1:
        raise ValueError(f"orthogonalize: steps must be >= 1, got {steps}")
    schedule = None if x.ndim > 2 and batched else _schedule(coefficients, steps)
    return _orthogonalization_frame(
        "orthogonalize", x, dtype, out, batched, inplace,
        lambda X: orthogonalize_stack(X, steps, coefficients, eps, inplace=True, eps_added=eps_added),
        lambda X, d, o: _matrix_iteration(X, schedule, d, eps, workspace, o, ns_step, grams=2, inplace=inplace,
                                          eps_added=eps_added))


def _orthogonalization_frame(name: str, x: Tensor, dtype: torch.dtype | None, out: Tensor | None, batched: bool,
                             inplace: bool, stack: Callable[[Tensor], Tensor],
                             matrix: Callable[[Tensor, torch.dtype, Tensor | None], Tensor]) -> Tensor:
    """The frame of :func:`orthogonalize` and :func:`cubic_orthogonalize`: checks ``x`` and ``out``, then
    runs ``stack`` on a batch as one ``(K, m, n)`` stack in the compute dtype (``batched``; a copy of ``x``
    unless ``inplace``), else ``matrix(x_i, dtype, out_i)`` on one matrix after another into ``out`` (which
    iterates ``x_i`` in place where ``inplace``: then ``out`` must not overlap ``x``).

    One matrix at a time with fused addmm, exactly torch.optim.Muon's iteration: faster on CPU than one
    batched call (docs/benchmarks.md). It also makes each matrix's bits independent of the batch it travels
    in, which the DDP split relies on for bit-exactness with one process (a batched baddbmm broke that for
    some inputs)."""
    if x.ndim < 2:
        raise ValueError(f"{name} needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    dtype = dtype or x.dtype
    if out is not None and (out.shape != x.shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(
            f"{name}: out must be a contiguous {tuple(x.shape)} tensor of dtype {dtype}, "
            f"got {tuple(out.shape)} {out.dtype} (contiguous={out.is_contiguous()})"
        )
    if x.ndim > 2 and batched:
        X = stack(x.reshape(-1, *x.shape[-2:]).to(dtype, copy=not inplace)).reshape(x.shape)
        return X if out is None else out.copy_(X)
    if x.ndim == 2:
        return matrix(x, dtype, out)
    flat = x.reshape(-1, *x.shape[-2:])
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    flat_out = out.view(flat.shape)
    for i in range(flat.shape[0]):
        matrix(flat[i], dtype, flat_out[i])
    return out


def _matrix_iteration(
    x: Tensor,
    schedule: tuple[tuple[tuple[float, ...], ...], float],
    dtype: torch.dtype,
    eps: float,
    workspace: dict | None,
    result: Tensor | None,
    step: Callable[..., Tensor],
    grams: int,
    tag: tuple[str, ...] = (),
    inplace: bool = False,
    eps_added: bool = False,
) -> Tensor:
    """One 2-D matrix's iteration into ``result`` (contiguous), or a new tensor: ``X_0 = X / max(scale
    ||X||_F, eps)`` (``eps_added``: ``X / (scale ||X||_F + eps)``), then ``step(X_k, coefficients_k, out=,
    scratch=)`` per entry of ``schedule = (coefficients, scale)`` (:func:`ns_step`, the quintic, or
    :func:`_cubic_step`), ping-ponging between the input's buffer and ``result`` (an odd number of steps, the
    default 5: the last step reads the input's buffer and writes ``result``), or for an even number between the
    input's buffer and one more, the last step writing ``result``: with the Gram buffers, Newton-Schulz's whole
    transient memory.

    Tall matrices are not transposed: the steps use the right Gram matrix for them (strided transposing
    copies cost time; docs/benchmarks.md). With a ``workspace`` dict the intermediates (the input, for an even
    number of steps one more iterate, and ``grams`` ``k x k`` Gram-side buffers) live in buffers kept there,
    keyed by ``tag`` (the method), shape, dtype and device, and reused by the next same-shape matrix: on CPU,
    fresh temporaries are page faults.

    ``inplace``: ``x`` is scratch; if it is contiguous and in ``dtype`` it is the first iterate's buffer itself,
    not copied into one: the copy was exact, so the bits are the same, and ``x`` is not alive beside a copy of
    itself. ``result`` must then not overlap ``x``. Every step is the same op on the same values whichever
    buffers hold them.
    """
    m, n = x.shape
    k = min(m, n)
    key = (*tag, m, n, k, dtype, x.device)
    ws = None if workspace is None else workspace.get(key)
    if ws is None:
        ws = {"G": tuple(torch.empty((k, k), dtype=dtype, device=x.device) for _ in range(grams))}
        if workspace is not None:
            workspace[key] = ws
    if inplace and x.dtype == dtype and x.is_contiguous():
        X = x  # the first iterate in the input's own buffer
    else:  # the input in the compute dtype, contiguous
        X = _buffer(ws, "X", (m, n), dtype, x.device).copy_(x)
    first = X
    coefficients, scale = schedule
    frobenius_normalize_(X, scale, eps, eps_added)
    if result is None:
        result = torch.empty((m, n), dtype=dtype, device=x.device)
    steps = len(coefficients)
    # the input's buffer is free once the first step has read it: X -> result -> X -> ... -> result (odd), or
    # X -> Y -> X -> ... -> Y -> result (even)
    other = result if steps % 2 else _buffer(ws, "Y", (m, n), dtype, x.device)
    for i, c in enumerate(coefficients):
        out = result if i == steps - 1 else (other, first)[i % 2]
        step(X, c, out=out, scratch=ws["G"])
        X = out
    return result


def frobenius_normalize_(X: Tensor, scale: float, eps: float, eps_added: bool = False) -> Tensor:
    """One matrix's first line of the quintic, in place: ``X / max(scale ||X||_F, eps)``, or with ``eps_added``
    ``X / (scale ||X||_F + eps)`` (:func:`orthogonalize`'s ``eps_added``), the norm in ``X``'s dtype."""
    norm = torch.linalg.vector_norm(X)
    norm = norm if scale == 1.0 else norm * scale
    return X.div_(norm + eps if eps_added else norm.clamp(min=eps))


def _buffer(ws: dict, name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``ws[name]``, made when first needed."""
    if name not in ws:
        ws[name] = torch.empty(shape, dtype=dtype, device=device)
    return ws[name]



def orthogonalize_stack(
    x: Tensor,
    steps: int = NS_STEPS,
    coefficients: Coefficients = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    inplace: bool = False,
    eps_added: bool = False,
) -> Tensor:
    r"""Quintic Newton-Schulz (paper eq. 3) of a stack ``(K, m, n)`` in ``x.dtype``: each iteration is
    three batched matmuls over all ``K`` matrices, with the smaller Gram matrix as in :func:`ns_step`.

    The batched step's form (``foreach=True``): 3 kernels per iteration for a whole shape bucket,
    where the per-matrix loop launches 3 per matrix. ``inplace``: ``x`` is a scratch stack (the
    bucket's workspace) and is normalised in place instead of copied. ``eps_added``: as :func:`orthogonalize`'s.
    """
    if x.ndim != 3 or steps < 1:
        raise ValueError(f"orthogonalize_stack needs a (K, m, n) stack and steps >= 1, got {tuple(x.shape)}, {steps}")
    X = x if inplace else x.clone()
    coefficients, scale = _schedule(coefficients, steps)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    norm = norm if scale == 1.0 else norm.mul_(scale)
    X.div_(norm.add_(eps) if eps_added else norm.clamp_(min=eps))
    tall = X.shape[-2] > X.shape[-1]
    symmetric = SYMMETRIC_STACK_MIN is not None and min(X.shape[-2:]) >= SYMMETRIC_STACK_MIN
    for a, b, c in coefficients:
        if symmetric:
            A = _symmetric_baddbmm(None, X.mT, X) if tall else _symmetric_baddbmm(None, X, X.mT)
            B = _symmetric_baddbmm(A, A, A, beta=b, alpha=c)
        else:
            A = torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X


#: A stack's symmetric products ``A = X X^T`` and ``bA + cA^2`` by blocks (:func:`_symmetric_baddbmm`, 3/4 of
#: their FLOPs, two more launches and a mirror copy each) from this Gram size ``k`` on; ``None``: the plain
#: batched products. Off until a GPU run shows it faster (``benchmarks/step_time.py --switches symmetric-ns``
#: times both in the same rounds; issue 49), as ``SYMMETRIC_MIN`` was measured on CPU.
SYMMETRIC_STACK_MIN: int | None = None


def _symmetric_baddbmm(C: Tensor | None, L: Tensor, R: Tensor, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """``beta C + alpha L R`` for a stack whose products are symmetric (``C`` symmetric, or ``None`` for
    ``L R``), :func:`_symmetric_addmm` batched: the top block rows, the bottom-right block, the bottom-left
    block mirrored. Each computed entry is the same dot product as in the full product."""
    k = L.shape[-2]
    h = k // 2
    out = torch.empty((L.shape[0], k, k), dtype=L.dtype, device=L.device)
    if C is None:
        torch.bmm(L[:, :h], R, out=out[:, :h])
        torch.bmm(L[:, h:], R[..., h:], out=out[:, h:, h:])
    else:
        torch.baddbmm(C[:, :h], L[:, :h], R, beta=beta, alpha=alpha, out=out[:, :h])
        torch.baddbmm(C[:, h:, h:], L[:, h:], R[..., h:], beta=beta, alpha=alpha, out=out[:, h:, h:])
    out[:, h:, :h].copy_(out[:, :h, h:].mT)
    return out


#: Iterations before which Gram Newton-Schulz restarts (``X <- Q X``, ``R = X X^T``, ``Q = I``): after
#: iteration 2, the position Dao-AILab/gram-newton-schulz's README gives for 5 steps (its
#: ``restart_autotune.py`` chooses positions offline; one restart for 5 steps).
GRAM_RESTARTS = (2,)


def _method_stacks(x: Tensor, dtype: torch.dtype | None, out: Tensor | None, batched: bool, inplace: bool,
                   core: Any) -> Tensor:
    """Run ``core`` (a function of a wide stack ``(K, m, n)``, ``m <= n``, in the compute dtype) on ``x``:
    tall matrices as their transposes (views), a batch as one stack (``batched``) or matrix by matrix
    (each matrix's bits independent of its neighbours, as :func:`orthogonalize`'s per-matrix loop).
    ``inplace``: ``x`` is scratch, so no copy of it is made where it is in ``dtype`` already."""
    if x.ndim < 2:
        raise ValueError(f"orthogonalization needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    dtype = dtype or x.dtype
    flat = x.reshape(-1, *x.shape[-2:])
    flat = flat.to(dtype, copy=not inplace)
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
    schedule = cubic_schedule(coefficients, steps)
    return _orthogonalization_frame(
        "cubic_orthogonalize", x, dtype, out, batched, inplace, lambda X: _cubic_stack(X, schedule, eps),
        lambda X, d, o: _matrix_iteration(X, (schedule, 1.0), d, eps, workspace, o, _cubic_step, grams=1,
                                          tag=("cubic",), inplace=inplace))


def _cubic_stack(X: Tensor, schedule: tuple[tuple[float, float], ...], eps: float) -> Tensor:
    """:func:`cubic_orthogonalize` of a scratch stack ``(K, m, n)``: three batched kernels an iteration."""
    X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp_(min=eps))
    tall = X.shape[-2] > X.shape[-1]
    for a, b in schedule:
        if tall:
            X = torch.baddbmm(X, X, torch.bmm(X.mT, X), beta=a, alpha=b)
        else:
            X = torch.baddbmm(X, torch.bmm(X, X.mT), X, beta=a, alpha=b)
    return X


def _cubic_step(X: Tensor, ab: tuple[float, float], *, out: Tensor, scratch: tuple[Tensor, ...]) -> Tensor:
    """One cubic iteration ``aX + b(XX^T)X`` on a 2-D ``X`` into ``out``, as :func:`ns_step`: the Gram matrix
    on the smaller side (block-symmetric on CPU from ``SYMMETRIC_MIN``), one fused ``addmm``."""
    a, b = ab
    tall = X.shape[0] > X.shape[1]
    Z = X.T if tall else X
    A = (_symmetric_addmm(None, Z, Z.T, out=scratch[0]) if X.device.type == "cpu" and Z.shape[0] >= SYMMETRIC_MIN
         else torch.mm(Z, Z.T, out=scratch[0]))
    if tall:
        return torch.addmm(X, X, A, beta=a, alpha=b, out=out)
    return torch.addmm(X, A, X, beta=a, alpha=b, out=out)


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
