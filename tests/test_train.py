"""Training harness: schedule, checkpoint round trips, exact resume, compare, DDP equivalence.

What is proved and why:

* The LR schedule is linear warmup then cosine, applied as a multiplier to each group's own lr.
* Checkpoints load under ``torch.load(weights_only=True)`` (torch dtypes in param groups included).
* Resume is exact: N updates straight equal N/2 + resume + N/2 and N/3 + N/3 + N/3 *bit for bit*
  on CPU (weights, optimizer state, logged losses), and ``metrics.jsonl`` holds every step once.
  Bitwise equality is the right bar: both paths run the same deterministic CPU kernels on the same
  inputs, so any difference means some state (scheduler, data position, RNG, counters) was lost.
* ``run_compare`` gives every optimizer the same initial weights, the same batches in the same order
  and the same validation set, and writes the table and the plot.
* A 2-process gloo DDP run matches a single process with the same global batch. Tolerance: fp32
  everywhere (precision and Newton-Schulz), so the only difference is the order of the gradient
  reduction (``g1/2 + g2/2`` vs ``(g1 + g2)/2``), a few fp32 ulps per step; 3 updates stay far below 1e-4.

Everything runs on the built-in corpus with a 512-token BPE, ``llama-tiny``, 32-token sequences.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meqmuon.optim.registry import REGISTRY
from meqmuon.train import compare as compare_mod
from meqmuon.train import loop as loop_mod
from meqmuon.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from meqmuon.train.config import (
    ResolvedConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    model_run_defaults,
    resolve,
    resolve_numerics,
)
from meqmuon.train.loop import TrainingDiverged, WarmupCosine, train
from meqmuon.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def tiny(cache: str, out: Path, **kw) -> TrainConfig:
    base = dict(model="llama-tiny", optimizer="meqmuon", lr=1e-2, data="builtin", vocab_size=512, seq_len=32,
                global_batch=8, micro_batch=4, steps=6, eval_every=3, save_every=100, val_tokens=512,
                cache_dir=cache, out=str(out), quiet=True)
    base.update(kw)
    return TrainConfig(**base)


def test_warmup_cosine_schedule_multiplies_each_group_lr():
    sched = WarmupCosine(steps=100, warmup_ratio=0.05, min_lr_ratio=0.1)
    assert sched.warmup == 5
    assert [sched(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert sched(5) == pytest.approx(1.0)
    mid = 5 + 95 / 2
    assert sched(mid) == pytest.approx(0.1 + 0.9 * 0.5)
    assert sched(100) == pytest.approx(0.1)
    values = [sched(s) for s in range(5, 100)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # monotone decay

    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p1], "lr": 1.0}, {"params": [p2], "lr": 0.01}])
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(10, 0.2))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.005])  # step 0 of 2 warmup steps
    opt.step()
    lr_sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.0, 0.01])


def _resolved(cfg: TrainConfig, *, unique_params: int, world_size: int) -> ResolvedConfig:
    """Both stages of resolution, as ``build_run`` makes them (on the CPU, built-in data)."""
    return resolve(cfg, device="cpu", world_size=world_size).for_model(unique_params=unique_params,
                                                                       data_source="builtin")


def test_resolve_derives_budget_and_rejects_indivisible_batch():
    cfg = _resolved(TrainConfig(model="llama-60m", optimizer="adamw"), unique_params=1000, world_size=1)
    assert cfg.lr == 1e-3 and cfg.micro_batch == 32  # automatic: largest divisor of 512 up to 32
    assert (cfg.global_batch, cfg.seq_len, cfg.val_tokens) == (512, 1024, 1_000_000)  # the paper's
    assert cfg.steps == math.ceil(20_000 / (512 * 1024)) and cfg.tokens == cfg.steps * 512 * 1024
    cfg = _resolved(TrainConfig(global_batch=8, seq_len=4, tokens=100), unique_params=1, world_size=2)
    assert cfg.micro_batch == 4 and cfg.steps == 4  # ceil(100 / 32)
    assert _resolved(TrainConfig(global_batch=96), unique_params=1, world_size=2).micro_batch == 24
    with pytest.raises(ValueError, match="not divisible"):
        _resolved(TrainConfig(global_batch=8, micro_batch=3), unique_params=1, world_size=1)
    with pytest.raises(ValueError, match="not divisible"):
        _resolved(TrainConfig(global_batch=9), unique_params=1, world_size=2)


@pytest.mark.parametrize(("model", "steps", "want"), [("llama-tiny", 20, 27), ("llama-tiny", 1000, 50),
                                                        ("llama-60m", 2213, 110), ("llama-60m", 30, 7)])
def test_default_evaluation_interval_keeps_evaluation_under_a_tenth_of_the_compute(model, steps, want):
    d = model_run_defaults(model)
    tokens_per_step, val = d["global_batch"] * d["seq_len"], d["val_tokens"]
    every = resolve(TrainConfig(model=model, steps=steps), device="cpu", world_size=1).for_model(
        unique_params=1, data_source="builtin").eval_every
    assert every == want
    evaluations = steps // every + (steps % every != 0)  # and one at the end
    eval_cost = evaluations * val / 3  # training-token equivalents: a forward pass is 1/3 of a step's
    assert every == max(1, steps // 20) or eval_cost <= 0.1 * steps * tokens_per_step + val / 3


def test_resolved_config_is_frozen_and_stores_train_config_keys():
    """config.json keeps TrainConfig's keys in its order, with the derived values filled in."""
    import dataclasses

    assert [f.name for f in dataclasses.fields(ResolvedConfig)] == [f.name for f in dataclasses.fields(TrainConfig)]
    cfg = TrainConfig(optimizer="MeqMuon", steps=3, out="x", capture_steps=[2])
    plan = resolve(cfg, device="cpu", world_size=2)
    assert plan.optimizer == "meqmuon" and plan.micro_batch == 16 and plan.steps == 3 and plan.tokens is None
    final = plan.for_model(unique_params=10, data_source="builtin")
    with pytest.raises(dataclasses.FrozenInstanceError):
        final.steps = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        final.optimizer_args["ns_dtype"] = "bfloat16"  # type: ignore[index]
    stored = final.to_dict()
    assert list(stored) == [f.name for f in dataclasses.fields(TrainConfig)]
    assert stored["capture_steps"] == [2] and isinstance(stored["optimizer_args"], dict)
    # eval_every: one evaluation of the 32,768 validation tokens costs 32768 / (3 x 4096) = 2.67 updates;
    # at most 10 % of the compute -> every ceil(26.7) = 27 updates (here: only at the end)
    assert (stored["steps"], stored["tokens"], stored["eval_every"], stored["save_every"]) == (3, 3 * 32 * 128, 27, 1)
    assert stored["data_source"] == "builtin" and stored["lr"] == 2e-3 and final.accumulation(2) == 1
    assert config_to_dict(config_from_dict(stored)) == stored  # config.json reads back as a TrainConfig


