"""Framework contracts: what the frameworks people train with expect of an optimizer, each written down
and tested (issue 37). CPU; gloo (2 processes) where distributed.

- **torchtitan** (pytorch/torchtitan ``torchtitan/components/optimizer/optimizer.py`` at b5bcd76,
  ``OptimizersContainer._build_param_groups``; before it ``torchtitan/components/optimizer.py``,
  ``build_optimizers``): every param group carries ``fused`` and ``foreach`` (from its ``implementation``)
  and ``param_names`` (FQNs, for its flat ``state.{fqn}.{name}`` checkpoint dicts). Every registered
  optimizer accepts such groups; ``fused`` changes nothing (bit for bit). The flat state dict of
  ``get_optimizer_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))`` loaded with
  ``set_optimizer_state_dict`` into a fresh model and optimizer continues bit for bit like the
  uninterrupted run (every optimizer, per-tensor and batched; one compiled case). Before saving, torch
  (``_init_optim_state``) and torchtitan (``init_optim_state``) run one step with all-zero gradients and
  ``lr=0`` to create the state: it changes no parameter, leaves every state tensor finite and every
  momentum / moment zero, for every optimizer and step form (compiled: two cases, ~10-30 s each) and under
  FSDP2 on 2 ranks (microsoft/dion#24 was NorMuon's NaN there). ``meqmuon.integrations.torchtitan`` on
  torchtitan's own classes: tests/test_torchtitan.py.
- **accelerate** (``accelerate.utils.fsdp_utils.fsdp2_switch_optimizer_parameters``; the steps around it
  from ``Accelerator._prepare_fsdp2``): an optimizer built on the unsharded model, whose parameters are
  swapped for FSDP2's DTensors after construction, steps like one built on the sharded model (2 ranks,
  float32 Newton-Schulz, 1e-6; every optimizer).
- **DeepSpeed ZeRO** hands optimizers flat 1-D partitions (deepspeedai/DeepSpeed#8438, #8441): a
  Muon-family optimizer given no matrix says so at construction, a ``UserWarning`` naming the reason.
- **Gradient accumulation** (DeepSpeed#8443 ran Newton-Schulz once per micro-batch): ``meqmuon train``
  with ``--micro-batch`` below ``--global-batch`` equals one pass over the global batch (float32, 1e-6),
  for every optimizer in one process (Adam-type rules at ``eps=1e-3``: at 1e-8 Adam turns the rounding of
  near-zero gradients into parts of ``lr``, whatever the accumulation; the test says more); under DDP
  (2 processes, ``torchrun``'s environment) for MeqMuon. Not under FSDP2: the harness has no ``--fsdp`` yet.
"""

from __future__ import annotations

import copy
import io
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from capabilities import CAPABILITIES, ENGINE, FORM_KWARGS, every_form
from test_distributed import _spawn
from tinynet import batches, loss_fn, make_model
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

import meqmuon
from meqmuon.optim.registry import REGISTRY

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
#: The compiled forms run here: a compiled case costs 10-30 s. NorMuon's batched step (its second moment
#: of a zero gradient is the NaN dion#24 had) and MeqMuon's per-tensor step (its adaptive row/column choice).
COMPILED = [("normuon", "batched-compile"), ("meqmuon", "compile")]


def _kwargs(name: str, form: str = "per-tensor") -> dict:
    """lr 0.02, float32 Newton-Schulz where the optimizer has it, and the form's keywords."""
    kw = dict(FORM_KWARGS[form])
    if CAPABILITIES[name].newton_schulz:
        kw["ns_dtype"] = torch.float32
    return {"lr": 0.02, **kw}


def _titan_groups(model: nn.Module, foreach: bool | None, fused: bool = True) -> list[dict]:
    """meqmuon's groups with the keys torchtitan adds to each of its own (``_build_param_groups``)."""
    groups = meqmuon.param_groups(model)
    for g in groups:
        g.update(fused=fused, foreach=foreach, param_names=list(g["names"]))
    return groups


def _grad_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    opt.zero_grad()
    loss_fn(model, ids).backward()
    opt.step()


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cases(compiled: list[tuple[str, str]]) -> list:
    """Every (optimizer, form) pair without compile, and the compiled pairs ``compiled``."""
    pairs = [(n, f) for n, f in every_form() if "compile" not in f] + compiled
    return [pytest.param(n, f, id=f"{n}-{f}") for n, f in pairs]


