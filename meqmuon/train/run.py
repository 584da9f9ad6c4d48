"""Building one run: resolved config, data, model, optimizer, scheduler, and the state of a resumed run.

:func:`build_run` does, in this order, what used to open the training loop: resolve the config's
first stage (:func:`meqmuon.train.config.resolve`), find the checkpoint to resume from (refusing an
existing run without ``--resume``, before any file is written), seed, build the data (rank 0 first,
so that it alone tokenises into the cache), the model, the config's second stage (run length from
the model's size), the optimizer and the :class:`WarmupCosine` schedule, and finally load the
checkpoint's model, optimizer, scheduler, data-order and RNG state.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meqmuon.train.capture import layer_index
from meqmuon.train.checkpoint import (
    CheckpointError,
    find_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_latest_readable,
    set_rng_state,
)
from meqmuon.train.config import (
    IDENTITY_KEYS,
    ResolvedConfig,
    TrainConfig,
    attention_of,
    check_steps_within,
    optimizer_kwargs,
    resolve,
)
from meqmuon.train.device import device_of
from meqmuon.train.parallel import Layout, check_layout, shard_model

__all__ = ["Run", "WarmupCosine", "build_run", "seed_all"]


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


@dataclass
class Run:
    """Everything one training run works on; ``step`` and ``tokens`` are where it starts (or resumed)."""

    cfg: ResolvedConfig
    rank: int
    world: int
    device: torch.device
    data: Any  # meqmuon.train.data.DataBundle
    model: torch.nn.Module  # sharded in place under --fsdp / --tp (DTensor parameters)
    train_model: torch.nn.Module  # ``model``, DDP-wrapped when world > 1 and not sharded
    forward: torch.nn.Module  # ``train_model``, compiled with --compile
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    n_params: int
    step: int
    tokens: int
    layout: Layout | None = None  # world = dp x tp; None: one process or DDP

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """DTensor parameters (--fsdp / --tp): checkpoints go through torch.distributed.checkpoint."""
        return self.layout is not None and self.layout.sharded

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own share of the global batch (a TP group shares one)."""
        return self.layout.dp if self.layout is not None else self.world

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast when the run's precision is bf16, else nothing (fp32)."""
        if self.cfg.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def seed_all(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (the model's init and the data order follow)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_run(cfg: TrainConfig, rank: int, world: int, local_rank: int) -> Run:
    """The run ``cfg`` describes, ready to train (see the module docstring for the order)."""
    from meqmuon import build_optimizer
    from meqmuon.train.models import build_model, count_unique_params

    device = device_of(cfg.device, local_rank)
    check_layout(world, cfg.tp, cfg.fsdp)
    layout = Layout(world, cfg.tp, cfg.fsdp, rank)
    plan = resolve(cfg, device=device, world_size=layout.dp)
    ckpt_path, ckpt = _checkpoint_to_resume(plan, announce=rank == 0)
    seed_all(plan.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if plan.tf32 else "highest")
    if rank == 0:
        _warn_bf16(plan, device)
    data = _build_data(plan, rank, world, layout)
    vocab = _model_vocab(plan, data.tokenizer)
    if rank == 0:
        _note_vocab(plan, data.tokenizer, vocab)
    model = build_model(plan.model, vocab_size=vocab, seed=plan.seed, device=device,
                        attention=attention_of(plan.precision, device, plan.seq_len))
    n_params = count_unique_params(model)
    final = plan.for_model(unique_params=n_params, data_source=data.source, vocab_size=model.config.vocab_size)
    if ckpt is not None and final.resume:
        _check_resume_config(ckpt["config"], final, ckpt_path)
    _check_within_run(final, model)
    shard_model(model, layout, final.precision, device)
    opt = build_optimizer(final.optimizer, model, **optimizer_kwargs(final))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(final.steps, final.warmup_ratio, final.min_lr_ratio))
    train_model = model
    if world > 1 and not layout.sharded:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    run = Run(final, rank, world, device, data, model, train_model,
              torch.compile(train_model) if final.compile else train_model, opt, sched, n_params, 0, 0, layout)
    if ckpt is not None:
        _restore(run, ckpt, ckpt_path)
        if final.stop_at_step is not None and final.stop_at_step <= run.step:
            raise ValueError(f"--stop-at-step {final.stop_at_step}: the run is already at step {run.step} "
                             f"(checkpoint {ckpt_path}); give a later step, or leave it out to train to the end")
    else:
        # Same weights and data order on every rank; per-rank training RNG (nothing random is drawn in
        # the loop today, but future dropout/sampling must differ across ranks).
        seed_all(final.seed + rank)
    return run


def _checkpoint_to_resume(cfg: ResolvedConfig, announce: bool = True) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint ``--resume`` names (``None`` without it); refuses an existing run without it.

    ``auto`` takes the newest readable checkpoint: an unreadable newer one is skipped with one warning
    line naming it (``announce``: rank 0 prints, every rank skips the same files).
    """
    run_dir = cfg.run_dir
    if cfg.resume == "auto":
        path, ckpt, skipped = load_latest_readable(run_dir)
        if announce:
            for bad, why in skipped:
                why = why.removeprefix(f"cannot read checkpoint {bad}: ")
                print(f"meqmuon: warning: skipping unreadable checkpoint {bad}: {why}; resuming from "
                      f"{path.name if path is not None and path.parent == bad.parent else path}", file=sys.stderr)
        if path is not None:
            return path, ckpt
    path = find_checkpoint(cfg.resume, run_dir) if cfg.resume and cfg.resume != "auto" else None
    if path is None and (latest_checkpoint(run_dir) is not None or (run_dir / "summary.json").exists()):
        raise CheckpointError(f"run directory {run_dir} already holds a run; pass --resume auto to continue it "
                              "or choose another --out")
    return path, (load_checkpoint(path) if path is not None else None)


def _build_data(cfg: ResolvedConfig, rank: int, world: int, layout: Layout) -> Any:
    from meqmuon.train.data import build_data

    if world > 1 and rank != 0:
        dist.barrier()  # rank 0 tokenises and caches first; the others then read the cache
    # The data-parallel coordinate: the ranks of one tensor-parallel group read the same rows.
    data = build_data(None if cfg.data == "builtin" else cfg.data, tokenizer_name=_tokenizer_name(cfg),
                      seq_len=cfg.seq_len, seed=cfg.seed, rank=layout.dp_rank, world_size=layout.dp,
                      cache_dir=cfg.cache_dir,
                      val_tokens=cfg.val_tokens, vocab_size=cfg.vocab_size, val_fraction=cfg.val_fraction,
                      announce=rank == 0 and not cfg.quiet)
    if world > 1 and rank == 0:
        dist.barrier()
    return data


def _restore(run: Run, ckpt: dict[str, Any], path: Path) -> None:
    """Load a checkpoint's state into the freshly built run; any misfit is a :class:`CheckpointError`.

    A sharded checkpoint (a directory: :mod:`torch.distributed.checkpoint`) loads into any layout, one
    process included: DCP reshards model and optimizer state. A single file (one process or DDP) loads
    directly into an unsharded run, and through a DCP copy of it into a sharded one (:func:`_restore_sharded`).
    """
    try:
        if path.is_dir() or run.sharded:
            _restore_sharded(run, ckpt, path)
        else:
            run.model.load_state_dict(ckpt["model"])
            run.opt.load_state_dict(ckpt["optimizer"])
        run.sched.load_state_dict(ckpt["scheduler"])
        run.data.train.load_state_dict(ckpt["data"])
        rngs = ckpt["rng"]
        set_rng_state(rngs[run.rank] if len(rngs) == run.world else rngs[0])
    except (KeyError, RuntimeError, ValueError, IndexError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} does not fit this run: {msg}") from None
    run.step, run.tokens = int(ckpt["step"]), int(ckpt["tokens"])


def _restore_sharded(run: Run, ckpt: dict[str, Any], path: Path) -> None:
    """Model and optimizer state through ``torch.distributed.checkpoint`` into whatever layout this run has.

    A checkpoint directory is loaded as it is (``get_state_dict`` gives the templates, ``dcp.load`` reshards
    into them, ``set_state_dict`` installs them: torchtitan's ``components/checkpoint.py`` does the same).
    A single-file checkpoint is first written as a DCP directory by rank 0 from an unsharded copy of the
    model and optimizer that loads it (beside the checkpoint, removed after), then loaded the same way.
    """
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from meqmuon import build_optimizer
    from meqmuon.train.models import build_model

    source, converted = (path, None) if path.is_dir() else (None, path.with_name(f".{path.stem}.dcp"))
    if converted is not None:
        if run.is_main:
            plain = build_model(run.cfg.model, vocab_size=run.model.config.vocab_size, device="cpu")
            opt = build_optimizer(run.cfg.optimizer, plain, **optimizer_kwargs(run.cfg))
            plain.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            msd, osd = get_state_dict(plain, opt)
            with _dcp_in_one_process(True):
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(converted), no_dist=True)
        if run.world > 1:
            dist.barrier()
        source = converted
    msd, osd = get_state_dict(run.model, run.opt)  # templates: DCP loads into them in place
    state = {"model": msd, "optim": osd}
    with _dcp_in_one_process(not dist.is_initialized()):
        dcp.load(state, checkpoint_id=str(source), no_dist=not dist.is_initialized())
    set_state_dict(run.model, run.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if converted is not None:
        if run.world > 1:
            dist.barrier()
        if run.is_main:
            shutil.rmtree(converted, ignore_errors=True)


@contextlib.contextmanager
def _dcp_in_one_process(alone: bool) -> Iterator[None]:
    """Silence DCP's "assuming the intent is to load (save) in a single process" where that is the intent:
    ``alone`` is true only when this process passes ``no_dist=True`` itself (one process resuming a sharded
    checkpoint, or rank 0 converting a single-file one), and torch warns even then. Only that message."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", category=UserWarning, message=(
                r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to "
                r"(load|save) in a single process"))
        yield


def _check_within_run(cfg: ResolvedConfig, model: torch.nn.Module) -> None:
    """``--stop-at-step`` and ``--capture-steps`` within the run, ``--capture-layers`` among the model's
    layers, or a ``ValueError``: a stop or a capture that can never happen would otherwise be skipped
    without a word (the run's length is known here, once the model's size is; :func:`validate_config`
    checks the steps earlier where ``--steps`` gives the length)."""
    check_steps_within(cfg.stop_at_step, cfg.capture_steps, cfg.steps)
    if cfg.capture_layers is None:
        return
    layers = sorted({i for n, _ in model.named_parameters() if (i := layer_index(n)) is not None})
    missing = [i for i in cfg.capture_layers if i not in layers]
    if missing:
        have = f"layers {layers[0]}-{layers[-1]}" if layers else "no numbered layers"
        raise ValueError(f"--capture-layers {','.join(map(str, missing))} not in the model: {cfg.model} has {have}")


def _tokenizer_name(cfg: ResolvedConfig) -> str | None:
    from meqmuon.train.models import get_spec

    if cfg.tokenizer is not None:
        return None if cfg.tokenizer == "builtin" else cfg.tokenizer
    return get_spec(cfg.model).tokenizer if str(cfg.data).lower() == "c4" else None


def _model_vocab(cfg: ResolvedConfig, tokenizer: Any) -> int:
    from meqmuon.train.models import get_spec

    spec = get_spec(cfg.model)
    # With the model's own hub tokenizer keep the paper's embedding rows (e.g. Qwen2's padded 151936),
    # but never fewer rows than the tokenizer has ids (T5-base has 100 sentinel ids past 32000).
    if spec.tokenizer is not None and tokenizer.name == spec.tokenizer:
        return max(spec.vocab_size, tokenizer.vocab_size)
    return tokenizer.vocab_size


def _note_vocab(cfg: ResolvedConfig, tokenizer: Any, vocab: int) -> None:
    """One line when the model's vocabulary is not the config's ``vocab_size`` (``--vocab-size`` or the
    preset's): the data brought its own tokenizer (a prepared directory, a hub tokenizer), so the
    embedding and head have another size than the preset's, and with them the parameter count and the
    default run length. The model's own hub tokenizer is no news and says nothing."""
    from meqmuon.train.models import get_spec

    own = get_spec(cfg.model).tokenizer
    if vocab != cfg.vocab_size and not (own is not None and tokenizer.name == own):
        print(f"meqmuon: note: {cfg.model} is built with the data's vocabulary, {vocab:,} ids ({tokenizer.name}), "
              f"not the {cfg.vocab_size:,} of its preset or --vocab-size; config.json records vocab_size {vocab}",
              file=sys.stderr)


def _check_resume_config(saved: dict[str, Any], cfg: ResolvedConfig, path: Path) -> None:
    mine = cfg.to_dict()
    for key in IDENTITY_KEYS:
        if key == "vocab_size" and saved.get(key) == cfg.numerics.get("requested_vocab_size"):
            continue  # a checkpoint written before config.json recorded the vocabulary as built
        if saved.get(key) != mine.get(key):
            hint = ""
            if key == "precision" or (key == "optimizer_args" and (saved.get(key) or {}).get("ns_dtype")
                                      != (mine.get(key) or {}).get("ns_dtype")):
                # "auto" resolved differently here than where the run started (another kind of CPU/GPU)
                hint = (f"; 'auto' precision/ns_dtype follow the hardware (here: CPU capability "
                        f"{cfg.numerics.get('cpu_capability')}): pass the stored values explicitly, or resume "
                        "with `meqmuon train --out DIR --resume auto`, which reuses them")
            raise CheckpointError(
                f"checkpoint {path} does not match this run: it has {key}={saved.get(key)!r}, this run "
                f"{key}={mine.get(key)!r} (resume with the same settings or choose another --out){hint}")


def _warn_bf16(cfg: ResolvedConfig, device: torch.device) -> None:
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
