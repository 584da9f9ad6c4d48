"""Muon (Moonlight's form, paper eq. 2) and MuonEq (R, C, RC, and the RC -> R phase switch), in every step form.

- Float64 reference (references.py: Moonlight toy_train.py; MaeChd/muon-eq 99b6c8b ``muoneq.py``):
  ``muon``, ``muoneq-r``, ``muoneq-c`` and ``muoneq-rc`` in every step form of capabilities.py
  (per-tensor, batched, and both compiled), with and without Nesterov, equal the transcription to
  1e-10 after 4 steps in float64 with float64 Newton-Schulz (only rounding differs; 1e-10 leaves
  room for the forms' summation orders and none for a wrong equation).
- MuonEq's modes and its phase switch, with float32 Newton-Schulz, per-tensor and batched: 3 (4 for
  the phase) steps equal a float64 reference that applies the equilibration inside ``ns`` to 1e-3
  (float32 rounding in NS is ~1e-6 here; 1e-3 is the bound the MuonEq port was accepted with).
  MuonEq keeps Muon's state and routing; malformed modes and phases name the valid ones.
- Parity with code we did not write: Muon equals ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``
  + ``torch.optim.AdamW((0.9, 0.95))`` on a small ``nn.TransformerEncoder`` to 2e-6 after 6 steps,
  both sides with float32 Newton-Schulz (torch's bf16 NS rounds by about a third of a step; see the
  test). The AdamW part alone is held to torch bit for bit in test_adamw.py.
"""

from __future__ import annotations

import copy

import pytest
import references as R
import torch
from capabilities import reference_cases
from references import MUONEQ_MODE, assert_parameters_close, compare_scheduled_ns, run_against_reference
from tinynet import loss_fn, make_model
from torch import nn

import meqmuon

CASES = reference_cases("muon", *MUONEQ_MODE)


@pytest.mark.parametrize("name, nesterov, form", CASES)
def test_matches_float64_reference(name, nesterov, form):
    _, _, model, ref_model = run_against_reference(name, nesterov, form)
    assert_parameters_close(model, ref_model, atol=1e-10)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("mode", ["R", "C", "RC"])
def test_muoneq_modes_match_a_float64_reference(mode, foreach):
    quintic = [(R.A, R.B, R.C)] * 5
    compare_scheduled_ns(f"muoneq-{mode.lower()}", lambda H, step: R.ns_scheduled(R.muoneq_dir(H, mode), quintic),
                         foreach=foreach)


@pytest.mark.parametrize("foreach", [False, True])
def test_muoneq_phase_switches_rc_to_rows(foreach):
    quintic = [(R.A, R.B, R.C)] * 5
    # phase=3: RC at steps 1 and 2, R from step 3 on (upstream's counter starts at 1)
    compare_scheduled_ns("muoneq-rc",
                         lambda H, step: R.ns_scheduled(R.muoneq_dir(H, "RC" if step < 3 else "R"), quintic),
                         steps=4, foreach=foreach, phase=3)


def test_muoneq_keeps_muons_state_and_routing():
    model = make_model()
    for name in MUONEQ_MODE:
        groups = meqmuon.param_groups(model)
        assert (meqmuon.predicted_state_elements(meqmuon.rules_of(name), groups)
                == meqmuon.predicted_state_elements(meqmuon.rules_of("muon"), groups))
        assert meqmuon.rules_of(name) == {**meqmuon.rules_of("muon"), "hidden": "muoneq_hidden"}


def test_bad_modes_and_phases_name_the_valid_ones():
    model = make_model()
    with pytest.raises(ValueError, match="valid modes: R, C, RC"):
        meqmuon.MuonEq(meqmuon.param_groups(model), mode="rows")
    with pytest.raises(ValueError, match="is MuonEq mode R"):
        meqmuon.build_optimizer("muoneq-r", model, mode="C")
    with pytest.raises(ValueError, match="needs mode RC"):
        meqmuon.build_optimizer("muoneq-r", model, phase=10)
    with pytest.raises(ValueError, match="integer step >= 1"):
        meqmuon.build_optimizer("muoneq-rc", model, phase=0)


# ---- Muon parity with torch.optim.Muon + torch.optim.AdamW -------------------------------------


class SmallTransformer(nn.Module):
    def __init__(self, vocab=40, d=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        # bias=False: an attention key bias has an exactly-zero true gradient (softmax is invariant
        # to it), so AdamW would amplify pure rounding noise there and no parity test could pass.
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, bias=False)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.lm_head(self.norm(self.blocks(self.embed_tokens(ids), mask=mask, is_causal=True)))


def test_muon_parity_with_torch_muon_and_adamw(monkeypatch):
    """Moonlight-form Muon == torch.optim.Muon(match_rms_adamw) + torch.optim.AdamW((0.9, 0.95)).

    torch's Newton-Schulz always runs in bf16, whose rounding noise is about a third of one step
    (6.6e-4 to 7.5e-4 against float32 NS at lr 1e-2), so both sides run NS in float32 here: torch's
    function is patched to compute in float32 and ours gets ns_dtype=float32. Tolerance 2e-6 after 6 steps.
    """
    import torch.optim._muon as tm

    original = tm._zeropower_via_newtonschulz

    def ns_fp32(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        X = grad.float()
        if grad.size(0) > grad.size(1):
            X = X.T
        X = X / X.norm().clamp(min=eps)
        for _ in range(ns_steps):
            G = X @ X.T
            X = torch.addmm(X, torch.addmm(G, G, G, beta=b, alpha=c), X, beta=a)
        return X.T if grad.size(0) > grad.size(1) else X

    monkeypatch.setattr(tm, "_zeropower_via_newtonschulz", ns_fp32)
    assert tm._zeropower_via_newtonschulz is not original

    torch.manual_seed(0)
    ours_model = SmallTransformer()
    torch_model = copy.deepcopy(ours_model)
    initial = copy.deepcopy(ours_model)
    # split_fused=False: torch.optim.Muon orthogonalises nn.MultiheadAttention's in_proj_weight whole,
    # where param_groups would split it into q, k, v.
    ours = meqmuon.Muon(meqmuon.param_groups(ours_model, split_fused=False), lr=2e-2, weight_decay=0.1,
                        ns_dtype=torch.float32)
    groups = meqmuon.param_groups(torch_model, split_fused=False)
    hidden = [p for g in groups if g["kind"] == "hidden" for p in g["params"]]
    rest = [p for g in groups if g["kind"] != "hidden" for p in g["params"]]
    assert all(p.ndim == 2 for p in hidden) and len(hidden) == 8
    t_muon = torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    t_adamw = torch.optim.AdamW(rest, lr=2e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        ids = torch.randint(0, 40, (4, 10), generator=g)
        for m in (ours_model, torch_model):
            m.zero_grad()
            loss_fn(m, ids).backward()
        ours.step()
        t_muon.step()
        t_adamw.step()
    worst = max(
        (p - q).abs().max().item() for p, q in zip(ours_model.parameters(), torch_model.parameters(), strict=True)
    )
    moved = max((p - q).abs().max().item() for p, q in zip(ours_model.parameters(), initial.parameters(), strict=True))
    assert moved > 1e-2  # the parameters really moved
    assert worst < 2e-6