@pytest.mark.parametrize("model", ["llama-tiny", "llama-tiny-tied", "smollm2-tiny", "qwen2-tiny"])
def test_cpu_presets_get_cpu_sized_defaults_and_paper_models_keep_the_papers(model):
    """`meqmuon train --model llama-tiny --steps 2` used to inherit 512 x 1024 tokens per
    step and 1M validation tokens. Given values still win."""
    cfg = _resolved(TrainConfig(model=model, steps=2), unique_params=1000, world_size=1)
    assert (cfg.global_batch, cfg.seq_len, cfg.val_tokens) == (32, 128, 32_768)
    assert cfg.tokens == 2 * 32 * 128 and cfg.micro_batch == 32
    cfg = _resolved(TrainConfig(model=model, steps=2, global_batch=8, seq_len=64, val_tokens=100),
                         unique_params=1000, world_size=1)
    assert (cfg.global_batch, cfg.seq_len, cfg.val_tokens) == (8, 64, 100)
    for paper in ("llama-60m", "llama-130m", "llama-350m", "smollm2-135m", "smollm2-360m", "qwen2-0.5b"):
        assert model_run_defaults(paper) == {"global_batch": 512, "seq_len": 1024, "val_tokens": 1_000_000,
                                             "vocab_size": 4096}


