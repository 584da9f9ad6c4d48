"""Row-block equilibration (``optim/blockwise.py``) against paper eq. 9 written out in float64."""

import pytest
import torch

from meqmuon.optim import blockwise

DELTA = 1e-8


def _reference_step(w, x, lr, wd, rho):
    """``W <- (1 - lr wd) W - lr rho N_c(N_r(X))`` with eq. 4 and 7 spelled out (rows/columns at or
    below delta map to zero)."""
    m = x.shape[0]
    X = x.reshape(m, -1)
    r = (X.square().sum(dim=1) / X.shape[1]).sqrt()
    Y = torch.stack([X[i] / r[i] if r[i] > DELTA else torch.zeros_like(X[i]) for i in range(m)])
    c = (Y.square().sum(dim=0) / m).sqrt()
    Z = torch.stack([Y[:, j] / c[j] if c[j] > DELTA else torch.zeros_like(Y[:, j]) for j in range(Y.shape[1])], 1)
    return (1 - lr * wd) * w - lr * rho * Z.reshape(w.shape)


def test_row_blocks_cover_rows_once():
    blocks = blockwise.row_blocks(10, 3, block_elements=7)  # 2 rows per block
    assert [(b.start, b.stop) for b in blocks] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert blockwise.row_blocks(3, 100, block_elements=7) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert blockwise.row_blocks(0, 4) == []


@pytest.mark.parametrize("shape", [(37, 6), (9, 2, 3)])
@pytest.mark.parametrize("block_elements", [1, 12, 10**6])
def test_equilibrate_step_matches_eq9_float64(shape, block_elements):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    row_scales = torch.rand(shape[0], generator=g, dtype=torch.float64).reshape(-1, *[1] * (len(shape) - 1))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * row_scales
    x[3] = 0.0  # an absent token: its row stays zero, no division by zero
    expected = _reference_step(w, x, lr=0.1, wd=0.2, rho=0.3)
    assert (expected - w).abs().max().item() > 1e-2  # the step moves the parameter
    got = w.clone()
    blockwise.equilibrate_step_(got, lambda rows, out: x[rows], 0.1, 0.2, 0.3, block_elements=block_elements)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_equilibrate_step_updates_a_non_contiguous_parameter_in_place():
    g = torch.Generator().manual_seed(1)
    storage = torch.randn(6, 37, generator=g, dtype=torch.float64)
    w = storage.T  # (37, 6), not contiguous
    x = torch.randn(37, 6, generator=g, dtype=torch.float64)
    expected = _reference_step(w, x, lr=0.1, wd=0.0, rho=1.0)
    blockwise.equilibrate_step_(w, lambda rows, out: x[rows], 0.1, 0.0, 1.0, block_elements=12)
    torch.testing.assert_close(storage.T, expected, rtol=0, atol=1e-12)