# ---- torchtitan -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REGISTRY))
def test_torchtitan_group_keys_are_accepted_and_fused_changes_nothing(name):
    """Groups with ``fused``, ``foreach`` and ``param_names`` build, step, and keep ``param_names`` in the
    state dict (torchtitan's checkpoint keys); ``fused=True`` steps bit for bit like no ``fused`` key (the
    meqmuon engine has no fused kernel: the key is accepted and ignored)."""
    form = "torch" if name == "adamw" else "per-tensor"
    runs = []
    for fused in (True, None):
        model = make_model(torch.float32)
        groups = _titan_groups(model, foreach=False if name != "adamw" else None, fused=bool(fused))
        if fused is None:
            for g in groups:
                del g["fused"]
        opt = meqmuon.build_optimizer(name, groups, **_kwargs(name, form))
        for ids in batches(2):
            _grad_step(model, opt, ids)
        runs.append(_snapshot(model))
        saved = opt.state_dict()["param_groups"]
        assert [g["param_names"] for g in saved] == [g["names"] for g in groups]
        assert all(torch.isfinite(v).all() for v in runs[-1].values())
    if name != "adamw":  # torch's fused AdamW is another kernel
        for k, v in runs[0].items():
            assert torch.equal(v, runs[1][k]), k


@pytest.mark.parametrize("name", ENGINE)
def test_torchtitan_regex_groups_without_kind_are_accepted(name):
    """torchtitan's own groups (regex on names: one catch-all group, no ``kind``) build and step, with the
    warning that kinds are inferred from shape (route with meqmuon.param_groups for roles)."""
    model = make_model(torch.float32)
    named = [(n, p) for n, p in model.named_parameters()]
    group = {"params": [p for _, p in named], "param_names": [n for n, _ in named], "fused": True, "foreach": False}
    with pytest.warns(UserWarning, match="has no 'kind'"):
        opt = meqmuon.build_optimizer(name, [group], **_kwargs(name))
    _grad_step(model, opt, batches(1)[0])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(("name", "form"), _cases([("meqmuon", "compile")]))
def test_flat_state_dict_round_trip_continues_bit_for_bit(name, form):
    """Save the flat dict after 2 updates (through ``torch.save``, as a checkpoint), load it into a fresh
    model and optimizer, take 2 more: bit for bit the uninterrupted run's parameters and state."""
    kw = _kwargs(name, form)
    data = batches(4)
    model = make_model(torch.float32)
    opt = meqmuon.build_optimizer(name, _titan_groups(model, kw.get("foreach")), **kw)
    for ids in data[:2]:
        _grad_step(model, opt, ids)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt, options=FLAT)}, buf)
    assert any(k.startswith("state.q.weight.") for k in torch.load(io.BytesIO(buf.getvalue()))["optim"])
    for ids in data[2:]:
        _grad_step(model, opt, ids)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = make_model(torch.float32, seed=1)
    fresh.load_state_dict(saved["model"])
    opt2 = meqmuon.build_optimizer(name, _titan_groups(fresh, kw.get("foreach")), **kw)
    set_optimizer_state_dict(fresh, opt2, saved["optim"], options=FLAT)
    for ids in data[2:]:
        _grad_step(fresh, opt2, ids)
    for (k, v), w in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    _assert_same_optimizer_state(opt, opt2)


def _assert_same_optimizer_state(opt, opt2) -> None:
    """The two state dicts: the same state tensors bit for bit, and the same param groups."""
    sa, sb = opt.state_dict(), opt2.state_dict()
    a, b = sa["state"], sb["state"]
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys(), i
        for key, v in a[i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b[i][key])), (i, key)
    assert sa["param_groups"] == sb["param_groups"]


def _check_zero_step(params: dict[str, torch.Tensor], before: dict[str, torch.Tensor], opt) -> None:
    """No parameter changed; every state tensor finite; every floating state but the step count zero."""
    for k, p in params.items():
        assert torch.equal(p, before[k]), f"{k} changed"
    for st in opt.state.values():
        assert st, "no state created"
        for key, v in st.items():
            if not isinstance(v, torch.Tensor):
                continue
            v = v.to_local() if hasattr(v, "to_local") else v
            if v.is_floating_point():
                assert torch.isfinite(v).all(), key
                assert key == "step" or not v.any(), f"{key} not zero after a zero-gradient step"


