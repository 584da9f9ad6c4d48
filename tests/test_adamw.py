"""AdamW: the registry's ``adamw`` (torch.optim.AdamW itself) and the AdamW rule of the Muon family.

- Float64 reference: ``adamw`` (``torch.optim.AdamW``, betas (0.9, 0.95), eps 1e-8, weight decay 0.1,
  over the role groups) equals the AdamW transcription of references.py to 1e-10 after 4 steps in
  float64. This holds the reference itself to code we did not write: the same transcription is what
  Muon's, NorMuon's and MuonEq's embedding, head and vectors are tested against in their files.
- The AdamW rule (Muon's embedding/head/vectors) equals ``torch.optim.AdamW`` bit for bit: the
  per-tensor step against ``foreach=False`` (torch's single-tensor arithmetic in the same order, for
  float32 and bf16 parameters) and the batched step against ``foreach=True``. Bit for bit because the
  operations are the same, in the same order, on the same dtypes: any reordering would show.
"""

from __future__ import annotations

import pytest
import torch
from capabilities import reference_cases
from references import assert_parameters_close, run_against_reference
from torch import nn

import meqmuon

CASES = reference_cases("adamw")


@pytest.mark.parametrize("name, nesterov, form", CASES)
def test_matches_float64_reference(name, nesterov, form):
    _, _, model, ref_model = run_against_reference(name, nesterov, form)
    assert_parameters_close(model, ref_model, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_muon_adamw_part_equals_torch_adamw_bit_for_bit(dtype):
    """The AdamW rule (Muon's embedding/head/vectors) runs torch.optim.AdamW's single-tensor
    arithmetic in the same order (its CPU default), so the two agree bit for bit, weight decay on,
    also for bf16 parameters (whose decay factor a ``_foreach_mul_`` would round to bf16)."""
    g = torch.Generator().manual_seed(11)
    shapes = [(40, 16), (40, 16), (16,), (7,)]
    ours_params = [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    torch_params = [nn.Parameter(p.detach().clone()) for p in ours_params]
    kinds = ["embedding", "head", "vector", "vector"]
    ours = meqmuon.Muon(
        [{"params": [p], "kind": k} for p, k in zip(ours_params, kinds, strict=True)],
        lr=3e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
    )
    ref = torch.optim.AdamW(torch_params, lr=3e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(5):
        for p, q in zip(ours_params, torch_params, strict=True):
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, q, s in zip(ours_params, torch_params, shapes, strict=True):
        assert torch.equal(p, q), (s, (p - q).abs().max().item())
        assert torch.equal(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def test_adamw_rule_equals_torch_adamw_foreach_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    shapes = [(40, 16), (40, 16), (16,), (7,)]
    ours_params = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    torch_params = [nn.Parameter(p.detach().clone()) for p in ours_params]
    kinds = ["embedding", "head", "vector", "vector"]
    ours = meqmuon.Muon([{"params": [p], "kind": k} for p, k in zip(ours_params, kinds, strict=True)],
                        lr=3e-2, weight_decay=0.1, foreach=True)
    ref = torch.optim.AdamW(torch_params, lr=3e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    for _ in range(5):
        for p, q in zip(ours_params, torch_params, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_params, torch_params, strict=True):
        assert torch.equal(p, q), (p - q).abs().max().item()
