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