@pytest.mark.parametrize(("name", "form"), _cases(COMPILED))
def test_zero_gradient_lr0_step_changes_nothing(name, form):
    """torch's ``_init_optim_state`` (what ``get_optimizer_state_dict`` and torchtitan's
    ``init_optim_state`` run before a save): parameters bit for bit, state finite and zero."""
    model = make_model(torch.float32)
    kw = _kwargs(name, form)
    opt = meqmuon.build_optimizer(name, _titan_groups(model, kw.get("foreach")), **kw)
    before = _snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compile=True: rules without a compiled form run eagerly
        _init_optim_state(opt)
    assert opt.param_groups[0]["lr"] == 0.02 and all(p.grad is None for p in model.parameters())
    _check_zero_step(dict(model.state_dict()), before, opt)


@pytest.mark.parametrize("name", ["meqmuon", "muon"])
def test_zero_gradient_step_with_a_tensor_lr(name):
    """An lr held as a 0-D tensor (a scheduler's): torch's ``_init_optim_state`` sets ``torch.tensor(0.0)``
    for the step and puts the tensor back."""
    model = make_model(torch.float32)
    groups = _titan_groups(model, False)
    lr = torch.tensor(0.02)
    for g in groups:
        g["lr"] = lr
    opt = meqmuon.build_optimizer(name, groups, **{k: v for k, v in _kwargs(name).items() if k != "lr"})
    before = _snapshot(model)
    _init_optim_state(opt)
    assert all(g["lr"] is lr for g in opt.param_groups)
    _check_zero_step(dict(model.state_dict()), before, opt)


@pytest.mark.parametrize("name", ENGINE)
def test_dtype_hyperparameters_pass_torchs_state_dict_utilities(name):
    """A group's ``state_dtype`` (every engine optimizer) and ``ns_dtype`` (those with Newton-Schulz) are
    dtypes, which torch's state-dict utilities refused (``get_optimizer_state_dict`` with
    ``cpu_offload`` or ``full_state_dict``: "Unexpected value type <class 'torch.dtype'>"; every checkpoint of
    Lightning's ``ModelParallelStrategy``): saved as their names, loaded as dtypes, the run continues bit for bit."""
    kw = {**_kwargs(name), "state_dtype": torch.float32}  # _kwargs pins ns_dtype=torch.float32 where there is one
    model = make_model(torch.float32)
    opt = meqmuon.build_optimizer(name, _titan_groups(model, False), **kw)
    for ids in batches(2):
        _grad_step(model, opt, ids)
    for options in (StateDictOptions(cpu_offload=True), StateDictOptions(full_state_dict=True)):
        buf = io.BytesIO()  # a checkpoint: the dict holds the live state tensors
        torch.save(get_optimizer_state_dict(model, opt, options=options), buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
    assert {g["state_dtype"] for g in saved["param_groups"]} == {"torch.float32"}
    model2 = copy.deepcopy(model)
    model2.zero_grad(set_to_none=True)  # else torch loads nothing into the state it does not create (see above)
    other = {k: None for k in ("state_dtype", "ns_dtype") if k in kw}  # the saved groups bring the dtypes back
    opt2 = meqmuon.build_optimizer(name, _titan_groups(model2, False), **{**kw, **other})
    set_optimizer_state_dict(model2, opt2, saved)
    assert all(g["state_dtype"] is torch.float32 for g in opt2.param_groups)
    assert all(g.get("ns_dtype", torch.float32) is torch.float32 for g in opt2.param_groups)
    for ids in batches(2, seed=3):
        _grad_step(model, opt, ids)
        _grad_step(model2, opt2, ids)
    for (n, p), p2 in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, p2), n


# ---- DeepSpeed ZeRO: flat 1-D partitions ------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in ENGINE if CAPABILITIES[n].newton_schulz])
def test_no_matrix_for_newton_schulz_warns_at_construction(name):
    """A module whose one parameter is a flat 1-D tensor (a ZeRO partition) gets a warning naming why."""
    flat = nn.Module()
    flat.partition = nn.Parameter(torch.zeros(4096))
    with pytest.warns(UserWarning, match=r"no >=2-D parameter reaches Newton-Schulz: .*Flat 1-D partitions "
                                         r"\(DeepSpeed ZeRO\)") as record:
        meqmuon.build_optimizer(name, flat)
    assert "1 vector of shape (4096,)" in str(record[0].message)
    # As ZeRO passes them: bare 1-D tensors, no param_groups, kinds inferred from shape.
    cls = REGISTRY[name].cls
    with pytest.warns(UserWarning, match="no >=2-D parameter reaches Newton-Schulz") as record:
        cls([torch.zeros(64, requires_grad=True), torch.zeros(32, requires_grad=True)])
    assert any(w.filename == __file__ for w in record if "Newton-Schulz" in str(w.message)), "points at the caller"
    with warnings.catch_warnings():  # a matrix anywhere: nothing to say
        warnings.simplefilter("error")
        meqmuon.build_optimizer(name, make_model(torch.float32))