@pytest.mark.parametrize(
    "cap, optimizer, args, want_precision, want_ns",
    [("AVX2", "meqmuon", {}, "fp32", "float32"),
     ("AVX512+AVX512_BF16", "meqmuon", {}, "bf16", "bfloat16"),
     ("AVX2", "muon", {"ns_dtype": "bfloat16"}, "fp32", "bfloat16"),  # explicit ns_dtype honoured
     ("AVX512+AVX512_BF16", "normuon", {"ns_dtype": "float32"}, "bf16", "float32"),
     ("AVX2", "adamw", {}, "fp32", None)],  # no Newton-Schulz: nothing added to optimizer_args
)
def test_resolve_numerics_by_injected_capability(cap, optimizer, args, want_precision, want_ns):
    cfg = resolve_numerics(TrainConfig(optimizer=optimizer, optimizer_args=dict(args)), "cpu", cpu_capability=cap)
    assert cfg.precision == want_precision
    assert cfg.optimizer_args.get("ns_dtype") == want_ns
    assert cfg.numerics["cpu_capability"] == cap and cfg.numerics["requested_precision"] == "auto"
    assert cfg.numerics["precision"] == want_precision and cfg.numerics["ns_dtype"] == want_ns
    assert cfg.numerics["tf32"] is cfg.tf32 is False  # CPU: TF32 does not apply, and the config says so too
    assert cfg.numerics["requested_tf32"] is True
    # idempotent: resolving the resolved config changes nothing, even on another machine
    other = "AVX2" if cap != "AVX2" else "AVX512+AVX512_BF16"
    again = resolve_numerics(cfg, "cpu", cpu_capability=other)
    assert again.precision == cfg.precision and again.optimizer_args == cfg.optimizer_args
    assert again.numerics["requested_precision"] == "auto"
    # explicit precision is honoured whatever the hardware
    for p in ("bf16", "fp32"):
        assert resolve_numerics(TrainConfig(optimizer=optimizer, precision=p), "cpu", cpu_capability=cap).precision == p
    cuda = resolve_numerics(TrainConfig(optimizer=optimizer), "cuda", cuda_bf16=True, cpu_capability=cap)
    assert cuda.precision == "bf16" and cuda.numerics["tf32"] is cuda.tf32 is True
    assert resolve_numerics(TrainConfig(tf32=False), "cuda", cuda_bf16=False).numerics["tf32"] is False
    # attention: float32 SDPA for bf16 autocast on a CPU (its bf16 backward is slow), else the autocast dtype's
    assert cfg.numerics["attention"] == ("sdpa-float32" if want_precision == "bf16" else "sdpa")
    assert cuda.numerics["attention"] == "sdpa"
    long = resolve_numerics(TrainConfig(optimizer=optimizer, model="llama-60m"), "cpu", cpu_capability=cap)
    assert long.numerics["attention"] == "sdpa"  # 1024 tokens: bf16 attention is the faster there
    assert resolve_numerics(TrainConfig(model="llama-60m", seq_len=256), "cpu",
                            cpu_capability=cap).numerics["attention"] == cfg.numerics["attention"]


def test_run_records_resolved_numerics_and_refuses_resume_where_auto_differs(cache, tmp_path, monkeypatch):
    """config.json, the checkpoint, metrics.jsonl and summary.json name the precision and Newton-Schulz
    dtype actually used and the CPU capability; a run started with "auto" resumes on the same kind of
    machine, and is refused (not silently switched) where "auto" resolves differently."""
    from meqmuon import precision

    cap = precision.detect_cpu_capability()
    native = precision.cpu_native_bf16(cap)
    want_p, want_ns = ("bf16", "bfloat16") if native else ("fp32", "float32")
    run = tmp_path / "r"
    res = train(tiny(cache, run, steps=2, stop_at_step=1))
    assert res["finished"] is False
    saved = json.loads((run / "config.json").read_text())
    assert saved["precision"] == want_p and saved["optimizer_args"] == {"ns_dtype": want_ns}
    assert saved["numerics"]["cpu_capability"] == cap and saved["numerics"]["requested_precision"] == "auto"
    # TF32 applies on CUDA only: the config says what the run does, the record what was asked (one truth)
    assert saved["numerics"]["requested_ns_dtype"] == "auto" and saved["tf32"] is saved["numerics"]["tf32"] is False
    assert saved["numerics"]["requested_tf32"] is True and saved["numerics"]["requested_micro_batch"] == 4  # tiny()
    assert _final_state(run)["config"]["precision"] == want_p

    # the other kind of CPU: auto now means the other precision, and the resume is refused
    monkeypatch.setattr(precision, "detect_cpu_capability", lambda: "AVX2" if native else "AVX512+AVX512_BF16")
    with pytest.raises(CheckpointError, match="'auto' precision/ns_dtype follow the hardware") as err:
        train(tiny(cache, run, steps=2, resume="auto"))
    assert want_ns in str(err.value)
    # ... but the stored (concrete) values, passed explicitly, resume it in the run's own numerics
    explicit = train(tiny(cache, tmp_path / "copy", steps=1, precision=want_p,
                          optimizer_args={"ns_dtype": want_ns}))
    assert explicit["precision"] == want_p and explicit["ns_dtype"] == want_ns
    monkeypatch.undo()

    summary = train(tiny(cache, run, steps=2, resume="auto"))
    assert summary["finished"] and summary["precision"] == want_p and summary["ns_dtype"] == want_ns
    assert summary["cpu_capability"] == cap
    runs = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "run"]
    assert [r["step"] for r in runs] == [0, 1]  # one record per start or resume
    assert all(r["precision"] == want_p and r["ns_dtype"] == want_ns and r["cpu_capability"] == cap for r in runs)
    want_attention = "sdpa-float32" if want_p == "bf16" else "sdpa"
    assert summary["attention"] == want_attention and saved["numerics"]["attention"] == want_attention


