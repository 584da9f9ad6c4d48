"""SCALE (OptimAI-Lab/Minimalist_LLM_Pretraining f5bd4e7 ``scale_optimizer.py``; see baselines.md), in every step form.

- Float64 reference (references.py: raw-gradient row RMS normalisation of hidden weights, column
  normalisation of the embedding, EMA momentum 0.9 + row normalisation of the head, Adam with eps on
  the uncorrected ``sqrt(v)`` for vectors; slice RMS clamped at 1e-8): every step form of
  capabilities.py (per-tensor, batched, and both compiled) equals the transcription to 1e-10 after 4
  steps in float64. Only rounding differs; 1e-10 leaves room for the forms' summation orders and none
  for a wrong equation. SCALE has no Nesterov option (its head momentum is a plain EMA) and no
  Newton-Schulz, so each form runs once.
- A tied embedding/head is an error: SCALE normalises the two by different axes, and upstream
  silently drops the head momentum there.
"""

from __future__ import annotations

import pytest
import torch
from capabilities import reference_cases
from references import assert_parameters_close, run_against_reference
from tinynet import make_model

import meqmuon

CASES = reference_cases("scale")


@pytest.mark.parametrize("name, nesterov, form", CASES)
def test_matches_float64_reference(name, nesterov, form):
    _, _, model, ref_model = run_against_reference(name, nesterov, form)
    assert_parameters_close(model, ref_model, atol=1e-10)


def test_scale_rejects_tied_embeddings():
    model = make_model(dtype=torch.float32, tied=True)
    groups = meqmuon.param_groups(model)
    assert [g["kind"] for g in groups] == ["hidden", "embedding", "vector"]
    with pytest.raises(ValueError, match="SCALE cannot update a tied"):
        meqmuon.Scale(groups)
    meqmuon.MeqMuon(groups)  # fine for everyone else
