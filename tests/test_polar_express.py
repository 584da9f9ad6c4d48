"""MuonEq (pre-NS equilibration) and Polar Express (per-iteration NS coefficients) against the float64
references of references.py, written from their sources' equations.

- Polar Express (Amsel et al. 2025, Algorithm 1): the schedule in references.py is typed from the
  paper and the safety factor applied there, independently of meqmuon.functional. At 5 iterations in float64,
  the singular values of its output lie closer to 1 than the default quintic's, on a random and on
  a low-rank-plus-noise matrix (measured: max |s - 1| 0.13 vs 0.32 and 0.25 vs 0.59).
- MuonEq R, C and RC (MaeChd/muon-eq 99b6c8b ``muoneq.py``), the RC -> R phase switch, and Polar
  Express inside Muon and MeqMuon: 3 steps on a small model with float32 Newton-Schulz equal a
  float64 reference to 1e-3 (float32 rounding in NS is ~1e-6 here; 1e-3 is the issue's bound), on
  both the per-tensor and the batched step.
- Malformed settings are errors that name the valid choices.
"""

from __future__ import annotations

import copy
import math

import pytest
import references as R
import torch
from capabilities import ONE_PER_HIDDEN_RULE
from references import MUONEQ_MODE, RefOptimizer, kinds_of
from tinynet import batches, loss_fn, make_model

import meqmuon


def test_polar_express_lands_closer_to_one_than_the_quintic():
    g = torch.Generator().manual_seed(0)
    random = torch.randn(64, 128, generator=g, dtype=torch.float64)
    low_rank = (torch.randn(64, 4, generator=g, dtype=torch.float64) @ torch.randn(4, 128, generator=g,
                dtype=torch.float64) + 0.05 * torch.randn(64, 128, generator=g, dtype=torch.float64))
    for M in (random, low_rank, low_rank.T):
        quintic = R.ns_scheduled(M, [(R.A, R.B, R.C)] * 5)
        polar = R.ns_scheduled(M, R.PE[:5], scale=1.01)
        ours = meqmuon.functional.orthogonalize(M, 5, "polar_express", torch.float64)
        assert torch.allclose(ours, polar, rtol=0, atol=1e-12)
        err_q = (torch.linalg.svdvals(quintic) - 1).abs().max().item()
        err_p = (torch.linalg.svdvals(polar) - 1).abs().max().item()
        assert err_p < 0.5 * err_q, (err_p, err_q)


def test_polar_express_beyond_its_list_repeats_the_last_entry():
    sched, scale = meqmuon.functional.ns_schedule("polar_express", 10)
    assert scale == 1.01 and len(sched) == 10 and sched[7:] == (R.PE_RAW[-1],) * 3
    pairs = [(x, y) for s, p in zip(sched, R.PE, strict=False) for x, y in zip(s, p, strict=True)]
    assert all(math.isclose(x, y, rel_tol=1e-15) for x, y in pairs)


def _compare(name, ns_schedule_fn, steps=3, foreach=False, **kw):
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = meqmuon.build_optimizer(name, model, lr=0.03, ns_dtype=torch.float32, foreach=foreach, **kw)
    rules = dict(meqmuon.rules_of(name))
    if rules["hidden"] == "muoneq_hidden":
        rules["hidden"] = "moonlight_hidden"  # the reference's Muon, with E applied in ns() below
    ref = RefOptimizer(kinds_of(ref_model), rules, lr=0.03)
    real_ns = R.ns
    try:
        for step, ids in enumerate(batches(steps), start=1):
            R.ns = lambda H, steps=5, step=step: ns_schedule_fn(H, step)  # noqa: E731
            for m in (model, ref_model):
                m.zero_grad()
                loss_fn(m, ids).backward()
            opt.step()
            ref.step()
    finally:
        R.ns = real_ns
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-3), (n, (p - q).abs().max().item())
    start = make_model()
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), start.parameters(), strict=True)) > 1e-2
    return opt


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("mode", ["R", "C", "RC"])
def test_muoneq_modes_match_a_float64_reference(mode, foreach):
    quintic = [(R.A, R.B, R.C)] * 5
    _compare(f"muoneq-{mode.lower()}", lambda H, step: R.ns_scheduled(R.muoneq_dir(H, mode), quintic), foreach=foreach)


@pytest.mark.parametrize("foreach", [False, True])
def test_muoneq_phase_switches_rc_to_rows(foreach):
    quintic = [(R.A, R.B, R.C)] * 5
    # phase=3: RC at steps 1 and 2, R from step 3 on (upstream's counter starts at 1)
    _compare("muoneq-rc", lambda H, step: R.ns_scheduled(R.muoneq_dir(H, "RC" if step < 3 else "R"), quintic),
             steps=4, foreach=foreach, phase=3)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", ONE_PER_HIDDEN_RULE)
def test_polar_express_inside_the_optimizers_matches_a_float64_reference(name, foreach):
    pre = (lambda H: R.muoneq_dir(H, "R")) if name == "muoneq-r" else (lambda H: H)
    _compare(name, lambda H, step: R.ns_scheduled(pre(H), R.PE[:5], scale=1.01), foreach=foreach,
             ns_coefficients="polar_express")


def test_muoneq_keeps_muons_state_and_routing():
    model = make_model()
    for name in MUONEQ_MODE:
        groups = meqmuon.param_groups(model)
        assert (meqmuon.predicted_state_elements(meqmuon.rules_of(name), groups)
                == meqmuon.predicted_state_elements(meqmuon.rules_of("muon"), groups))
        assert meqmuon.rules_of(name) == {**meqmuon.rules_of("muon"), "hidden": "muoneq_hidden"}


def test_bad_modes_phases_and_coefficients_name_the_valid_ones():
    model = make_model()
    with pytest.raises(ValueError, match="valid modes: R, C, RC"):
        meqmuon.MuonEq(meqmuon.param_groups(model), mode="rows")
    with pytest.raises(ValueError, match="is MuonEq mode R"):
        meqmuon.build_optimizer("muoneq-r", model, mode="C")
    with pytest.raises(ValueError, match="needs mode RC"):
        meqmuon.build_optimizer("muoneq-r", model, phase=10)
    with pytest.raises(ValueError, match="integer step >= 1"):
        meqmuon.build_optimizer("muoneq-rc", model, phase=0)
    with pytest.raises(ValueError, match=r"one of \['polar_express'\]"):
        meqmuon.build_optimizer("muon", model, ns_coefficients="polar-express")
    with pytest.raises(ValueError, match="3 \\(a, b, c\\) triples for ns_steps=5"):
        meqmuon.build_optimizer("meqmuon", model, ns_coefficients=[(3.0, -4.0, 2.0)] * 3)
    with pytest.raises(ValueError, match="invalid ns_coefficients"):
        meqmuon.build_optimizer("normuon", model, ns_coefficients=[(3.0, -4.0)] * 5)
