"""meqmuon.functional against float64 references written here from the paper's equations.

The references use plain Python loops over rows and columns (eq. 4-5, 7-10) and an unbatched
Newton-Schulz written from eq. 3, so they share no code with the implementation. Tolerances:
1e-12 for float64 paths (pure rounding), properties at 1e-6 as the issue states.
"""

import math

import pytest
import torch

from meqmuon import functional as F
from meqmuon import orthogonalization

DELTA = 1e-7


# ---- references from the paper ------------------------------------------------------------


def ref_row_rms(X):
    m, n = X.shape
    return [math.sqrt(sum(float(X[i, j]) ** 2 for j in range(n)) / n) for i in range(m)]


def ref_col_rms(X):
    m, n = X.shape
    return [math.sqrt(sum(float(X[i, j]) ** 2 for i in range(m)) / m) for j in range(n)]


def ref_cv(values):
    pos = [v for v in values if v > DELTA]
    if not pos:
        return 0.0
    mean = sum(pos) / len(pos)
    return math.sqrt(sum((v - mean) ** 2 for v in pos) / len(pos)) / mean


def ref_row_norm(X):
    r = ref_row_rms(X)
    Y = X.clone()
    for i in range(X.shape[0]):
        Y[i, :] = X[i, :] / r[i] if r[i] > DELTA else 0.0
    return Y


def ref_col_norm(X):
    c = ref_col_rms(X)
    Y = X.clone()
    for j in range(X.shape[1]):
        Y[:, j] = X[:, j] / c[j] if c[j] > DELTA else 0.0
    return Y


