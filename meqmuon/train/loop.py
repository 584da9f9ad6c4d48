"""The pretraining loop: ``train(cfg) -> summary``.

One update consumes ``global_batch`` packed sequences: each of the ``W`` ranks takes its contiguous
``global_batch / W`` rows of the global order (see :mod:`meqmuon.train.data`) and splits them into
``accum = global_batch / (W * micro_batch)`` micro-batches; gradients are averaged over the micro-batches
(loss / accum) and, by DDP, over ranks, so every update sees the token-mean loss of the same global
batch whatever ``W`` and ``micro_batch`` are (GaLore/torchtitan convention). Packed rows all hold
``seq_len`` targets, so mean-of-means equals the token mean exactly.

Schedule: linear warmup over ``warmup_ratio`` of the updates, then cosine decay to
``min_lr_ratio`` (paper section 4: 5 % warmup, cosine to zero), implemented as a ``LambdaLR`` whose
multiplier scales every param group's own lr (so per-kind lrs keep their ratios).

Numerics: fp32 master weights and optimizer state; forward/backward under ``torch.autocast`` in bf16
(``precision="bf16"``, also on CPU) or in fp32; ``precision="auto"`` (default) picks bf16 where the
device runs it natively and fp32 elsewhere, and the Muon-family Newton-Schulz dtype follows the same
rule (:func:`meqmuon.train.config.resolve_numerics`); both are recorded in ``config.json``, the first
``metrics.jsonl`` record of each start or resume (``kind: "run"``) and ``summary.json``. bf16 forced on a CPU
without native bf16 prints one warning line. On CUDA, float32 matmuls use TF32 unless ``tf32=False``.
Logits are upcast to fp32 for the loss. Attention is PyTorch SDPA
(set in :func:`meqmuon.train.models.build_config`). No dropout.

Distributed: launched by ``torchrun``; when ``WORLD_SIZE > 1`` the process group is initialised from
the environment (NCCL on GPU, gloo on CPU). Rank 0 writes every file.

Stopping: SIGINT or SIGTERM during the loop finishes the current update, saves a checkpoint, logs a
``{"kind": "stop", "step", "signal", "checkpoint"}`` record and raises
:class:`~meqmuon.train.preempt.RunInterrupted`; ``resume="auto"`` then continues bit for bit. Under
DDP the ranks agree on the step through the loss's all-reduce (:mod:`meqmuon.train.preempt`).

Divergence: a non-finite loss or gradient norm stops the run before the optimizer step and raises
:class:`TrainingDiverged` naming the step; nothing is saved after the last good checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from meqmuon.train.allocator import keep_freed_memory
from meqmuon.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    rng_state,
    save_checkpoint,
    save_sharded_checkpoint,
)
from meqmuon.train.config import ResolvedConfig, TrainConfig, run_dir_of, validate_config
from meqmuon.train.device import device_of
from meqmuon.train.evaluate import causal_lm_loss, evaluate
from meqmuon.train.metrics import MetricsLogger, truncate_metrics, write_json
from meqmuon.train.parallel import gathered_logits_view
from meqmuon.train.preempt import SIGNALS, RunInterrupted, StopSignals
from meqmuon.train.run import Run, WarmupCosine, build_run

__all__ = ["TrainingDiverged", "WarmupCosine", "train", "run_dir_of", "run_threads", "write_json"]


class TrainingDiverged(RuntimeError):
    """The loss (or gradient norm) became NaN/Inf at ``step`` (1-based update index)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


