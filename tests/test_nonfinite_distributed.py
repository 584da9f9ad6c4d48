"""Every step all or nothing under ``torch.distributed`` (issue 56): the ranks decide alike.

On 2 gloo ranks, under DDP's layout (plain tensors, the process group initialised: the exchange's owners), FSDP2
(``fully_shard`` of each layer), TP (``parallelize_module``: colwise, then rowwise) and a stack of experts sharded
on its dimension 1 with ``exchange_unit="matrix"`` (each expert a unit), per tensor and batched:

- a NaN in one rank's gradient piece only (the other rank's gradients finite) skips the step on *both* ranks: no
  parameter and no state tensor changes on either, and both count the step as skipped (the skip flag's one
  all-reduce); without it the rank with finite gradients would step alone (``nonfinite="propagate"``: the
  negative control, where its parameters change);
- a rule that raises on one rank only (a user ``HiddenRule`` whose ``post`` raises at rank 0's owned matrices)
  raises there, naming the rule, while the other rank, which computed its own matrices without error, commits
  nothing either: every tensor on both ranks as before the step.

Each both with the flag read on the host once the ranks agree (a CPU's step, ``decision.ON_HOST``) and folded into
the writes (a GPU's).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_distributed import _spawn

import meqmuon

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

#: (out, in) of the layers: two hidden matrices of one shape bucket and one of another.
SHAPES = [(32, 16), (16, 32), (32, 32)]


class Boom(meqmuon.HiddenRule):
    """Muon's directions, whose ``post`` raises while ``fail`` is set (set on one rank only)."""

    name = "boom"

    def __init__(self) -> None:
        self.fail = False

    def post(self, U, group, state=None):
        if self.fail:
            raise ValueError("post does not take this")
        return U


def _model(layout: str, mesh):
    torch.manual_seed(0)
    if layout == "experts":  # four experts of one shape, each rank a slice of every one
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4, *SHAPES[0]) / 4)])
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
        return model
    model = torch.nn.Sequential(*(torch.nn.Linear(n, m, bias=False) for m, n in SHAPES))
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer, mesh=mesh)
    elif layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": ColwiseParallel()})
    return model


def _set_grads(params, step: int, layout: str, mesh) -> None:
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(7 + step)
    for p in params:
        grad = torch.randn(p.shape, generator=g)
        p.grad = grad if layout == "ddp" else distribute_tensor(grad, mesh, p.placements)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(params, opt) -> list[torch.Tensor]:
    out = [_local(p).detach().clone() for p in params]
    for st in opt.state.values():
        out += [_local(v).clone() for k, v in sorted(st.items()) if torch.is_tensor(v) and k != "skipped_steps"]
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _worker(rank: int, layout: str, foreach: bool) -> dict:
    """Both ways of deciding: the flag read on the host (a CPU's step) and folded into the writes (a GPU's)."""
    from meqmuon.optim import decision

    out = {}
    for on_host in (("cpu",), ()):
        decision.ON_HOST = on_host
        out[bool(on_host)] = _decide(rank, layout, foreach)
    return out


def _groups(params, layout: str) -> list[dict]:
    return [{"params": params, "kind": "hidden", **({"views": "stacked"} if layout == "experts" else {})}]


def _unit(layout: str) -> dict:
    return {"exchange_unit": "matrix"} if layout == "experts" else {}


def _decide(rank: int, layout: str, foreach: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for nonfinite in ("skip", "propagate"):
        model = _model(layout, mesh)
        params = list(model.parameters())
        opt = meqmuon.Muon(_groups(params, layout), lr=0.02, ns_dtype=torch.float32, foreach=foreach,
                           nonfinite=nonfinite, **_unit(layout))
        _set_grads(params, 0, layout, mesh)
        opt.step()
        _set_grads(params, 1, layout, mesh)
        if rank == 1:  # one entry of rank 1's piece: rank 0's gradients stay finite
            _local(params[0].grad).view(-1)[0] = float("nan")
        before = _snapshot(params, opt)
        opt.step()
        out[nonfinite] = {"unchanged": _same(before, _snapshot(params, opt)), "skipped": opt.skipped_steps()}
    # a rule that raises at rank 0's owned matrices only
    boom = Boom()
    model = _model(layout, mesh)
    params = list(model.parameters())
    opt = meqmuon.Muon(_groups(params, layout), lr=0.02, ns_dtype=torch.float32, foreach=foreach,
                       rules={"hidden": boom}, **_unit(layout))
    _set_grads(params, 0, layout, mesh)
    opt.step()
    _set_grads(params, 1, layout, mesh)
    boom.fail = rank == 0
    before = _snapshot(params, opt)
    try:
        opt.step()
        out["raised"] = None
    except ValueError as e:
        out["raised"] = str(e)
    out["error_unchanged"] = _same(before, _snapshot(params, opt))
    boom.fail = False
    opt.step()  # fixed: the next step steps on every rank
    out["after_fix_changed"] = not _same(before, _snapshot(params, opt))
    out["units"] = len(opt._exchange.units) if opt._exchange is not None else 0  # the exchange's units
    return out


@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "batched"])
@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "tp", "experts"])
def test_every_rank_skips_and_no_rank_commits_while_another_raised(layout, foreach, tmp_path):
    for got in zip(*(g.values() for g in _spawn(_worker, tmp_path, layout, foreach)), strict=True):
        _check(layout, got)


def _check(layout: str, got: tuple[dict, ...]) -> None:
    for rank, r in enumerate(got):
        assert r["skip"] == {"unchanged": True, "skipped": 1}, (layout, rank, r["skip"])
        assert r["error_unchanged"] and r["after_fix_changed"], (layout, rank, r)
        assert layout != "experts" or r["units"] == 4, r["units"]  # an expert each
    # the negative control: without the skip, rank 0 (finite gradients) steps
    assert got[0]["propagate"] == {"unchanged": False, "skipped": 0}, got[0]["propagate"]
    assert got[0]["raised"] is not None and "rule 'boom'" in got[0]["raised"], got[0]["raised"]
    assert got[1]["raised"] is None, got[1]["raised"]  # its own part raised nothing: it skipped with rank 0