def test_forced_bf16_on_a_cpu_without_native_bf16_warns_once(cache, tmp_path, monkeypatch, capsys):
    from meqmuon import precision

    monkeypatch.setattr(precision, "detect_cpu_capability", lambda: "AVX2")
    summary = train(tiny(cache, tmp_path / "b", precision="bf16", steps=1, seq_len=16, global_batch=2,
                         micro_batch=2, eval_every=1, val_tokens=64))
    assert summary["precision"] == "bf16" and summary["ns_dtype"] == "float32"  # NS stays auto
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(lines) == 1 and "bf16 autocast" in lines[0] and "AVX2" in lines[0] and "slower" in lines[0]
    # auto on the same (pretended) CPU: fp32 and no warning
    train(tiny(cache, tmp_path / "a", steps=1, seq_len=16, global_batch=2, micro_batch=2, val_tokens=64))
    assert "warning" not in capsys.readouterr().err


def test_cpu_run_keeps_freed_memory_during_the_run_only(cache, tmp_path, monkeypatch):
    """glibc's mmap is off during a CPU run (meqmuon.train.allocator) and back on afterwards; a MALLOC_*
    variable of the user's leaves malloc alone."""
    from meqmuon.train import allocator

    calls, seen = [], []
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    for name in [n for n in os.environ if n.startswith("MALLOC_") or n in ("GLIBC_TUNABLES", "LD_PRELOAD")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("MEQMUON_KEEP_FREED_MEMORY", raising=False)
    real = loop_mod._train

    def spy(*a, **k):
        seen.append(list(calls))
        return real(*a, **k)

    monkeypatch.setattr(loop_mod, "_train", spy)
    train(tiny(cache, tmp_path / "m", steps=1, seq_len=16, global_batch=2, micro_batch=2, val_tokens=64))
    assert seen == [[(-4, 0), (-1, 2**31 - 1)]]  # M_MMAP_MAX = 0, M_TRIM_THRESHOLD never reached
    assert calls[2:] == [(-4, 65536), (-1, 128 * 1024)]  # glibc's defaults restored
    assert allocator.applies()
    for env in ({"MALLOC_ARENA_MAX": "2"}, {"LD_PRELOAD": "libjemalloc.so"}, {"MEQMUON_KEEP_FREED_MEMORY": "0"}):
        calls.clear()
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            with allocator.keep_freed_memory() as applied:
                assert applied is False and not allocator.applies()
        assert calls == []
    with allocator.keep_freed_memory(enabled=False) as applied:  # e.g. a CUDA run
        assert applied is False and calls == []


def test_keep_freed_memory_on_this_machine():
    """The real mallopt (glibc): the block runs, allocations inside and after it work."""
    from meqmuon.train import allocator

    with allocator.keep_freed_memory() as applied:
        x = torch.ones(8 << 20)  # 32 MiB: above glibc's largest mmap threshold
        del x
    assert applied in (True, False)
    assert float(torch.ones(8 << 20).sum()) == 8 << 20


def test_threads_apply_during_the_run_and_are_restored(cache, tmp_path, monkeypatch):
    before = torch.get_num_threads()
    seen = []
    real = loop_mod._train

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    monkeypatch.setattr(loop_mod, "_train", spy)
    train(tiny(cache, tmp_path / "t", steps=1, threads=1))
    assert seen == [1] and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be a positive number"):
        train(tiny(cache, tmp_path / "u", steps=1, threads=0))


def _final_state(run_dir: Path) -> dict:
    (step, path), *_ = reversed(list_checkpoints(run_dir))
    return load_checkpoint(path)


def _train_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb[i][k])), (i, k)
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]
    assert a["data"] == b["data"]