@dataclass
class _Progress:
    """Where the loop stands: completed updates, tokens in total and since this start, time spent."""

    step: int
    tokens: int
    started: float  # perf_counter() when train() began this start or resume
    run_tokens: int = 0  # tokens trained since this start or resume (for tokens_per_s)
    train_time: float = 0.0
    last_eval: dict[str, Any] | None = None

    def advance(self, tokens: int, since: float) -> float:
        """Count one finished update of ``tokens`` tokens begun at ``since``; returns its duration."""
        dt = time.perf_counter() - since
        self.step += 1
        self.tokens += tokens
        self.run_tokens += tokens
        self.train_time += dt
        return dt


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train one run as ``cfg`` says and return its summary (also written to ``summary.json``).

    With ``cfg.stop_at_step`` the run saves a checkpoint after that step and returns early
    (``summary["finished"] is False``); ``cfg.resume="auto"`` continues it bit for bit.

    Raises:
        ValueError: invalid configuration (unknown names, non-positive sizes, indivisible batch,
            missing data), also from :func:`meqmuon.build_optimizer` (e.g. SCALE on a tied model).
        CheckpointError: unreadable or mismatched checkpoint; an existing run without ``resume``.
        TrainingDiverged: the loss became NaN/Inf.
        RunInterrupted: SIGINT/SIGTERM stopped the run after a checkpoint (``resume="auto"`` continues it).
    """
    validate_config(cfg)
    rank, world, local_rank, own_pg = _init_distributed()
    matmul_precision = torch.get_float32_matmul_precision()  # process-global: restored on return
    threads = torch.get_num_threads()
    device = device_of(cfg.device, local_rank)
    torch.set_num_threads(run_threads(cfg, device) or threads)
    try:
        with keep_freed_memory(device.type == "cpu"):  # glibc: no mmap/munmap per large tensor
            return _train(cfg, rank, world, local_rank)
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
        torch.set_num_threads(threads)
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()


def run_threads(cfg: TrainConfig, device: torch.device) -> int | None:
    """CPU intra-op threads of a run: ``cfg.threads`` when given, else 1 on a CPU device, else None
    (torch's default, one per core; a GPU run's host threads hardly matter).

    Why 1 on CPU: with torch's default of one thread per core, a run whose cores another job also
    uses stalls in OpenMP's barriers (every op waits for its slowest thread): a 20-update llama-tiny
    run took 109 s at 2 threads against 17-23 s at 1 while other test runs shared the 2 cores, and
    ``compare``/``sweep``/``ablation`` have used 1 thread for that reason since the demo was first
    timed. On an idle machine 2 threads are ~1.3x faster; ``--threads N`` asks for them
    (docs/benchmarks.md, "Threads of `meqmuon train`")."""
    if cfg.threads is not None:
        return cfg.threads
    return 1 if device.type == "cpu" else None


def _train(cfg: TrainConfig, rank: int, world: int, local_rank: int) -> dict[str, Any]:
    started = time.perf_counter()
    run = build_run(cfg, rank, world, local_rank)
    c = run.cfg
    logger, quiet = _open_log(run)
    recorder = _capture_recorder(run)
    params = [p for p in run.model.parameters() if p.requires_grad]
    at = _Progress(run.step, run.tokens, started)
    bar = _progress_bar(c, at.step, quiet)
    saved = at.step  # the step of the newest checkpoint of this start (the resumed one, or none at 0)
    try:
        with StopSignals() as signals:
            while at.step < c.steps:
                t0 = time.perf_counter()
                loss, grad_norm, lr, stop = _train_step(run, params, recorder, at.step, signals)
                dt = at.advance(c.tokens_per_step, since=t0)
                logger.log({"kind": "train", "step": at.step, "tokens": at.tokens, "loss": loss, "lr": lr,
                            "grad_norm": grad_norm, "tokens_per_s": c.tokens_per_step / dt,
                            "time_s": time.perf_counter() - at.started})
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{c.tokens_per_step / dt:,.0f}",
                                refresh=False)
                if at.step % c.eval_every == 0 or at.step == c.steps:
                    at.last_eval = _evaluate(run, logger, at, quiet)
                if at.step == c.steps or at.step % c.save_every == 0 or at.step == c.stop_at_step:
                    _save(run, at)
                    saved = at.step
                if stop is None and run.world == 1:
                    stop = signals.signum  # a signal during the evaluation or the save just made
                if stop is not None and at.step < c.steps:
                    _interrupted(run, logger, at, stop, saved, quiet)
                if c.stop_at_step is not None and c.stop_at_step <= at.step < c.steps:
                    break
    finally:
        bar.close()
    return _stopped(run, logger, at, quiet) if at.step < c.steps else _finish(run, logger, at, quiet)


def _train_step(run: Run, params: list[torch.nn.Parameter], recorder: Any, step: int,
                signals: StopSignals) -> tuple[float, float, float, int | None]:
    """One update (update ``step + 1``): accumulate the micro-batches' gradients, check them, step.

    Returns ``(loss, grad_norm, lr, stop)``: the global batch's mean loss, the gradient norm before
    clipping, the lr of the first param group the update used, and the signal that asks every rank to
    stop after this update (``None``: go on). Under DDP a rank's signal travels in the loss's
    all-reduce (:mod:`meqmuon.train.preempt`), so all ranks return the same ``stop``.
    """
    c, opt = run.cfg, run.opt
    accum = c.accumulation(run.dp)
    loss_sum = torch.zeros((), device=run.device)
    micro = run.data.train.next_batch(c.global_batch).split(c.micro_batch)
    for i, mb in enumerate(micro):
        # Skip DDP's gradient all-reduce on all but the last micro-batch of the update (FSDP2 reduce-scatters
        # every micro-batch's gradients into the sharded sum: the same sum, no unsharded copy kept).
        ddp = run.world > 1 and not run.sharded
        sync = run.train_model.no_sync() if ddp and i < len(micro) - 1 else contextlib.nullcontext()
        with sync:
            with run.autocast(), gathered_logits_view(run.model, run.layout):
                loss = causal_lm_loss(run.forward, mb.to(run.device, non_blocking=True))
            (loss / accum).backward()
        loss_sum += loss.detach()
    if run.world > 1:
        # SUM then divide (gloo has no AVG). The stop request rides in the same all-reduce: one count
        # per stopping signal, so a signal on any rank stops every rank after this same update.
        asked = [float(signals.signum == s) for s in SIGNALS]
        both = torch.cat([(loss_sum / accum).reshape(1), torch.tensor(asked, device=run.device)])
        dist.all_reduce(both)
        loss_t = both[0] / run.world
    else:
        loss_t, both = loss_sum / accum, None
    grad_norm_t = _grad_norm([p.grad for p in params if p.grad is not None])
    loss_val, grad_norm = loss_t.item(), grad_norm_t.item()
    stop = signals.signum
    if both is not None:
        counts = both[1:].tolist()  # host copy of two numbers, next to the loss's .item() above
        stop = max(SIGNALS, key=lambda s: counts[SIGNALS.index(s)]) if max(counts) > 0 else None
    if not math.isfinite(loss_val) or not math.isfinite(grad_norm):
        _diverged(run, step, loss_val, grad_norm)
    if c.clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, c.clip, grad_norm_t)
    lr = opt.param_groups[0]["lr"]
    if recorder is not None:
        recorder.begin_step(step + 1)
    opt.step()
    if recorder is not None:
        recorder.end_step()
    run.sched.step()
    opt.zero_grad(set_to_none=True)
    return loss_val, grad_norm, lr, stop


def _grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global gradient norm, plain tensors and DTensors of any mesh alike: per (mesh, placements)
    one norm of the group's norms, ``full_tensor()`` of it, then the norm of those (``get_total_norm``
    cannot stack DTensors of different meshes, as FSDP2 over TP has: 2-D weights, 1-D norms)."""
    from meqmuon.optim.distributed import is_dtensor

    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        key = (id(g.device_mesh), tuple(g.placements)) if is_dtensor(g) else ("plain", g.device)
        groups.setdefault(key, []).append(g)
    norms = []
    for gs in groups.values():
        n = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)))
        norms.append(n.full_tensor() if is_dtensor(n) else n)
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def _diverged(run: Run, step: int, loss: float, grad_norm: float) -> NoReturn:
    what = f"loss became {loss}" if not math.isfinite(loss) else f"gradient norm became {grad_norm}"
    last = latest_checkpoint(run.run_dir)
    where = f" (last good checkpoint: {last})" if last else " (no checkpoint was saved yet)"
    raise TrainingDiverged(f"{what} at step {step + 1}; stopped without saving{where}", step + 1)


