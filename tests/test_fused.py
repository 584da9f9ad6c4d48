"""``compile=True`` (``optim/fused.py``): same maths as eager; no recompilation when lr / weight decay change.

Equality: the compiled kernels fuse the same expressions; in float64 (model and Newton-Schulz, so
that bf16 NS rounding does not amplify last-bit differences of the fused arithmetic through the
gradients) parameters agree with the eager optimizer to 1e-10 after 5 steps, and the row/column
choices are identical. Recompilation is detected with dynamo's own counters
(``torch._dynamo.utils.counters``), never with timing.
"""

import pytest
import torch
from test_optimizers import batches, loss_fn, make_model

import meqmuon


def _run(model, opt, sched, n):
    for ids in batches(n, seed=5):
        opt.zero_grad()
        loss_fn(model, ids).backward()
        opt.step()
        sched.step()


def _sched(opt):
    # lr and weight decay change every step
    def hook(optimizer, *_):
        for g in optimizer.param_groups:
            g["weight_decay"] += 0.01

    opt.register_step_post_hook(hook)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def test_compiled_matches_eager_and_does_not_recompile():
    from torch._dynamo.utils import counters

    from meqmuon.optim import fused

    torch._dynamo.reset()
    fused._compiled.clear()
    eager_model = make_model()
    comp_model = make_model()
    eager = meqmuon.MeqMuon(meqmuon.param_groups(eager_model), lr=0.02, ns_dtype=torch.float64)
    comp = meqmuon.MeqMuon(meqmuon.param_groups(comp_model), lr=0.02, ns_dtype=torch.float64, compile=True)
    e_sched, c_sched = _sched(eager), _sched(comp)
    _run(eager_model, eager, e_sched, 2)
    _run(comp_model, comp, c_sched, 2)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the fused kernels really were compiled
    assert sorted(fused._compiled) == ["adaptive_update"]  # whole matrices: statistics and step in one graph
    lrs = {g["lr"] for g in comp.param_groups}
    _run(eager_model, eager, e_sched, 3)
    _run(comp_model, comp, c_sched, 3)
    assert {g["lr"] for g in comp.param_groups} != lrs and comp.param_groups[0]["weight_decay"] > 0.14  # 0.1 + 5 * 0.01
    assert counters["stats"]["unique_graphs"] == graphs  # lr / wd changes did not recompile
    for (n, p), q in zip(eager_model.named_parameters(), comp_model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-10), (n, (p - q).abs().max().item())
    assert eager.selection_counts() == comp.selection_counts()
    # the counter does see recompiles: a new input shape compiles a new graph
    u, row, col = torch.randn(3, 5), torch.ones(3, 1), torch.ones(1, 5)
    fused.scaled_update(torch.zeros(3, 5), u, row, col, {"lr": 0.1, "weight_decay": 0.0}, 0.2)
    assert counters["stats"]["unique_graphs"] > graphs
    moved = (eager_model.q.weight - make_model().q.weight).abs().max().item()
    assert moved > 1e-3


def test_compile_flag_is_validated():
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="compile"):
        meqmuon.MeqMuon(meqmuon.param_groups(model), compile="yes")
