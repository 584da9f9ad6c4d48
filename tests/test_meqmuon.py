"""MeqMuon's rules (paper eq. 8-10) and the Table 7 ablations that use them, in every step form.

- Float64 reference (references.py, written from Algorithm 1 and eq. 2-11 with plain loops): MeqMuon
  and its ablations (``meqmuon-only-hidden``, ``-only-embedding``, ``-only-vector``: Muon with one of
  MeqMuon's rules) in every step form of capabilities.py (per-tensor, batched, and both compiled),
  with and without Nesterov, equal the transcription to 1e-10 after 4 steps. Everything runs in
  float64 with float64 Newton-Schulz, so only rounding differs; 1e-10 leaves ~1e5 ulps of room for
  the different summation orders of the forms (batched matmuls, foreach kernels, fused graphs) and
  nothing for a wrong equation. The hidden rule's row/column choices (eq. 8) equal the reference's,
  matrix by matrix.
- Properties of eq. 8-10 that a reader can check by hand: every MeqMuon-normalised kind moves by
  exactly ``rho lr`` in RMS (to 1e-9 relative: float64 rounding of a mean of squares); zero rows
  (absent tokens) of the embedding stay zero; a tall matrix's NS output normalises rows, a wide
  one's columns; a rho that changes every step is followed by the batched step as by the
  per-tensor one (float32, 1e-5: the two forms' summation orders) without growing its workspace.
- The ablations' rule tables differ from Muon's in exactly the kinds Table 7 names.
"""

from __future__ import annotations

import pytest
import torch
from capabilities import CAPABILITIES, WITH_MEQ_RULES, reference_cases
from references import assert_parameters_close, run_against_reference
from tinynet import batches, loss_fn, make_model
from torch import nn

import meqmuon

CASES = reference_cases("meqmuon", "meqmuon-only-hidden", "meqmuon-only-embedding", "meqmuon-only-vector")


@pytest.mark.parametrize("name, nesterov, form", CASES)
def test_matches_float64_reference(name, nesterov, form):
    opt, ref, model, ref_model = run_against_reference(name, nesterov, form)
    assert_parameters_close(model, ref_model, atol=1e-10)
    if CAPABILITIES[name].rules["hidden"] == "meq_hidden":  # MeqMuon's row/column choices, too
        counts = opt.selection_counts()
        names = dict(ref_model.named_parameters())
        for pname, (rows, cols) in counts.items():
            assert rows + cols == 4
            assert rows == ref.rows_chosen[id(names[pname])], pname


def test_rule_tables():
    assert meqmuon.rules_of("meqmuon") == {
        "hidden": "meq_hidden",
        "embedding": "equilibrate",
        "head": "equilibrate",
        "vector": "rms_normalize",
    }
    muon = meqmuon.rules_of("muon")
    for ablation, kinds in [
        ("meqmuon-only-hidden", {"hidden"}),
        ("meqmuon-only-embedding", {"embedding", "head"}),
        ("meqmuon-only-vector", {"vector"}),
    ]:
        table = meqmuon.rules_of(ablation)
        assert {k for k in table if table[k] != muon[k]} == kinds
        for k in kinds:
            assert table[k] == meqmuon.rules_of("meqmuon")[k]


@pytest.mark.parametrize("name", WITH_MEQ_RULES)
def test_meqmuon_step_rms_is_rho_lr(name):
    """Every MeqMuon-normalised kind moves by exactly rho*lr in RMS (weight decay off)."""
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = meqmuon.build_optimizer(name, model, lr=0.05, weight_decay=0.0, ns_dtype=torch.float64)
    loss_fn(model, batches(1)[0]).backward()
    opt.step()
    meq = {k for k, r in meqmuon.rules_of(name).items() if r in ("meq_hidden", "equilibrate", "rms_normalize")}
    checked = 0
    for g in meqmuon.param_groups(model):
        if g["kind"] not in meq:
            continue
        for n, p in zip(g["names"], g["params"], strict=True):
            # Rows of absent tokens stay zero; columns are normalised over all rows (eq. 4 divides
            # by sqrt(m)), so the whole-matrix RMS is still exactly 1.
            delta = p.detach() - before[n]
            assert delta.square().mean().sqrt().item() == pytest.approx(0.2 * 0.05, rel=1e-9), n
            checked += 1
    assert checked > 0


def test_zero_rows_stay_zero_in_embedding_update():
    model = make_model()
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=0.1, weight_decay=0.0, ns_dtype=torch.float64)
    before = model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([[1, 2, 3, 4]])
    loss_fn(model, ids).backward()
    opt.step()
    changed = (model.embed_tokens.weight - before).abs().sum(1) > 0
    assert changed.nonzero().flatten().tolist() == [1, 2, 3, 4]


def test_selection_follows_geometry():
    """A tall matrix's NS output has near-equal columns, so MeqMuon normalises rows; wide: columns."""
    tall = nn.Parameter(torch.zeros(64, 16))
    wide = nn.Parameter(torch.zeros(16, 64))
    opt = meqmuon.MeqMuon([{"params": [tall, wide], "names": ["tall", "wide"], "kind": "hidden"}], lr=0.1)
    for s in range(5):
        g = torch.Generator().manual_seed(s)
        tall.grad = torch.randn(64, 16, generator=g) * torch.linspace(0.1, 3, 64)[:, None]
        wide.grad = tall.grad.T.contiguous()
        opt.step()
    assert opt.selection_counts() == {"tall": (5, 0), "wide": (0, 5)}


def test_changing_rho_is_followed_and_does_not_grow_the_workspace():
    """MeqMuon folds rho into cached factors; a rho that changes every step must be followed (same
    result as the per-tensor step) without a new buffer per value."""
    runs = []
    for foreach in (False, True):
        model = make_model(dtype=torch.float32)
        opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=0.02, ns_dtype=torch.float32, foreach=foreach)
        sizes = []
        for i, ids in enumerate(batches(4)):
            for g in opt.param_groups:
                g["rho"] = 0.2 + 0.05 * i
            model.zero_grad()
            loss_fn(model, ids).backward()
            opt.step()
            sizes.append(opt.workspace_bytes())
        runs.append((model, sizes))
    for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-5 * p.abs().max().item())
    assert len(set(runs[1][1])) == 1 and runs[1][1][0] > 0