def _evaluate(run: Run, logger: MetricsLogger, at: _Progress, quiet: bool) -> dict[str, Any]:
    """Validation loss, perplexity and bits per byte on the fixed validation set, logged."""
    c = run.cfg
    res = evaluate(run.model, run.data.val, batch_size=c.micro_batch, device=run.device, autocast=run.autocast(),
                   val_bytes=run.data.val_bytes,
                   shard=(run.layout.dp_rank, run.layout.dp) if run.sharded else None)
    logger.log({"kind": "eval", "step": at.step, "tokens": at.tokens, **res})
    if run.is_main:
        _write_selection_counts(run, at.step)
    bpb = f" bpb {res['val_bpb']:.4f}" if res["val_bpb"] is not None else ""
    _log(f"[meqmuon] step {at.step}/{c.steps} val loss {res['val_loss']:.4f} ppl {res['val_ppl']:.2f}{bpb}", quiet)
    return res


def _save(run: Run, at: _Progress) -> Path | None:
    """Checkpoint after update ``at.step``: every rank's RNG state, the rest from rank 0, which writes it."""
    rngs = [rng_state()]
    if run.world > 1:
        gathered: list[Any] = [None] * run.world
        dist.all_gather_object(gathered, rngs[0])
        rngs = gathered
    rest = {"config": run.cfg.to_dict(), "scheduler": run.sched.state_dict(), "data": run.data.train.state_dict(),
            "rng": rngs, "tokens": at.tokens, "world_size": run.world}
    if run.sharded:  # every rank writes its shards (torch.distributed.checkpoint)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(run.model, run.opt)
        path = save_sharded_checkpoint(run.run_dir, at.step, {"model": msd, "optim": osd}, rest, run.is_main,
                                       dist.barrier, keep=run.cfg.keep_checkpoints)
        return path if run.is_main else None
    if not run.is_main:
        return None
    payload = {**rest, "model": run.model.state_dict(), "optimizer": run.opt.state_dict()}
    return save_checkpoint(run.run_dir, at.step, payload, keep=run.cfg.keep_checkpoints)