def ref_ns(H, steps=5, abc=(3.4445, -4.7750, 2.0315)):
    """Eq. 3 on the wide orientation, in float64."""
    a, b, c = abc
    tall = H.shape[0] > H.shape[1]
    X = H.T.clone() if tall else H.clone()
    X = X / torch.linalg.norm(X)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def imbalanced(m, n, seed=0):
    """A matrix with deliberately unequal row and column scales."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(m, 1, generator=g, dtype=torch.float64) * 3 + 0.1
    cols = torch.rand(1, n, generator=g, dtype=torch.float64) * 2 + 0.1
    return rand(m, n, seed=seed + 1) * rows * cols


# ---- exact rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7, 5), (5, 7), (6, 6)])
def test_rms_and_cv_match_equations(shape):
    X = imbalanced(*shape)
    X[2] = 0.0  # a zero row is excluded from the row CV
    assert torch.allclose(F.row_rms(X), torch.tensor(ref_row_rms(X), dtype=torch.float64), atol=1e-14)
    assert torch.allclose(F.col_rms(X), torch.tensor(ref_col_rms(X), dtype=torch.float64), atol=1e-14)
    gr, gc = F.row_col_cv(X)
    assert gr.item() == pytest.approx(ref_cv(ref_row_rms(X)), abs=1e-12)
    assert gc.item() == pytest.approx(ref_cv(ref_col_rms(X)), abs=1e-12)


def test_cv_excludes_values_at_or_below_delta():
    v = torch.tensor([1.0, 3.0, 1e-7, 0.0, 5e-8], dtype=torch.float64)
    assert F.cv(v).item() == pytest.approx(ref_cv(v.tolist()), abs=1e-14)
    assert F.cv(v).item() == pytest.approx(0.5, abs=1e-14)  # mean 2, std 1 over {1, 3}
    assert F.cv(torch.zeros(4)).item() == 0.0


def test_cv_batched():
    X = torch.stack([imbalanced(6, 4, seed=s) for s in range(3)])
    gr, gc = F.row_col_cv(X)
    for k in range(3):
        assert gr[k].item() == pytest.approx(ref_cv(ref_row_rms(X[k])), abs=1e-12)
        assert gc[k].item() == pytest.approx(ref_cv(ref_col_rms(X[k])), abs=1e-12)


@pytest.mark.parametrize("shape", [(9, 4), (4, 9)])
def test_row_col_normalize_match_equations(shape):
    X = imbalanced(*shape)
    X[:, 1] = 0.0
    assert torch.allclose(F.row_normalize(X), ref_row_norm(X), atol=1e-13)
    assert torch.allclose(F.col_normalize(X), ref_col_norm(X), atol=1e-13)


def test_equilibrate_is_col_of_row():
    X = imbalanced(11, 6)
    assert torch.allclose(F.equilibrate(X), ref_col_norm(ref_row_norm(X)), atol=1e-13)


def test_rms_normalize_matches_eq10():
    b = rand(13)
    d = b.numel()
    expected = b / (torch.linalg.norm(b) / math.sqrt(d))
    assert torch.allclose(F.rms_normalize(b), expected, atol=1e-14)


def test_eq9_and_eq10_on_stacks_with_a_scale_match_the_equations():
    """The one implementation of eq. 9 and eq. 10 serves every form: on a stack each member is normalised
    alone, ``scale`` multiplies the result, ``inplace`` writes it into the (float64) input, and a zero
    member stays zero."""
    X = torch.stack([imbalanced(9, 4, seed=s) for s in range(3)])
    X[1] = 0.0
    want = torch.stack([0.3 * ref_col_norm(ref_row_norm(x)) for x in X])
    assert torch.allclose(F.equilibrate(X, scale=0.3), want, atol=1e-13, rtol=0)
    V = torch.stack([rand(11), torch.zeros(11, dtype=torch.float64), rand(11)])
    want = torch.stack([0.3 * v / (torch.linalg.norm(v) / math.sqrt(11)) for v in V]).nan_to_num(0.0)
    scratch = V.clone()
    out = F.rms_normalize(scratch, scale=0.3, inplace=True)
    assert out.data_ptr() == scratch.data_ptr() and torch.allclose(out, want, atol=1e-14, rtol=0)
    assert torch.equal(F.rms_normalize(V, scale=0.3), out) and not torch.equal(V, out)  # else a copy


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (8, 8)])
def test_orthogonalize_matches_eq3_in_float64(shape):
    H = rand(*shape, seed=3)
    out = F.orthogonalize(H, dtype=torch.float64)
    assert out.dtype == torch.float64
    assert torch.allclose(out, ref_ns(H), atol=1e-12)


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (9, 9), (8, 8)])
def test_orthogonalize_with_symmetric_blocks_matches_eq3_in_float64(shape, monkeypatch):
    """The block-wise symmetric products (3 of 4 blocks, one mirrored) are still eq. 3, also for odd k."""
    monkeypatch.setattr(orthogonalization, "SYMMETRIC_MIN", 2)
    H = rand(*shape, seed=4)
    assert torch.allclose(F.orthogonalize(H, dtype=torch.float64), ref_ns(H), atol=1e-12)


def test_symmetric_blocks_on_bf16_match_the_plain_products(monkeypatch):
    """At a size where the CPU takes the block path, bf16 NS agrees with the full products.

    With this machine's BLAS the two are equal bit for bit (every computed entry is the same dot
    product); the test asserts only bf16-rounding agreement, which any BLAS must give."""
    H = rand(700, 600, seed=6).float()
    assert min(H.shape) >= F.SYMMETRIC_MIN
    blocked = F.orthogonalize(H)
    monkeypatch.setattr(orthogonalization, "SYMMETRIC_MIN", 10**9)
    plain = F.orthogonalize(H)
    assert torch.allclose(blocked.float(), plain.float(), atol=2e-2, rtol=0)
    # A wrong block (e.g. the mirror of the wrong corner) would be O(1) off, far outside bf16 rounding.
    assert (blocked.float() - plain.float()).abs().mean() < 1e-3


def test_orthogonalize_writes_into_out_and_checks_it():
    H = rand(3, 10, 6, seed=8)
    out = torch.empty(3, 10, 6, dtype=torch.float64)
    assert F.orthogonalize(H, dtype=torch.float64, out=out) is out
    assert torch.equal(out, F.orthogonalize(H, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        F.orthogonalize(H, dtype=torch.float64, out=torch.empty(3, 10, 6))  # float32, not float64


@pytest.mark.parametrize("shape", [(3, 12, 5), (3, 5, 12), (2, 2, 8, 8)])
def test_orthogonalize_as_one_stack_matches_eq3_in_float64(shape):
    """``batched=True`` (bmm/baddbmm over the whole stack, the GPU path) is eq. 3 for every matrix."""
    H = rand(*shape, seed=9)
    flat_in = H.view(-1, *shape[-2:])
    flat_in[-1] = 0.0  # a zero matrix in the stack maps to zero (the eps clamp), without NaN
    out = torch.empty(shape, dtype=torch.float64)
    assert F.orthogonalize(H, dtype=torch.float64, batched=True, out=out) is out
    flat_out = out.view(-1, *shape[-2:])
    for k in range(flat_in.shape[0] - 1):
        assert torch.allclose(flat_out[k], ref_ns(flat_in[k]), atol=1e-12), k
    assert torch.count_nonzero(flat_out[-1]) == 0


def test_orthogonalize_batched_equals_per_matrix():
    H = rand(4, 10, 6, seed=5)
    out = F.orthogonalize(H, dtype=torch.float64)
    for k in range(4):
        assert torch.allclose(out[k], ref_ns(H[k]), atol=1e-12)


def test_orthogonalize_bf16_default_dtype_and_zero_input():
    H = rand(6, 4).float()
    assert F.orthogonalize(H).dtype == torch.bfloat16
    z = F.orthogonalize(torch.zeros(5, 3))
    assert torch.count_nonzero(z) == 0 and torch.isfinite(z.float()).all()


def test_orthogonalize_converges_to_polar_factor_with_many_steps():
    """With the convergent cubic (a, b, c) = (1.5, -0.5, 0), NS converges to P Q^T."""
    H = rand(10, 6, seed=7)
    P, _, Qt = torch.linalg.svd(H, full_matrices=False)
    out = F.orthogonalize(H, steps=60, coefficients=(1.5, -0.5, 0.0), dtype=torch.float64)
    assert torch.allclose(out, P @ Qt, atol=1e-10)


@pytest.mark.parametrize("shape", [(10, 6), (6, 10), (8, 8)])
def test_adaptive_normalize_matches_eq8(shape):
    U = F.orthogonalize(imbalanced(*shape, seed=2), dtype=torch.float64)
    out, chose_rows = F.adaptive_normalize(U)
    gr, gc = ref_cv(ref_row_rms(U)), ref_cv(ref_col_rms(U))
    expected = ref_row_norm(U) if gr >= gc else ref_col_norm(U)
    assert bool(chose_rows) == (gr >= gc)
    assert torch.allclose(out, expected, atol=1e-13)


@pytest.mark.parametrize("shape", [(10, 6), (6, 10)])
def test_eq8_factors_are_the_paper_normalisers_and_give_its_output_on_every_block_of_rows(shape):
    """Eq. 8 as factors (an FSDP2 owner sends ``U`` with them, ``optim/sharded.py``): in float64 the chosen
    side's factor is ``rho / RMS`` of each row (or column) from the paper's equations and the other side's is 1;
    applied to the whole matrix or to any block of its rows (a rank's shard) they give
    :func:`F.adaptive_normalize_stacks`' output bit for bit, for a bf16 ``U`` (Newton-Schulz's output) too."""
    m, n = shape
    by_row = torch.linspace(0.1, 3.0, m, dtype=torch.float64)[:, None]
    by_col = torch.linspace(0.1, 3.0, n, dtype=torch.float64)
    U = torch.stack([rand(m, n, seed=4) * by_row, rand(m, n, seed=5) * by_col])  # eq. 8 holds for any U
    ((row, col),), chose = F.adaptive_normalize_factors([U], rho=0.7)
    assert chose[0] != chose[1]  # one matrix of each side
    for k in range(2):
        gr, gc = ref_cv(ref_row_rms(U[k])), ref_cv(ref_col_rms(U[k]))
        assert bool(chose[k]) == (gr >= gc)
        side, other = (row[k, :, 0], col[k, 0]) if gr >= gc else (col[k, 0], row[k, :, 0])
        rms = ref_row_rms(U[k]) if gr >= gc else ref_col_rms(U[k])
        torch.testing.assert_close(side, 0.7 / torch.tensor(rms, dtype=torch.float64), rtol=1e-13, atol=0)
        assert torch.equal(other, torch.ones_like(other))
    for u in (U.float(), U.to(torch.bfloat16)):
        (whole,), chose_whole = F.adaptive_normalize_stacks([u], rho=0.7)
        ((row, col),), chose_f = F.adaptive_normalize_factors([u], rho=0.7)
        assert torch.equal(chose_f, chose_whole)
        assert torch.equal(F.apply_factors(u, row, col), whole)
        for lo, hi in ((0, 1), (1, 4), (4, shape[0])):  # a rank's rows, as it applies them
            assert torch.equal(F.apply_factors(u[:, lo:hi], row[:, lo:hi], col), whole[:, lo:hi])


def test_adaptive_normalize_ties_choose_rows():
    U = torch.ones(4, 4, dtype=torch.float64)  # both CVs are exactly 0
    out, chose_rows = F.adaptive_normalize(U)
    assert bool(chose_rows)
    assert torch.allclose(out, ref_row_norm(U))


def test_adaptive_normalize_batched_chooses_per_matrix():
    a = imbalanced(8, 8, seed=1)
    b = a.T.contiguous()  # transposing swaps the row and column CVs
    out, chose = F.adaptive_normalize(torch.stack([a, b]))
    assert chose[0].item() != chose[1].item()
    for k, m in enumerate((a, b)):
        single, _ = F.adaptive_normalize(m)
        assert torch.allclose(out[k], single)


# ---- properties stated in the issue ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (20, 20)])
def test_adaptive_normalize_properties(seed, shape):
    """The chosen side's CV drops below 1e-6; the other side is not normalised.

    The issue asks for "the other side's CV unchanged to 1e-6". That does not hold in general:
    rescaling rows changes column norms (the paper's own Table 4 shows gate_proj's column CV
    going 0.017 -> 0.018). What does hold, and is asserted here, is that only the chosen side was
    rescaled: undoing the chosen side's scaling recovers ``U`` exactly.
    """
    U = F.orthogonalize(imbalanced(*shape, seed=seed), dtype=torch.float64)
    out, chose_rows = F.adaptive_normalize(U)
    gr2, gc2 = F.row_col_cv(out)
    if chose_rows:
        assert gr2 < 1e-6
        assert torch.allclose(out * F.row_rms(U).unsqueeze(-1), U, atol=1e-13)
    else:
        assert gc2 < 1e-6
        assert torch.allclose(out * F.col_rms(U).unsqueeze(-2), U, atol=1e-13)
    # unit update RMS
    assert out.square().mean().sqrt().item() == pytest.approx(1.0, abs=1e-12)


def test_equilibrate_leaves_column_cv_zero_and_unit_rms():
    X = imbalanced(40, 12, seed=9)
    Y = F.equilibrate(X)
    assert F.row_col_cv(Y)[1] < 1e-6
    assert Y.square().mean().sqrt().item() == pytest.approx(1.0, abs=1e-12)
    assert F.rms_normalize(rand(17)).square().mean().sqrt().item() == pytest.approx(1.0, abs=1e-12)


def test_exact_orthogonalisation_of_tall_matrix_has_zero_column_cv():
    X = imbalanced(30, 10, seed=4)
    P, _, Qt = torch.linalg.svd(X, full_matrices=False)
    Y = P @ Qt
    gr, gc = F.row_col_cv(Y)
    assert gc < 1e-6
    assert gr > 1e-3  # the unconstrained side stays imbalanced
    gr_w, gc_w = F.row_col_cv(Y.T)
    assert gr_w < 1e-6


@pytest.mark.parametrize("fn", [F.row_normalize, F.col_normalize, F.equilibrate, F.rms_normalize])
@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e-9, 1e30])
def test_zero_and_tiny_inputs_never_give_nan_or_inf(fn, scale):
    X = rand(6, 5) * scale
    X[1] = 0.0
    Y = fn(X)
    assert torch.isfinite(Y).all()
    if scale <= 1e-9:
        assert torch.count_nonzero(Y) == 0  # RMS <= 1e-7 counts as zero
    else:
        assert torch.count_nonzero(Y[1]) == 0  # zero rows stay zero


def test_adaptive_normalize_zero_and_tiny():
    for X in (torch.zeros(5, 3), torch.full((5, 3), 1e-20)):
        out, _ = F.adaptive_normalize(X)
        assert torch.isfinite(out).all() and torch.count_nonzero(out) == 0


def test_bf16_input_statistics_in_float32():
    X = imbalanced(8, 6).to(torch.bfloat16)
    out, _ = F.adaptive_normalize(X)
    assert out.dtype == torch.float32


def test_adaptive_normalize_compiles_fullgraph():
    fn = torch.compile(F.adaptive_normalize, fullgraph=True)
    X = imbalanced(12, 7).float()
    out, chose = fn(X)
    ref_out, ref_chose = F.adaptive_normalize(X)
    assert torch.equal(chose, ref_chose)
    assert torch.allclose(out, ref_out, atol=1e-6)


def test_as_matrix_conv_shape():
    w = torch.zeros(8, 3, 3, 3)
    assert F.as_matrix(w).shape == (8, 27)
    with pytest.raises(ValueError, match="at least 2"):
        F.as_matrix(torch.zeros(3))
