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

Divergence: a non-finite loss or gradient norm stops the run before the optimizer step and raises
:class:`TrainingDiverged` naming the step; nothing is saved after the last good checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meqmuon.optim.registry import REGISTRY
from meqmuon.train.checkpoint import (
    CheckpointError,
    find_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from meqmuon.train.config import (
    IDENTITY_KEYS,
    TrainConfig,
    config_to_dict,
    fill_model_defaults,
    optimizer_kwargs,
    resolve_config,
    resolve_numerics,
    validate_config,
)
from meqmuon.train.evaluate import causal_lm_loss, evaluate
from meqmuon.train.metrics import MetricsLogger, truncate_metrics

__all__ = ["TrainingDiverged", "WarmupCosine", "train", "run_dir_of", "write_json"]


class TrainingDiverged(RuntimeError):
    """The loss (or gradient norm) became NaN/Inf at ``step`` (1-based update index)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class WarmupCosine:
    """LR multiplier for update index ``s`` (0-based): ``(s + 1) / warmup`` during warmup, then
    ``min + (1 - min) * (1 + cos(pi * p)) / 2`` with ``p = (s - warmup) / (steps - warmup)``.

    A plain object (not a lambda) so that ``LambdaLR.state_dict`` stores its fields.
    """

    def __init__(self, steps: int, warmup_ratio: float = 0.05, min_lr_ratio: float = 0.0):
        self.steps = int(steps)
        self.warmup = int(round(warmup_ratio * steps))
        self.min_lr_ratio = float(min_lr_ratio)

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        p = min(1.0, (s - self.warmup) / max(1, self.steps - self.warmup))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def run_dir_of(cfg: TrainConfig) -> Path:
    """The run directory: ``cfg.out``, else the run a ``--resume PATH`` points into, else the default name."""
    if cfg.out is not None:
        return Path(cfg.out)
    if cfg.resume not in (None, "auto"):
        p = Path(cfg.resume)
        return p if p.is_dir() else p.parent.parent
    known = REGISTRY.get(str(cfg.optimizer).lower())  # not validated yet: an unknown name fails later
    lr = cfg.lr if cfg.lr is not None else known.default_lr if known else 0.0
    return Path(f"runs/{cfg.model}-{cfg.optimizer}-lr{lr:g}-s{cfg.seed}")


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


def _device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device != "auto":
        return torch.device(cfg.device)
    return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _tokenizer_name(cfg: TrainConfig) -> str | None:
    from meqmuon.train.models import get_spec

    if cfg.tokenizer is not None:
        return None if cfg.tokenizer == "builtin" else cfg.tokenizer
    return get_spec(cfg.model).tokenizer if str(cfg.data).lower() == "c4" else None


def _model_vocab(cfg: TrainConfig, tokenizer: Any) -> int:
    from meqmuon.train.models import get_spec

    spec = get_spec(cfg.model)
    # With the model's own hub tokenizer keep the paper's embedding rows (e.g. Qwen2's padded 151936),
    # but never fewer rows than the tokenizer has ids (T5-base has 100 sentinel ids past 32000).
    if spec.tokenizer is not None and tokenizer.name == spec.tokenizer:
        return max(spec.vocab_size, tokenizer.vocab_size)
    return tokenizer.vocab_size


def _check_resume_config(saved: dict[str, Any], cfg: TrainConfig, path: Path) -> None:
    mine = config_to_dict(cfg)
    for key in IDENTITY_KEYS:
        if saved.get(key) != mine.get(key):
            hint = ""
            if key == "precision" or (key == "optimizer_args" and (saved.get(key) or {}).get("ns_dtype")
                                      != (mine.get(key) or {}).get("ns_dtype")):
                # "auto" resolved differently here than where the run started (another kind of CPU/GPU)
                hint = (f"; 'auto' precision/ns_dtype follow the hardware (here: CPU capability "
                        f"{(cfg.numerics or {}).get('cpu_capability')}): pass the stored values explicitly, or resume "
                        "with `meqmuon train --out DIR --resume auto`, which reuses them")
            raise CheckpointError(
                f"checkpoint {path} does not match this run: it has {key}={saved.get(key)!r}, this run "
                f"{key}={mine.get(key)!r} (resume with the same settings or choose another --out){hint}")


def _numerics_record(cfg: TrainConfig) -> dict[str, Any]:
    """What the numerics of this start or resume resolved to (for metrics.jsonl, summary.json and tables)."""
    n = cfg.numerics or {}
    return {"precision": cfg.precision, "ns_dtype": cfg.optimizer_args.get("ns_dtype"),
            "cpu_capability": n.get("cpu_capability"), "tf32": n.get("tf32")}


def _warn_bf16(cfg: TrainConfig, device: torch.device) -> None:
    """One line on stderr when bf16 was asked for explicitly on a CPU without native bf16."""
    from meqmuon.precision import bf16_warning

    forced = []
    if cfg.precision == "bf16":
        forced.append("bf16 autocast")
    if cfg.optimizer_args.get("ns_dtype") == "bfloat16":
        forced.append("bf16 Newton-Schulz")
    msg = bf16_warning(device, what=" and ".join(forced)) if forced else None
    if msg:
        print(f"meqmuon: warning: {msg}; --precision auto or fp32 and the default ns_dtype avoid it",
              file=sys.stderr)


def _selection_counts(opt: torch.optim.Optimizer) -> dict[str, list[int]]:
    fn = getattr(opt, "selection_counts", None)
    return {k: list(v) for k, v in fn().items()} if callable(fn) else {}


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train one run as ``cfg`` says and return its summary (also written to ``summary.json``).

    With ``cfg.stop_at_step`` the run saves a checkpoint after that step and returns early
    (``summary["finished"] is False``); ``cfg.resume="auto"`` continues it bit for bit.

    Raises:
        ValueError: invalid configuration (unknown names, non-positive sizes, indivisible batch,
            missing data), also from :func:`meqmuon.build_optimizer` (e.g. SCALE on a tied model).
        CheckpointError: unreadable or mismatched checkpoint; an existing run without ``resume``.
        TrainingDiverged: the loss became NaN/Inf.
    """
    from meqmuon import build_optimizer, optimizer_state_bytes
    from meqmuon.train.data import build_data
    from meqmuon.train.models import build_model, count_unique_params

    cfg = dataclasses.replace(cfg, optimizer_args=dict(cfg.optimizer_args))
    validate_config(cfg)
    cfg = fill_model_defaults(cfg)
    rank, world, local_rank, own_pg = _init_distributed()
    matmul_precision = torch.get_float32_matmul_precision()  # process-global: restored on return
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        # On a CPU shared with other jobs, fewer threads than cores avoids OpenMP's oversubscription
        # stalls (docs/benchmarks.md, "design measurements").
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, rank, world, local_rank, build_optimizer, optimizer_state_bytes, build_data, build_model,
                      count_unique_params)
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
        torch.set_num_threads(threads)
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg, rank, world, local_rank, build_optimizer, optimizer_state_bytes, build_data, build_model,
           count_unique_params) -> dict[str, Any]:
    t_start = time.perf_counter()
    is_main = rank == 0
    run_dir = run_dir_of(cfg)
    cfg.out = str(run_dir)

    # ---- what to resume from (checked before any file is written) -------------------------------
    ckpt_path = find_checkpoint(cfg.resume, run_dir) if cfg.resume else None
    if ckpt_path is None and (latest_checkpoint(run_dir) is not None or (run_dir / "summary.json").exists()):
        raise CheckpointError(f"run directory {run_dir} already holds a run; pass --resume auto to continue it "
                              "or choose another --out")
    ckpt = load_checkpoint(ckpt_path) if ckpt_path is not None else None

    # ---- data, model, optimizer -------------------------------------------------------------------
    _seed_all(cfg.seed)
    device = _device(cfg, local_rank)
    cfg = resolve_numerics(cfg, device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    if is_main:
        _warn_bf16(cfg, device)
    data_kwargs = dict(tokenizer_name=_tokenizer_name(cfg), seq_len=cfg.seq_len, seed=cfg.seed, rank=rank,
                       world_size=world, cache_dir=cfg.cache_dir, val_tokens=cfg.val_tokens,
                       vocab_size=cfg.vocab_size, val_fraction=cfg.val_fraction)
    if world > 1 and not is_main:
        dist.barrier()  # rank 0 tokenises and caches first; the others then read the cache
    data = build_data(None if cfg.data == "builtin" else cfg.data, **data_kwargs)
    if world > 1 and is_main:
        dist.barrier()
    cfg = dataclasses.replace(cfg, data_source=data.source)
    model = build_model(cfg.model, vocab_size=_model_vocab(cfg, data.tokenizer), seed=cfg.seed, device=device)
    n_params = count_unique_params(model)
    cfg = resolve_config(cfg, unique_params=n_params, world_size=world)
    if cfg.resume and ckpt is not None:
        _check_resume_config(ckpt["config"], cfg, ckpt_path)
    opt = build_optimizer(cfg.optimizer, model, **optimizer_kwargs(cfg))
    schedule = WarmupCosine(cfg.steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    accum = cfg.global_batch // (world * cfg.micro_batch)

    step, tokens_seen = 0, 0
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            sched.load_state_dict(ckpt["scheduler"])
            data.train.load_state_dict(ckpt["data"])
            rngs = ckpt["rng"]
            set_rng_state(rngs[rank] if len(rngs) == world else rngs[0])
        except (KeyError, RuntimeError, ValueError, IndexError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {ckpt_path} does not fit this run: {msg}") from None
        step, tokens_seen = int(ckpt["step"]), int(ckpt["tokens"])
        del ckpt
    else:
        # Same weights and data order on every rank; per-rank training RNG (nothing random is drawn in
        # the loop today, but future dropout/sampling must differ across ranks).
        _seed_all(cfg.seed + rank)

    # ---- run directory -----------------------------------------------------------------------------
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / "config.json", config_to_dict(cfg))
        metrics_path = run_dir / "metrics.jsonl"
        if step > 0:
            truncate_metrics(metrics_path, step)
        elif metrics_path.exists():
            metrics_path.unlink()  # a run that died before its first checkpoint: start the log afresh
    logger = MetricsLogger(run_dir, enabled=is_main, tensorboard=cfg.tensorboard)
    logger.log({"kind": "run", "step": step, "tokens": tokens_seen, **_numerics_record(cfg)})
    quiet = cfg.quiet or not is_main
    _log(f"[meqmuon] {cfg.model} ({n_params:,} params) | {cfg.optimizer} lr={cfg.lr:g} wd={cfg.weight_decay:g} | "
         f"{cfg.steps} steps x {cfg.global_batch} x {cfg.seq_len} = {cfg.tokens:,} tokens | world {world}, "
         f"micro-batch {cfg.micro_batch}, accum {accum} | {device} {cfg.precision} "
         f"(NS {cfg.optimizer_args.get('ns_dtype', '-')}, CPU {cfg.numerics['cpu_capability']}) | {run_dir}"
         + (f" | resumed at step {step}" if step else ""), quiet)
    _log(f"[meqmuon] data: {data.description}", quiet)

    train_model: torch.nn.Module = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    fwd_model = torch.compile(train_model) if cfg.compile else train_model
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
                else contextlib.nullcontext())

    recorder = None
    # Rank 0 alone records: every rank sees every parameter's momentum input (gradients are
    # all-reduced and the optimizer keeps complete state everywhere), so its file is complete,
    # and one writer per file avoids ranks overwriting each other's captures.
    if cfg.capture_steps and is_main:
        from meqmuon.train.capture import CaptureRecorder

        recorder = CaptureRecorder(run_dir, cfg.capture_steps, cfg.capture_layers)
        recorder.attach(opt)

    def save(at: int) -> Path | None:
        rngs = [rng_state()]
        if world > 1:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, rngs[0])
            rngs = gathered
        if not is_main:
            return None
        payload = {"config": config_to_dict(cfg), "model": model.state_dict(), "optimizer": opt.state_dict(),
                   "scheduler": sched.state_dict(), "data": data.train.state_dict(), "rng": rngs,
                   "tokens": tokens_seen, "world_size": world}
        return save_checkpoint(run_dir, at, payload, keep=cfg.keep_checkpoints)

    def run_eval() -> dict[str, Any]:
        res = evaluate(model, data.val, batch_size=cfg.micro_batch,
                       device=device, autocast=autocast, val_bytes=data.val_bytes)
        logger.log({"kind": "eval", "step": step, "tokens": tokens_seen, **res})
        if is_main:
            counts = _selection_counts(opt)
            if counts:
                write_json(run_dir / "selection_counts.json",
                           {"step": step, "optimizer": cfg.optimizer, "counts": counts})
        bpb = f" bpb {res['val_bpb']:.4f}" if res["val_bpb"] is not None else ""
        _log(f"[meqmuon] step {step}/{cfg.steps} val loss {res['val_loss']:.4f} ppl {res['val_ppl']:.2f}{bpb}", quiet)
        return res

    from tqdm import tqdm

    bar = tqdm(total=cfg.steps, initial=step, desc=cfg.optimizer, file=sys.stderr, dynamic_ncols=True,
               disable=quiet or not sys.stderr.isatty())
    tokens_per_step = cfg.global_batch * cfg.seq_len
    params = [p for p in model.parameters() if p.requires_grad]
    session_tokens, train_time, last_eval = 0, 0.0, None
    stopped = False
    try:
        while step < cfg.steps:
            t0 = time.perf_counter()
            batch = data.train.next_batch(cfg.global_batch)
            loss_sum = torch.zeros((), device=device)
            micro = batch.split(cfg.micro_batch)
            for i, mb in enumerate(micro):
                # Skip DDP's gradient all-reduce on all but the last micro-batch of the update.
                sync = train_model.no_sync() if world > 1 and i < len(micro) - 1 else contextlib.nullcontext()
                with sync:
                    with autocast:
                        loss = causal_lm_loss(fwd_model, mb.to(device, non_blocking=True))
                    (loss / accum).backward()
                loss_sum += loss.detach()
            loss_t = loss_sum / accum
            if world > 1:  # SUM then divide: gloo has no AVG
                dist.all_reduce(loss_t)
                loss_t /= world
            grad_norm_t = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            loss_val, grad_norm = loss_t.item(), grad_norm_t.item()
            if not math.isfinite(loss_val) or not math.isfinite(grad_norm):
                what = f"loss became {loss_val}" if not math.isfinite(loss_val) else f"gradient norm became {grad_norm}"
                last = latest_checkpoint(run_dir)
                raise TrainingDiverged(
                    f"{what} at step {step + 1}; stopped without saving"
                    + (f" (last good checkpoint: {last})" if last else " (no checkpoint was saved yet)"), step + 1)
            if cfg.clip is not None:
                torch.nn.utils.clip_grads_with_norm_(params, cfg.clip, grad_norm_t)
            lr = opt.param_groups[0]["lr"]
            if recorder is not None:
                recorder.begin_step(step + 1)
            opt.step()
            if recorder is not None:
                recorder.end_step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            session_tokens += tokens_per_step
            dt = time.perf_counter() - t0
            train_time += dt
            logger.log({"kind": "train", "step": step, "tokens": tokens_seen, "loss": loss_val, "lr": lr,
                        "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / dt,
                        "time_s": time.perf_counter() - t_start})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_val:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                last_eval = run_eval()
            if step == cfg.steps or step % cfg.save_every == 0 or step == cfg.stop_at_step:
                save(step)
            if cfg.stop_at_step is not None and step >= cfg.stop_at_step and step < cfg.steps:
                stopped = True
                break
    finally:
        bar.close()

    if stopped:
        logger.close()
        _log(f"[meqmuon] stopped after step {step} as asked; continue with --resume auto", quiet)
        return {"finished": False, "step": step, "steps": cfg.steps, "run_dir": str(run_dir),
                "checkpoint": str(list_checkpoints(run_dir)[-1][1]) if is_main else None}

    if last_eval is None:  # resumed at the final step, or eval not at the end
        last_eval = run_eval()
        if latest_checkpoint(run_dir) is None or list_checkpoints(run_dir)[-1][0] != step:
            save(step)
    state_bytes = optimizer_state_bytes(opt)
    summary = {
        "finished": True,
        "model": cfg.model,
        "optimizer": cfg.optimizer,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "steps": cfg.steps,
        "tokens": tokens_seen,
        "unique_params": n_params,
        "val_loss": last_eval["val_loss"],
        "val_ppl": last_eval["val_ppl"],
        "val_bpb": last_eval["val_bpb"],
        "val_tokens": last_eval["val_tokens"],
        "optimizer_state_bytes": state_bytes,
        "optimizer_state_mib": state_bytes / 2**20,
        "tokens_per_s": session_tokens / train_time if train_time > 0 else None,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "world_size": world,
        "device": str(device),
        "data_source": data.source,
        **_numerics_record(cfg),
        "run_dir": str(run_dir),
    }
    if is_main:
        counts = _selection_counts(opt)
        if counts:
            write_json(run_dir / "selection_counts.json", {"step": step, "optimizer": cfg.optimizer, "counts": counts})
        write_json(run_dir / "summary.json", summary)
    logger.close()
    return summary