def _interrupted(run: Run, logger: MetricsLogger, at: _Progress, signum: int, saved: int, quiet: bool) -> NoReturn:
    """Checkpoint after update ``at.step`` (unless the loop just did), log the stop, raise :class:`RunInterrupted`."""
    name = SIGNALS[SIGNALS.index(signum)].name
    _log(f"[meqmuon] {name}: saving a checkpoint after step {at.step} (a second signal exits at once)", quiet)
    path = _save(run, at) if saved != at.step else (latest_checkpoint(run.run_dir) if run.is_main else None)
    logger.log({"kind": "stop", "step": at.step, "tokens": at.tokens, "signal": name,
                "checkpoint": str(path) if path is not None else None})
    logger.close()
    raise RunInterrupted(signum, at.step, run.cfg.steps, run.run_dir, path)


def _stopped(run: Run, logger: MetricsLogger, at: _Progress, quiet: bool) -> dict[str, Any]:
    """The summary of a run stopped early by ``stop_at_step`` (its checkpoint is already saved)."""
    logger.close()
    _log(f"[meqmuon] stopped after step {at.step} as asked; continue with --resume auto", quiet)
    return {"finished": False, "step": at.step, "steps": run.cfg.steps, "run_dir": str(run.run_dir),
            "checkpoint": str(list_checkpoints(run.run_dir)[-1][1]) if run.is_main else None}


def _finish(run: Run, logger: MetricsLogger, at: _Progress, quiet: bool) -> dict[str, Any]:
    """Final evaluation and checkpoint if the loop did not just make them; ``summary.json``."""
    if at.last_eval is None:  # resumed at the final step, or eval not at the end
        at.last_eval = _evaluate(run, logger, at, quiet)
        if latest_checkpoint(run.run_dir) is None or list_checkpoints(run.run_dir)[-1][0] != at.step:
            _save(run, at)
    summary = _summary(run, at)
    if run.is_main:
        _write_selection_counts(run, at.step)
        write_json(run.run_dir / "summary.json", summary)
    logger.close()
    return summary


def _summary(run: Run, at: _Progress) -> dict[str, Any]:
    from meqmuon import optimizer_state_bytes

    c, ev = run.cfg, at.last_eval
    state_bytes = optimizer_state_bytes(run.opt)
    return {
        "finished": True, "model": c.model, "optimizer": c.optimizer, "lr": c.lr, "seed": c.seed, "steps": c.steps,
        "tokens": at.tokens, "unique_params": run.n_params,
        "val_loss": ev["val_loss"], "val_ppl": ev["val_ppl"], "val_bpb": ev["val_bpb"], "val_tokens": ev["val_tokens"],
        "optimizer_state_bytes": state_bytes, "optimizer_state_mib": state_bytes / 2**20,
        "tokens_per_s": at.run_tokens / at.train_time if at.train_time > 0 else None,
        "train_time_s": at.train_time, "wall_time_s": time.perf_counter() - at.started,
        "world_size": run.world, "device": str(run.device), "data_source": run.data.source,
        **_numerics_record(c), "run_dir": str(run.run_dir),
    }