def test_no_warning_without_newton_schulz():
    """SCALE and torch's AdamW orthogonalise nothing: 1-D parameters alone are what they expect."""
    flat = nn.Module()
    flat.partition = nn.Parameter(torch.zeros(64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meqmuon.build_optimizer("scale", flat)
        meqmuon.build_optimizer("adamw", flat)


# ---- under FSDP2 and accelerate's swap (2 gloo ranks) ---------------------------------------------------


def _fsdp_zero_step_worker(rank, names):
    from torch.distributed.fsdp import fully_shard

    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    out = {}
    for name in names:
        for form in ("per-tensor", "batched"):
            model = make_model(torch.float32)
            fully_shard(model, mesh=mesh)
            kw = _kwargs(name, form)
            opt = meqmuon.build_optimizer(name, _titan_groups(model, kw["foreach"]), **kw)
            before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
            get_optimizer_state_dict(model, opt, options=FLAT)  # runs _init_optim_state
            _check_zero_step({k: v.to_local() for k, v in model.state_dict().items()}, before, opt)
            out[f"{name}-{form}"] = True
    return out


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_zero_gradient_lr0_step_under_fsdp2(tmp_path):
    """The zero-gradient ``lr=0`` step of ``get_optimizer_state_dict`` on FSDP2 shards, every meqmuon
    optimizer (``ENGINE``), per-tensor and batched: each rank's shards unchanged,
    its state finite and zero."""
    results = _spawn(_fsdp_zero_step_worker, tmp_path, ENGINE)
    assert all(len(r) == 2 * len(ENGINE) for r in results)


def _swap_worker(rank, names):
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters
    from torch.distributed.fsdp import fully_shard

    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    data = batches(3, seed=5)
    out = {}
    for name in names:
        form = "torch" if name == "adamw" else "per-tensor"
        # accelerate: the optimizer is built on the unsharded model ...
        swapped = make_model(torch.float32)
        opt_a = meqmuon.build_optimizer(name, swapped, **_kwargs(name, form))
        # ... Accelerator._prepare_fsdp2: names -> data_ptr before sharding, the optimizer's parameters
        # replaced by placeholders carrying the old data_ptr, fully_shard, then the swap by data_ptr.
        old = {n: p.data_ptr() for n, p in swapped.named_parameters()}
        for group in opt_a.param_groups:
            for i, p in enumerate(group["params"]):
                group["params"][i] = torch.empty(1, dtype=p.dtype)
                group["params"][i].data_ptr = p.data_ptr()
        fully_shard(swapped, mesh=mesh)
        new = dict(swapped.named_parameters())
        fsdp2_switch_optimizer_parameters(opt_a, {old[n]: new[n] for n in old})
        # the reference: built on the sharded model
        direct = make_model(torch.float32)
        fully_shard(direct, mesh=mesh)
        opt_b = meqmuon.build_optimizer(name, direct, **_kwargs(name, form))
        # and one process, unsharded (the same batch on both ranks: FSDP2's averaged gradient is this one's)
        single = make_model(torch.float32)
        opt_c = meqmuon.build_optimizer(name, single, **_kwargs(name, form))
        for ids in data:
            for model, opt in ((swapped, opt_a), (direct, opt_b), (single, opt_c)):
                _grad_step(model, opt, ids)
        init = make_model(torch.float32)
        params = [(a.full_tensor(), b.full_tensor(), c.detach(), d.detach()) for a, b, c, d in zip(
            swapped.parameters(), direct.parameters(), single.parameters(), init.parameters(), strict=True)]
        out[name] = {"sharded": max((a - b).abs().max().item() for a, b, _, _ in params),
                     "one process": max((a - c).abs().max().item() for a, _, c, _ in params),
                     "moved": max((a - d).abs().max().item() for a, _, _, d in params)}
    return out


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_accelerate_fsdp2_parameter_swap_equals_an_optimizer_built_sharded(tmp_path):
    """accelerate's own ``fsdp2_switch_optimizer_parameters`` (the placeholders and data_ptr mapping of
    ``Accelerator._prepare_fsdp2`` reproduced around it, which needs an Accelerator with an FSDP plugin),
    3 updates on 2 ranks: every optimizer equals one built on the sharded model to 1e-6 (observed: bit for
    bit), and one process on the unsharded model to 1e-6 (the FSDP2 bound of test_distributed.py)."""
    pytest.importorskip("accelerate")
    names = ["adamw", *ENGINE]
    gaps = _spawn(_swap_worker, tmp_path, names)
    for gap in gaps:
        assert gap.keys() == set(names)
        bad = {n: g for n, g in gap.items() if not (g["sharded"] <= 1e-6 and g["one process"] <= 1e-6
                                                      and g["moved"] > 1e-3)}
        assert not bad, bad


# ---- gradient accumulation through the harness ------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def _final_model(run: Path) -> dict[str, torch.Tensor]:
    from meqmuon.train.checkpoint import list_checkpoints, load_checkpoint

    (_, path), *_ = reversed(list_checkpoints(run))
    return load_checkpoint(path)["model"]


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_micro_batches_equal_one_pass_over_the_global_batch(cache, tmp_path, name):
    """``meqmuon train --global-batch 8`` with ``--micro-batch 2`` vs 8, 3 updates, float32 everywhere:
    one optimizer step per update, the first update's gradient equal to 1e-6 (only the summation order of
    the micro-batches differs) and every weight after 3 updates equal to 1e-6.

    Adam-type rules run with ``eps=1e-3`` here. With torch's 1e-8, Adam's first steps ``g / (|g| + eps)``
    turn the rounding of an element whose gradient cancels to ~1e-8 into a large part of ``lr``: measured
    3 of 44,032 elements off by > 1e-6 after one update, 13 of 65,536 of the embedding (1.4e-3) after
    three, under torch's own AdamW as under ours (1e-4 still leaves Muon's embedding, whose gradients are
    small, 2e-6 off). That is Adam on any two summation orders, not the accumulation, which the gradient
    check pins down."""
    from meqmuon.train.config import TrainConfig
    from meqmuon.train.loop import train

    args = {"ns_dtype": torch.float32} if CAPABILITIES[name].newton_schulz else {}
    if "eps" in meqmuon.valid_hyperparameters(name):
        args["eps"] = 1e-3
    if "vs_eps" in meqmuon.valid_hyperparameters(name):  # Muon-VS divides by sqrt(V) + eps, as Adam does
        args["vs_eps"] = 1e-3
    final, grads = {}, {}

    def record(opt, *_):
        grads[micro].append([p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None])

    handle = register_optimizer_step_pre_hook(record)
    try:
        for micro in (8, 2):
            grads[micro] = []
            out = tmp_path / f"mb{micro}"
            train(TrainConfig(model="llama-tiny", optimizer=name, lr=1e-2, data="builtin", vocab_size=512, seq_len=32,
                              global_batch=8, micro_batch=micro, steps=3, eval_every=100, save_every=100,
                              val_tokens=64, precision="fp32", optimizer_args=args, threads=1, cache_dir=cache,
                              out=str(out), quiet=True))
            final[micro] = _final_model(out)
    finally:
        handle.remove()
    for micro in (2,):
        assert len(grads[micro]) == len(grads[8]) == 3, "one optimizer step per update"
        gap = max((a - b).abs().max().item() for a, b in zip(grads[8][0], grads[micro][0], strict=True))
        assert gap <= 1e-6, (micro, "gradient", gap)
        gap = _gap(final[8], final[micro])
        assert gap <= 1e-6, (micro, "weights", gap)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_micro_batches_under_ddp_equal_one_pass(cache, tmp_path):
    """2 DDP processes (torchrun's environment, as test_preempt.py sets it), MeqMuon: ``--micro-batch 2``
    of ``--global-batch 8`` (2 micro-batches per rank, DDP's no_sync on the first) equals one process's one
    pass over the whole batch, to 1e-6 (the reduction order of DDP's all-reduce joins the summation's). The one
    process runs here (``meqmuon.cli.main``), the two ranks are launched."""
    from test_preempt import run_to_end

    common = ["train", "--model", "llama-tiny", "--optimizer", "meqmuon", "--lr", "1e-2", "--vocab-size", "512",
              "--seq-len", "32", "--global-batch", "8", "--steps", "3", "--eval-every", "100", "--val-tokens", "64",
              "--precision", "fp32", "--optimizer-arg", "ns_dtype=float32", "--threads", "1", "--cache-dir", cache,
              "--quiet"]
    runs = {"one": (1, "8"), "ddp-accum": (2, "2")}
    for label, (world, micro) in runs.items():
        codes, errs = run_to_end([*common, "--micro-batch", micro, "--out", str(tmp_path / label)], world)
        assert codes == [0] * world, errs
    gap = _gap(_final_model(tmp_path / "one"), _final_model(tmp_path / "ddp-accum"))
    assert gap <= 1e-6, gap
