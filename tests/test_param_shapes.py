"""Every optimizer, in every step form of the capability table, steps parameters of every rank.

A model holds a 0-D scalar (CLIP's ``logit_scale``), a 1-D vector, a one-row matrix, a 2-D matrix, a
3-D stack and a 4-D kernel, routed by :func:`meqmuon.param_groups`, and also passed as plain
parameters (kinds inferred from shape). Each form takes three steps without an error, every
parameter moves and stays finite, and the 0-D scalar moves exactly as a one-element vector twin
holding the same value with the same gradient (its kind's vector rule, not a special case).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from capabilities import CAPABILITIES, FORM_KWARGS, every_form

import meqmuon

SHAPES = {"vec": (8,), "one_row": (1, 8), "mat": (6, 8), "stack": (3, 4, 5), "kernel": (4, 3, 2, 2)}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.scalar = torch.nn.Parameter(torch.tensor(1.5))
    m.scalar_twin = torch.nn.Parameter(torch.tensor([1.5]))
    for name, shape in SHAPES.items():
        setattr(m, name, torch.nn.Parameter(torch.randn(shape)))
    return m


def _loss(m: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    loss = (m.scalar * 0.7 + m.scalar_twin[0] * 0.7) * (step + 1)  # the same gradient for both
    for name in SHAPES:
        p = getattr(m, name)
        loss = loss + (p * torch.randn(p.shape, generator=g)).sum() + p.square().sum()
    return loss


def test_every_optimizer_has_a_form_here():
    assert {n for n, _ in every_form()} == set(CAPABILITIES)


@pytest.mark.parametrize("routing", ["param_groups", "plain"])
@pytest.mark.parametrize(("name", "form"), every_form())
def test_every_rank_of_parameter_steps(name, form, routing):
    m = _model()
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    target = m if routing == "param_groups" else list(m.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the inferred-kinds warning of plain parameters
        opt = meqmuon.build_optimizer(name, target, lr=1e-2, weight_decay=0.1, **FORM_KWARGS[form])
        for step in range(3):
            opt.zero_grad()
            _loss(m, step).backward()
            opt.step()
    for n, p in m.named_parameters():
        assert torch.isfinite(p).all(), n
        assert not torch.equal(p, start[n]), f"{n} did not move"
    assert m.scalar.shape == ()
    torch.testing.assert_close(m.scalar.reshape(1), m.scalar_twin, rtol=1e-6, atol=0)