# ---- setting up the loop: run directory, log, capture -----------------------------------------------


def _open_log(run: Run) -> tuple[MetricsLogger, bool]:
    """Write ``config.json``, cut ``metrics.jsonl`` back to the checkpoint, log the start; ``(logger, quiet)``."""
    c, run_dir = run.cfg, run.run_dir
    if run.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / "config.json", c.to_dict())
        metrics_path = run_dir / "metrics.jsonl"
        if run.step > 0:
            truncate_metrics(metrics_path, run.step)
        elif metrics_path.exists():
            metrics_path.unlink()  # a run that died before its first checkpoint: start the log afresh
    logger = MetricsLogger(run_dir, enabled=run.is_main, tensorboard=c.tensorboard)
    logger.log({"kind": "run", "step": run.step, "tokens": run.tokens, **_numerics_record(c)})
    quiet = c.quiet or not run.is_main
    layout = run.layout.describe() if run.layout is not None else f"{run.world} process(es)"
    _log(f"[meqmuon] {c.model} ({run.n_params:,} params) | {c.optimizer} lr={c.lr:g} wd={c.weight_decay:g} | "
         f"{c.steps} steps x {c.global_batch} x {c.seq_len} = {c.tokens:,} tokens | {layout}, "
         f"micro-batch {c.micro_batch}, accum {c.accumulation(run.dp)} | {run.device} {c.precision} "
         f"(NS {c.optimizer_args.get('ns_dtype', '-')}, CPU {c.numerics['cpu_capability']}, "
         f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}) | {run_dir}"
         + (f" | resumed at step {run.step}" if run.step else ""), quiet)
    _log(f"[meqmuon] data: {run.data.description}", quiet)
    return logger, quiet


def _capture_recorder(run: Run) -> Any:
    """The capture recorder attached to the optimizer when ``--capture-steps`` asks for one, else ``None``.

    Rank 0 alone records: every rank sees every parameter's momentum input (gradients are all-reduced
    and the optimizer keeps complete state everywhere), so its file is complete, and one writer per
    file avoids ranks overwriting each other's captures.
    """
    if not (run.cfg.capture_steps and run.is_main):
        return None
    from meqmuon.train.capture import CaptureRecorder

    recorder = CaptureRecorder(run.run_dir, list(run.cfg.capture_steps), _list_or_none(run.cfg.capture_layers))
    recorder.attach(run.opt)
    return recorder


def _list_or_none(values: Any) -> list[int] | None:
    return None if values is None else list(values)


def _progress_bar(c: ResolvedConfig, step: int, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=c.steps, initial=step, desc=c.optimizer, file=sys.stderr, dynamic_ncols=True,
                disable=quiet or not sys.stderr.isatty())


def _write_selection_counts(run: Run, step: int) -> None:
    """``selection_counts.json``: per matrix how often MeqMuon normalised rows vs columns (Table 6)."""
    fn = getattr(run.opt, "selection_counts", None)
    counts = {k: list(v) for k, v in fn().items()} if callable(fn) else {}
    if counts:
        write_json(run.run_dir / "selection_counts.json", {"step": step, "optimizer": run.cfg.optimizer,
                                                           "counts": counts})


def _numerics_record(cfg: ResolvedConfig) -> dict[str, Any]:
    """What the numerics of this start or resume resolved to (for metrics.jsonl, summary.json and tables)."""
    n = cfg.numerics or {}
    return {"precision": cfg.precision, "ns_dtype": cfg.optimizer_args.get("ns_dtype"),
            "cpu_capability": n.get("cpu_capability"), "tf32": n.get("tf32"), "attention": n.get("attention")}


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)


def _init_distributed() -> tuple[int, int, int, bool]:
    """``(rank, world_size, local_rank, initialised_here)`` from torchrun's environment variables."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0, False
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), local, True