@pytest.mark.parametrize("optimizer", ["meqmuon", "muon"])
def test_resume_is_bit_exact_once_and_twice(cache, tmp_path, optimizer):
    straight = tmp_path / "straight"
    summary = train(tiny(cache, straight, optimizer=optimizer))
    assert summary["finished"] and summary["steps"] == 6

    once = tmp_path / "once"
    part = train(tiny(cache, once, optimizer=optimizer, stop_at_step=3))
    assert part["finished"] is False and part["step"] == 3
    assert not (once / "summary.json").exists()
    # A process killed after its last checkpoint may have logged further steps: they must not duplicate.
    with open(once / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": 4, "loss": 123.0}) + "\n")
    train(tiny(cache, once, optimizer=optimizer, resume="auto"))

    twice = tmp_path / "twice"
    train(tiny(cache, twice, optimizer=optimizer, stop_at_step=2))
    train(tiny(cache, twice, optimizer=optimizer, stop_at_step=4, resume="auto"))
    train(tiny(cache, twice, optimizer=optimizer, resume="auto"))

    ref = _final_state(straight)
    for run in (once, twice):
        _assert_same_state(ref, _final_state(run))
        assert _train_losses(run) == _train_losses(straight)  # each step once, identical values
        assert [s for s, _ in _train_losses(run)] == [1, 2, 3, 4, 5, 6]
        assert json.loads((run / "summary.json").read_text())["val_loss"] == summary["val_loss"]


def test_checkpoint_is_complete_and_loads_weights_only(cache, tmp_path):
    train(tiny(cache, tmp_path / "r", steps=2, optimizer_args={"ns_dtype": "float32"}))
    path = list_checkpoints(tmp_path / "r")[-1][1]
    ckpt = torch.load(path, map_location="cpu", weights_only=True)  # what load_checkpoint does
    assert {"model", "optimizer", "scheduler", "data", "rng", "step", "tokens", "config"} <= ckpt.keys()
    assert ckpt["optimizer"]["param_groups"][0]["ns_dtype"] == "torch.float32"  # saved by name (saved_state.py)
    assert isinstance(ckpt["rng"][0]["torch"], torch.Tensor)
    assert ckpt["data"]["position"] == 2 * 8
    assert ckpt["scheduler"]["last_epoch"] == 2
    sel = json.loads((tmp_path / "r" / "selection_counts.json").read_text())
    assert sel["step"] == 2 and sel["counts"]
    assert all(r + c == 2 for r, c in sel["counts"].values())


def test_divergence_stops_and_keeps_last_good_checkpoint(cache, tmp_path):
    run = tmp_path / "nan"
    with pytest.raises(TrainingDiverged) as exc:
        train(tiny(cache, run, optimizer="adamw", lr=1e30, steps=20, save_every=1))
    step = exc.value.step
    assert 1 < step <= 20 and f"at step {step}" in str(exc.value)
    kept = list_checkpoints(run)
    assert kept and kept[-1][0] == step - 1  # nothing saved after the last finite step
    assert load_checkpoint(kept[-1][1])["step"] == step - 1
    assert not (run / "summary.json").exists()


class _Recorder:
    calls: list = []

    def __init__(self, out_dir, steps, layers=None):
        self.steps = list(steps)
        _Recorder.calls.append(("init", Path(out_dir).name, self.steps, layers))

    def attach(self, optimizer):
        _Recorder.calls.append(("attach", type(optimizer).__name__))

    def begin_step(self, step):
        _Recorder.calls.append(("begin", step))

    def end_step(self):
        _Recorder.calls.append(("end",))


def test_capture_recorder_contract(cache, tmp_path, monkeypatch):
    import types

    fake = types.ModuleType("meqmuon.train.capture")
    fake.CaptureRecorder = _Recorder
    monkeypatch.setitem(sys.modules, "meqmuon.train.capture", fake)
    _Recorder.calls = []
    train(tiny(cache, tmp_path / "cap", steps=3, capture_steps=[2], capture_layers=[0]))
    assert _Recorder.calls[:2] == [("init", "cap", [2], [0]), ("attach", "MeqMuon")]
    assert _Recorder.calls[2:] == [("begin", 1), ("end",), ("begin", 2), ("end",), ("begin", 3), ("end",)]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def test_compare_same_init_data_and_val_for_every_optimizer(cache, tmp_path, monkeypatch):
    seen: dict[str, list] = {"init": [], "batches": [], "val": []}
    real_build_optimizer = __import__("meqmuon").build_optimizer
    real_evaluate = loop_mod.evaluate
    from meqmuon.train.data import PackedTrainStream

    real_next = PackedTrainStream.next_batch

    def spy_build_optimizer(name, model, **kw):
        seen["init"].append((name, _digest(torch.cat([p.flatten() for p in model.parameters()]))))
        return real_build_optimizer(name, model, **kw)

    def spy_next(self, n):
        batch = real_next(self, n)
        seen["batches"].append(_digest(batch))
        return batch

    def spy_evaluate(model, val, **kw):
        seen["val"].append(_digest(val))
        return real_evaluate(model, val, **kw)

    monkeypatch.setattr("meqmuon.build_optimizer", spy_build_optimizer)
    monkeypatch.setattr(PackedTrainStream, "next_batch", spy_next)
    monkeypatch.setattr(loop_mod, "evaluate", spy_evaluate)

    base = tiny(cache, tmp_path, steps=4, eval_every=2, lr=None)
    rows = compare_mod.run_compare(["adamw", "meqmuon"], {"meqmuon": 2e-2}, base, tmp_path / "cmp")

    assert [r["optimizer"] for r in rows] == ["adamw", "meqmuon"]
    assert rows[0]["lr"] == REGISTRY["adamw"].demo_lr and rows[1]["lr"] == 2e-2
    assert seen["init"][0][1] == seen["init"][1][1]  # same initial weights
    assert seen["batches"][:4] == seen["batches"][4:] and len(set(seen["batches"][:4])) == 4  # same order
    assert len(set(seen["val"])) == 1 and len(seen["val"]) == 4  # same validation set, 2 evals per run
    for r in rows:
        assert math.isfinite(r["final val loss"]) and r["perplexity"] == pytest.approx(math.exp(r["final val loss"]))
        assert r["bits/byte"] > 0 and r["optimizer state (MiB)"] > 0 and r["tokens/s"] > 0
    # AdamW keeps two moments, MeqMuon one buffer: the memory column must reflect it.
    assert rows[0]["optimizer state (MiB)"] > 1.9 * rows[1]["optimizer state (MiB)"]

    from meqmuon import precision

    cap = precision.detect_cpu_capability()
    p = "bf16" if precision.cpu_native_bf16(cap) else "fp32"
    table = (tmp_path / "cmp" / "table.md").read_text().splitlines()
    assert table[0] == f"CPU capability: {cap}" and table[1] == ""
    assert table[2] == ("| optimizer | lr | final val loss | perplexity | bits/byte | optimizer state (MiB) "
                        "| tokens/s | precision |")
    assert table[4].startswith("| adamw | 0.003 |") and table[5].startswith("| meqmuon | 0.02 |")
    assert table[4].endswith(f"| {p} |") and table[5].endswith(f"| {p}, NS {p} |")  # AdamW has no NS
    png = tmp_path / "cmp" / "val_ppl.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # Re-running reuses the finished runs (no training) and returns the same rows.
    monkeypatch.setattr(loop_mod, "_train", None)
    again = compare_mod.run_compare(["adamw", "meqmuon"], {"meqmuon": 2e-2}, base, tmp_path / "cmp")
    assert [r["final val loss"] for r in again] == [r["final val loss"] for r in rows]


def test_ddp_two_processes_match_single_process(cache, tmp_path):
    """Two torchrun ranks (DDP) against one process (``meqmuon.cli.main`` here: a launch would add ~5 CPU
    seconds of imports): the same weights, losses and captures to 1e-4."""
    from meqmuon.cli import main

    common = ["--model", "llama-tiny", "--optimizer", "meqmuon", "--lr", "1e-2", "--vocab-size", "512",
              "--seq-len", "32", "--global-batch", "8", "--micro-batch", "4", "--steps", "3", "--eval-every", "3",
              "--val-tokens", "256", "--cache-dir", cache, "--precision", "fp32",
              "--optimizer-arg", "ns_dtype=float32", "--capture-steps", "2", "--capture-layers", "0", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    assert main(["train", *common, "--out", str(tmp_path / "one")]) == 0
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "meqmuon", "train", *common, "--out", str(tmp_path / "two")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one, two = _final_state(tmp_path / "one"), _final_state(tmp_path / "two")
    assert two["world_size"] == 2 and len(two["rng"]) == 2 and one["world_size"] == 1
    for k, v in one["model"].items():
        torch.testing.assert_close(two["model"][k], v, rtol=0, atol=1e-4, msg=k)
    s1 = json.loads((tmp_path / "one" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert s2["world_size"] == 2
    assert s2["val_loss"] == pytest.approx(s1["val_loss"], abs=1e-4)
    l1, l2 = _train_losses(tmp_path / "one"), _train_losses(tmp_path / "two")
    assert [s for s, _ in l2] == [1, 2, 3]
    assert [v for _, v in l2] == pytest.approx([v for _, v in l1], abs=1e-4)
    # Captures: rank 0 alone writes them, and they hold what a single process records.
    from meqmuon.diagnostics.capture import load_captures

    c1, c2 = load_captures(tmp_path / "one")[2], load_captures(tmp_path / "two")[2]
    assert c1.keys() == c2.keys() and c1["tensors"]
    for key, value in c1.items():
        if isinstance(value, dict):
            assert value.keys() == c2[key].keys(), key
            for name, t in value.items():
                if isinstance(t, torch.Tensor):
                    torch.testing.assert_close(c2[key][name], t, rtol=0, atol=1e-4, msg=f"{key}/{name}")


def test_train_uses_one_cpu_thread_unless_told(monkeypatch):
    """``train`` on a CPU runs with 1 intra-op thread by default (2 threads stalled 5x on 2 shared
    cores, docs/benchmarks.md), ``threads=N`` is honoured, torch's setting is restored afterwards, and
    a GPU run keeps torch's default."""
    from meqmuon.train import loop

    seen = []
    monkeypatch.setattr(loop, "_train", lambda cfg, *a: seen.append(torch.get_num_threads()) or {})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        train(TrainConfig(device="cpu"))
        train(TrainConfig(device="cpu", threads=2))
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert loop.run_threads(TrainConfig(), torch.device("cpu")) == 1
    assert loop.run_threads(TrainConfig(threads=3), torch.device("cpu")) == 3
    assert loop.run_threads(TrainConfig(), torch.device("cuda", 0)) is None


def test_a_token_budget_given_to_compare_or_sweep_sets_the_run_length():
    """``meqmuon sweep --tokens N`` used to run the demo's 100 updates (its ``steps=100`` overrode the given
    tokens); now a given token budget drops the demo's length, and ``--steps`` still wins over it."""
    from meqmuon.train.compare import demo_config

    assert demo_config().steps == 100
    cfg = demo_config(tokens=32 * 128 * 7)
    assert cfg.steps is None
    assert resolve(cfg, device="cpu", world_size=1).for_model(unique_params=1, data_source="builtin").steps == 7
    assert demo_config(tokens=10_000, steps=5).steps == 5


def test_resume_asks_again_for_what_resolves_per_launch():
    """A run's config.json holds the resolved micro-batch and TF32 (what ran) and what was asked; a resume
    asks again: "auto" re-resolves for the new world size (8 sequences on 1 rank -> 8; on 2 ranks -> 4), a
    micro-batch given by hand stays, and TF32 comes back as asked (it applies on CUDA only)."""
    from meqmuon.train.config import config_to_dict, resolve, resume_requests

    auto = resolve(TrainConfig(global_batch=8), device="cpu", world_size=1).to_dict()
    assert auto["micro_batch"] == 8 and auto["numerics"]["requested_micro_batch"] == "auto" and auto["tf32"] is False
    again = resume_requests(auto)
    assert again["micro_batch"] is None and again["tf32"] is True
    assert resolve(config_from_dict(again), device="cpu", world_size=2).micro_batch == 4
    with pytest.raises(ValueError, match="not divisible by world size 2 x micro batch 8"):
        resolve(config_from_dict(auto), device="cpu", world_size=2)  # the frozen value: issue 46's failure
    fixed = resolve(TrainConfig(global_batch=8, micro_batch=2, tf32=False), device="cpu", world_size=1).to_dict()
    assert resume_requests(fixed)["micro_batch"] == 2 and resume_requests(fixed)["tf32"] is False
    old = config_to_dict(TrainConfig(micro_batch=8))  # a config.json written before the record
    assert resume_requests(old) == old
