"""NorMuon (zichongli5/NorMuon d45c9a4 ``normuon.py``, with Muon's lr scale; see baselines.md), in every step form.

Float64 reference (references.py: per-row second moment of the NS output with beta2 0.95 and no bias
correction, ``/(sqrt(v) + 1e-10)``, Frobenius-norm restore, ``rho sqrt(max(m, n))``; AdamW elsewhere):
every step form of capabilities.py (per-tensor, batched, and both compiled), with and without
Nesterov, equals the transcription to 1e-10 after 4 steps in float64 with float64 Newton-Schulz.
Only rounding differs; 1e-10 leaves room for the forms' summation orders and none for a wrong
equation. The row second moment is per row of each matrix, so NorMuon's batched buckets never take
a matrix transposed (capabilities.py; its distributed and view tests are in the cross-cutting files).
"""

from __future__ import annotations

import pytest
from capabilities import reference_cases
from references import assert_parameters_close, run_against_reference

CASES = reference_cases("normuon")


@pytest.mark.parametrize("name, nesterov, form", CASES)
def test_matches_float64_reference(name, nesterov, form):
    _, _, model, ref_model = run_against_reference(name, nesterov, form)
    assert_parameters_close(model, ref_model, atol=1e-10)


def test_normuon_factors_give_its_direction_bit_for_bit_on_every_block_of_rows():
    """NorMuon's ``post`` as factors (an FSDP2 or TP owner sends ``U`` with them, ``optim/sharded.py``): in float64
    the row divisors are ``sqrt(v) + 1e-10`` of the updated second moments and the restoring scale is
    ``||O||_F / (||O'||_F + 1e-10)`` (the reference's equations, above); ``(U / divisor) * scale`` on the whole
    matrix or on any block of its rows is :func:`normuon_normalize`'s output bit for bit, bf16 ``U`` included,
    and ``v`` is updated alike."""
    import torch

    from meqmuon import functional as F
    from meqmuon.optim.rules.normuon import normuon_factors, normuon_normalize

    g = torch.Generator().manual_seed(0)
    rows = torch.linspace(0.2, 2.0, 12, dtype=torch.float64)[:, None]
    U = torch.randn(2, 12, 7, generator=g, dtype=torch.float64) * rows
    v0 = torch.rand(2, 12, generator=g, dtype=torch.float64)
    v = v0.clone()
    divisors, scale = normuon_factors(U, v, 0.95)
    v_ref = 0.95 * v0 + 0.05 * U.square().mean(dim=-1)
    torch.testing.assert_close(v, v_ref, rtol=1e-15, atol=0)
    torch.testing.assert_close(divisors[..., 0], v_ref.sqrt() + 1e-10, rtol=1e-15, atol=0)
    Oh = U / (v_ref.sqrt()[..., None] + 1e-10)
    restore = torch.linalg.norm(U, dim=(-2, -1)) / (torch.linalg.norm(Oh, dim=(-2, -1)) + 1e-10)
    torch.testing.assert_close(scale[:, 0, 0], restore, rtol=1e-14, atol=0)
    assert scale.shape == (2, 1, 7) and torch.equal(scale, scale[:, :, :1].expand(2, 1, 7))
    for u in (U.float(), U.to(torch.bfloat16)):
        whole = normuon_normalize(u.float(), v0.float().clone(), 0.95)
        d, s = normuon_factors(u, v0.float().clone(), 0.95)
        for lo, hi in ((0, 12), (0, 1), (5, 12)):  # a rank's rows, as it applies them
            assert torch.equal(F.apply_factors(u[:, lo:hi], d[:, lo:hi], s, divide=True), whole[:, lo:hi])
