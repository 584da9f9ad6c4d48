"""Typed run configuration of the training harness (``TrainConfig``) and its resolution rules.

Every field has a default; :func:`resolve` turns the user's ``TrainConfig`` into a frozen
:class:`ResolvedConfig` with the derived ones filled in (lr from the optimizer, run length from the
token budget, evaluation interval, run directory, numerics, data source) so that the JSON written
into each run directory states every value the run used (design notes, convention 6). Nothing
mutates a config: every step returns a new value.

Defaults follow the paper's setup (section 4): global batch 512 x 1024 tokens, 1M validation tokens,
20 tokens per unique parameter, 5 % linear warmup then cosine decay to zero, weight decay 0.1, no
gradient clipping, bf16 autocast with fp32 master weights. Two exceptions, both decided by the
hardware or the model rather than the paper:

* ``precision="auto"`` (default) means bf16 autocast where the device runs bf16 natively and fp32
  elsewhere (:mod:`meqmuon.precision`): on an AVX2-only CPU bf16 autocast trained the demo 13x
  slower than fp32 (docs/training.md). The Newton-Schulz dtype of the Muon-family optimizers is resolved
  the same way. Both are written into the run's config as concrete values (:func:`resolve_numerics`).
* The CPU presets (``*-tiny``) default to CPU-sized batches (:data:`CPU_PRESET_DEFAULTS`): with the
  paper's 512 x 1024 batch and 1M validation tokens one step of a 1.8M-parameter model took minutes.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from meqmuon import precision as _precision
from meqmuon.precision import PRECISIONS, resolve_ns_dtype, resolve_precision
from meqmuon.train.device import check_device

__all__ = [
    "TrainConfig",
    "ResolvedConfig",
    "resolve",
    "run_name",
    "run_dir_of",
    "IDENTITY_KEYS",
    "PAPER_RUN_DEFAULTS",
    "CPU_PRESET_DEFAULTS",
    "model_run_defaults",
    "default_eval_every",
    "fill_model_defaults",
    "resolve_numerics",
    "attention_of",
    "FLOAT32_ATTENTION_MAX_SEQ_LEN",
    "config_from_dict",
    "config_to_dict",
    "load_config_file",
    "parse_optimizer_args",
    "parse_int_list",
    "validate_config",
    "check_positive",
    "check_out_dir",
    "check_steps_within",
    "optimizer_kwargs",
    "resume_requests",
    "REQUESTED_KEYS",
]

#: Batch, sequence and validation sizes of the paper (section 4), the defaults of the paper models, and
#: the built-in BPE's vocabulary where they run on it (their hub tokenizers ignore it).
PAPER_RUN_DEFAULTS: dict[str, int] = {"global_batch": 512, "seq_len": 1024, "val_tokens": 1_000_000,
                                      "vocab_size": 4096}

#: The same for the CPU presets (``llama-tiny`` etc.): the demo's 32 x 128-token batch, which makes
#: a step of a ~2M-parameter model take ~0.1-1 s on 2 CPU cores instead of minutes, and the whole
#: held-out split of the built-in corpus (~30k tokens) for validation.
CPU_PRESET_DEFAULTS: dict[str, int] = {"global_batch": 32, "seq_len": 128, "val_tokens": 32_768, "vocab_size": 4096}

#: ``llama-micro`` (issue 39: the paper's 20 tokens per parameter on one CPU thread): the CPU presets' batch
#: with a 1,280-id built-in BPE, so that embeddings and head stay ~53 % of its 234k parameters, as
#: Llama-60M's are 56 % of its 58M (with 4,096 ids they would be 84 %).
MICRO_DEFAULTS: dict[str, int] = {**CPU_PRESET_DEFAULTS, "vocab_size": 1280}

#: Default evaluation interval: evaluation may take at most this share of the training compute.
EVAL_COMPUTE_SHARE = 0.1

#: Upper bound of the automatic micro-batch (sequences per forward pass per rank).
MAX_AUTO_MICRO_BATCH = 32

#: Keys that define the trajectory of a run: a checkpoint can only be resumed with the same values.
#: Everything else (logging, saving, stopping, micro-batch, compile, device) may change on resume.
IDENTITY_KEYS = (
    "model", "optimizer", "lr", "weight_decay", "optimizer_args", "data", "tokenizer", "vocab_size",
    "val_fraction", "seq_len", "global_batch", "steps", "warmup_ratio", "min_lr_ratio", "clip", "seed",
    "precision",
)


@dataclass
class TrainConfig:
    """One training run. ``None`` means "derive it" (see :func:`resolve` and :meth:`ResolvedConfig.for_model`)."""

    # what to train
    model: str = "llama-tiny"
    optimizer: str = "meqmuon"
    lr: float | None = None  # None -> the optimizer's default_lr (meqmuon.optim.registry)
    weight_decay: float = 0.1
    optimizer_args: dict[str, Any] = field(default_factory=dict)  # passthrough to build_optimizer
    # data
    data: str = "builtin"  # "builtin", "c4", a prepared directory, a local C4 copy, or data files/directories
    tokenizer: str | None = None  # HF hub id or directory; None -> the model's own for c4, a prepared
    # directory's own, the built-in BPE otherwise
    vocab_size: int | None = None  # built-in BPE vocabulary (ignored with a hub tokenizer); None -> per model
    val_fraction: float = 0.05
    val_tokens: int | None = None  # validation targets (fewer if less held-out text); None -> per model
    cache_dir: str | None = None  # None -> $MEQMUON_CACHE or ~/.cache/meqmuon
    # run length and batch
    tokens: int | None = None  # None -> 20 x unique parameters (when steps is None too)
    steps: int | None = None  # optimizer updates; derived from tokens when None
    seq_len: int | None = None  # None -> per model (model_run_defaults): 1024, CPU presets 128
    global_batch: int | None = None  # sequences per update over all ranks and micro-batches; None -> 512 / 32
    micro_batch: int | None = None  # sequences per forward pass per rank; None -> see _micro_batch
    # schedule and regularisation
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.0
    clip: float | None = None  # max global grad norm; None -> no clipping (the paper's setting)
    seed: int = 0
    # numerics and hardware
    precision: str = "auto"  # "auto", "bf16" (autocast, fp32 master weights) or "fp32"; resolved per device
    tf32: bool = True  # CUDA: TF32 float32 matmuls (torch.set_float32_matmul_precision("high")); no effect on CPU
    device: str = "auto"  # "auto" -> cuda:LOCAL_RANK if available, else cpu
    compile: bool = False
    fsdp: bool = False  # FSDP2 (fully_shard) over the data-parallel ranks (meqmuon.train.parallel)
    tp: int = 1  # tensor-parallel degree: torchtitan's plan on a TP mesh of this size
    threads: int | None = None  # CPU intra-op threads (torch.set_num_threads) during the run; None -> 1 on CPU
    # evaluation, checkpoints, logging
    out: str | None = None  # None -> runs/<model>-<optimizer>-lr<lr>-s<seed>
    eval_every: int | None = None  # None -> default_eval_every: ~20 evaluations, at most ~10 % of the compute
    save_every: int | None = None  # None -> about 10 checkpoints per run (also at the end and on stop)
    keep_checkpoints: int = 2
    stop_at_step: int | None = None  # save and exit cleanly after this step
    resume: str | None = None  # "auto" or a checkpoint path / run directory
    capture_steps: list[int] | None = None
    capture_layers: list[int] | None = None
    quiet: bool = False
    tensorboard: bool = False
    # written by the harness (resolve_numerics), ignored as input: what "auto" became on this machine
    numerics: dict[str, Any] | None = None
    # written by the harness, ignored as input: which source --data named (meqmuon.train.data.DATA_SOURCES)
    data_source: str | None = None


def config_to_dict(cfg: TrainConfig | ResolvedConfig) -> dict[str, Any]:
    """JSON-ready dict of every field."""
    return cfg.to_dict() if isinstance(cfg, ResolvedConfig) else dataclasses.asdict(cfg)


def config_from_dict(d: dict[str, Any]) -> TrainConfig:
    """Build a config from a dict; unknown keys are an error that lists the valid ones."""
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; valid keys: {', '.join(names)}")
    return TrainConfig(**d)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON config file (e.g. a run's ``config.json``) as a dict, checking its keys."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file does not exist: {p}")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {p} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"config file {p} must hold a JSON object")
    config_from_dict(d)  # key check
    return d


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # plain strings such as ns_dtype=float32


def parse_optimizer_args(items: list[str] | None) -> dict[str, Any]:
    """``["momentum=0.9", "nesterov=False"]`` -> ``{"momentum": 0.9, "nesterov": False}``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--optimizer-arg expects key=value, got {item!r}")
        out[key.strip()] = _literal(value.strip())
    return out


def parse_int_list(text: str | None, what: str) -> list[int] | None:
    """``"10,20"`` -> ``[10, 20]``."""
    if text is None or text == "":
        return None
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} expects comma-separated integers, got {text!r}") from None


def _dtype(value: Any) -> Any:
    # dtypes travel through JSON and the command line as names ("bfloat16"); the optimizer wants torch.dtype.
    if isinstance(value, str):
        dt = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dt, torch.dtype):
            return dt
        raise ValueError(f"unknown dtype {value!r}")
    return value


def optimizer_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """Keyword arguments for :func:`meqmuon.build_optimizer` (lr, weight decay, passthrough args)."""
    extra = {k: (_dtype(v) if k.endswith("dtype") and v is not None else v) for k, v in cfg.optimizer_args.items()}
    if isinstance(extra.get("betas"), list):
        extra["betas"] = tuple(extra["betas"])
    if isinstance(extra.get("ns_coefficients"), list):  # a name such as "polar_express" stays a string
        extra["ns_coefficients"] = tuple(tuple(t) if isinstance(t, list) else t for t in extra["ns_coefficients"])
    return {"lr": cfg.lr, "weight_decay": cfg.weight_decay, **extra}


def check_positive(name: str, value: Any, allow_none: bool = True) -> None:
    """``ValueError`` unless ``value`` is a positive, finite number (or ``None`` where allowed)."""
    if value is None and allow_none:
        return
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a positive, finite number, got {value!r}")


def check_out_dir(path: str | Path, flag: str = "--out") -> None:
    """``ValueError`` when ``path`` cannot be a directory because it, or a directory above it, is a file
    (``--out README.md``: ``mkdir`` would fail with a bare ``[Errno 17] File exists``)."""
    p = Path(path)
    for above in (p, *p.parents):
        if above.exists():
            if above.is_dir():
                return
            what = f"{p} is a file" if above == p else f"{above} (in {p}) is a file"
            raise ValueError(f"{flag} {what}, not a directory; choose a directory for {flag}")


def validate_config(cfg: TrainConfig) -> None:
    """Cheap checks that need no data or model: names, signs, options, the device, optional packages the
    options need. Raises ``ValueError``; called before anything is written to disk."""
    from meqmuon import valid_hyperparameters
    from meqmuon.optim.registry import spec
    from meqmuon.train.data import data_source
    from meqmuon.train.models import MODELS

    if cfg.model not in MODELS:
        raise ValueError(f"unknown model {cfg.model!r}; valid models: {', '.join(MODELS)}")
    positions = MODELS[cfg.model].max_position_embeddings
    optimizer = spec(cfg.optimizer).name  # ValueError listing the valid names
    valid = valid_hyperparameters(optimizer)
    unknown = sorted(set(cfg.optimizer_args) - set(valid))
    if unknown:
        raise ValueError(f"unknown optimizer argument(s) {unknown} for {optimizer}; valid: {', '.join(valid)}")
    for key in ("lr", "weight_decay"):
        if key in cfg.optimizer_args:
            raise ValueError(f"set {key} with --{key.replace('_', '-')}, not --optimizer-arg")
    check_positive("lr", cfg.lr)
    for name in ("tokens", "steps", "seq_len", "global_batch", "micro_batch", "eval_every", "save_every",
                 "val_tokens", "keep_checkpoints", "stop_at_step", "threads", "tp"):
        value = getattr(cfg, name)
        check_positive(name, value)
        if value is not None and not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if cfg.seq_len is not None and cfg.seq_len > positions:
        raise ValueError(f"--seq-len {cfg.seq_len} is beyond the {positions:,} positions of {cfg.model} "
                         f"(max_position_embeddings); use --seq-len {positions} or less")
    if cfg.weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {cfg.weight_decay}")
    if not 0 <= cfg.warmup_ratio < 1:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {cfg.warmup_ratio}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    check_positive("clip", cfg.clip)
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {cfg.precision!r}")
    if not isinstance(cfg.fsdp, bool):
        raise ValueError(f"fsdp must be true or false, got {cfg.fsdp!r}")
    if not isinstance(cfg.tf32, bool):
        raise ValueError(f"tf32 must be true or false, got {cfg.tf32!r}")
    if cfg.resume is not None and cfg.resume != "auto" and not Path(cfg.resume).exists():
        raise ValueError(f"--resume path does not exist: {cfg.resume}")
    check_out_dir(run_dir_of(cfg))
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package, which is not installed: "
                         "pip install tensorboard (or leave out --tensorboard)")
    check_device(cfg.device)
    data_source(None if cfg.data == "builtin" else cfg.data)  # a missing path: every rank, before any barrier
    if cfg.capture_layers is not None and not cfg.capture_steps:
        raise ValueError("--capture-layers needs --capture-steps")
    for s in cfg.capture_steps or []:
        if s <= 0:
            raise ValueError(f"capture steps are 1-based update indices, got {s}")
    if cfg.steps is not None:  # else known once the model's size is (meqmuon.train.run checks it then)
        check_steps_within(cfg.stop_at_step, cfg.capture_steps, cfg.steps)


def check_steps_within(stop_at_step: int | None, capture_steps: Sequence[int] | None, steps: int) -> None:
    """``--stop-at-step`` and ``--capture-steps`` within a run of ``steps`` updates, or a ``ValueError``: a
    stop or a capture that can never happen would otherwise pass without a word."""
    if stop_at_step is not None and stop_at_step > steps:
        raise ValueError(f"--stop-at-step {stop_at_step} is beyond the run's {steps} steps")
    late = [s for s in capture_steps or () if s > steps]
    if late:
        raise ValueError(f"--capture-steps {','.join(map(str, late))} beyond the run's {steps} steps")


def _micro_batch(global_batch: int, micro_batch: int | None, world_size: int) -> int:
    """The given or automatic micro-batch; ``ValueError`` when the batch does not divide evenly."""
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} is not divisible by the world size {world_size}")
    per_rank = global_batch // world_size
    if micro_batch is None:
        # Largest divisor of the per-rank batch up to MAX_AUTO_MICRO_BATCH: the paper's 512 x 1024 on one
        # GPU would otherwise be a single 512-sequence forward pass (hundreds of GB of logits).
        micro_batch = max(d for d in range(1, min(per_rank, MAX_AUTO_MICRO_BATCH) + 1) if per_rank % d == 0)
    if per_rank % micro_batch:
        raise ValueError(f"global batch {global_batch} is not divisible by world size {world_size} x micro "
                         f"batch {micro_batch}")
    return micro_batch


def _budget(c: TrainConfig | ResolvedConfig, unique_params: int) -> dict[str, int]:
    """``steps``, ``tokens`` (the budget actually trained), ``eval_every`` and ``save_every``."""
    from meqmuon.train.models import TOKENS_PER_PARAM

    tokens_per_step = c.global_batch * c.seq_len
    steps = c.steps
    if steps is None:
        tokens = c.tokens if c.tokens is not None else TOKENS_PER_PARAM * unique_params
        steps = max(1, math.ceil(tokens / tokens_per_step))
    return {"steps": steps, "tokens": steps * tokens_per_step,
            "eval_every": c.eval_every if c.eval_every is not None else default_eval_every(
                steps, c.val_tokens, tokens_per_step),
            "save_every": c.save_every if c.save_every is not None else max(1, steps // 10)}


def default_eval_every(steps: int, val_tokens: int, tokens_per_step: int) -> int:
    """About 20 evaluations per run, but never more than :data:`EVAL_COMPUTE_SHARE` of the training compute.

    A validation token costs one forward pass, a training token a forward and a backward pass, about
    1/3 and 1 of ``6 N`` FLOPs (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec.
    2.1), so one evaluation costs ``val_tokens / (3 tokens_per_step)`` updates and the interval is at
    least that divided by the share. The paper models' runs keep ~20 evaluations (Llama-60M: every
    110 of 2,213 updates); a 20-update ``llama-tiny`` run (an evaluation ~ 2.7 updates) evaluates
    once, at the end, instead of after every update.
    """
    cost = val_tokens / (3 * tokens_per_step)
    return max(1, steps // 20, math.ceil(cost / EVAL_COMPUTE_SHARE))


def model_run_defaults(model: str) -> dict[str, int]:
    """Default ``global_batch``, ``seq_len``, ``val_tokens`` and ``vocab_size`` of ``model``: the paper's for
    the paper models (and any other name), :data:`CPU_PRESET_DEFAULTS` for the CPU presets (``*-tiny``),
    :data:`MICRO_DEFAULTS` for ``llama-micro`` and its widths (``llama-micro-w24``, ``llama-micro-w96``)."""
    if model == "llama-micro" or model.startswith("llama-micro-w"):
        return dict(MICRO_DEFAULTS)
    return dict(CPU_PRESET_DEFAULTS if model.endswith("-tiny") or "-tiny-" in model else PAPER_RUN_DEFAULTS)


def fill_model_defaults(cfg: TrainConfig) -> TrainConfig:
    """A copy of ``cfg`` with ``global_batch``, ``seq_len``, ``val_tokens`` and ``vocab_size`` filled from
    :func:`model_run_defaults` where they are ``None``; needs only the model's name."""
    filled = {k: v for k, v in model_run_defaults(cfg.model).items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, optimizer_args=dict(cfg.optimizer_args), **filled)


def resolve_numerics(cfg: TrainConfig, device: torch.device | str, *, cpu_capability: str | None = None,
                     cuda_bf16: bool | None = None) -> TrainConfig:
    """A copy of ``cfg`` whose numerics are concrete for ``device`` (see :mod:`meqmuon.precision`).

    * ``precision``: ``"auto"`` -> ``"bf16"`` or ``"fp32"``;
    * ``optimizer_args["ns_dtype"]`` of optimizers that have one: set to the dtype Newton-Schulz will
      use (``"bfloat16"`` or ``"float32"``) when the user did not give one;
    * ``tf32``: true only where it applies (CUDA), the request kept as ``numerics["requested_tf32"]``;
    * ``numerics``: the record of the decision (what was asked, the CPU capability string, whether
      bf16 is native, TF32, the attention kernel's dtype: :func:`attention_of`), which the harness
      writes into ``config.json``.

    Writing the concrete values makes a run's ``config.json`` reproduce it on any machine and lets the
    resume check (``precision`` and ``optimizer_args`` are :data:`IDENTITY_KEYS`) refuse a checkpoint
    whose "auto" resolved differently. Idempotent. ``cpu_capability``/``cuda_bf16`` inject the report.
    """
    from meqmuon import valid_hyperparameters

    dev = torch.device(device)
    hw = dict(cpu_capability=cpu_capability, cuda_bf16=cuda_bf16)
    record = dict(cfg.numerics or {})
    record.setdefault("requested_precision", cfg.precision)
    precision = resolve_precision(cfg.precision, dev, **hw)
    args = dict(cfg.optimizer_args)
    if "ns_dtype" in valid_hyperparameters(cfg.optimizer.lower()):
        asked = args.get("ns_dtype")
        record.setdefault("requested_ns_dtype", "auto" if asked is None else str(asked).removeprefix("torch."))
        ns = resolve_ns_dtype(_dtype(asked) if asked is not None else None, dev, **hw)
        args["ns_dtype"] = str(ns).removeprefix("torch.")
    # TF32 exists only on CUDA: the config states what the run does (false elsewhere), the record what was
    # asked, so that config.json says one thing (issue 46) and a resume on CUDA can ask for it again.
    record["requested_tf32"] = bool(cfg.tf32)
    tf32 = bool(cfg.tf32 and dev.type == "cuda")
    record.update(
        device=str(dev),
        cpu_capability=_precision.detect_cpu_capability() if cpu_capability is None else cpu_capability,
        precision=precision,
        ns_dtype=args.get("ns_dtype"),
        tf32=tf32,
        attention=attention_of(precision, dev, cfg.seq_len or model_run_defaults(cfg.model)["seq_len"]),
    )
    return dataclasses.replace(cfg, precision=precision, tf32=tf32, optimizer_args=args, numerics=record)


#: Longest sequence for which a bf16 run on a CPU computes attention in float32 (:func:`attention_of`).
FLOAT32_ATTENTION_MAX_SEQ_LEN = 256


def attention_of(precision: str, device: torch.device | str, seq_len: int) -> str:
    """The model's attention (:data:`meqmuon.train.models.ATTENTIONS`) for a run's resolved precision,
    device and sequence length: ``"sdpa-float32"`` for bf16 autocast on a CPU with sequences of at most
    :data:`FLOAT32_ATTENTION_MAX_SEQ_LEN` tokens, else ``"sdpa"`` (in the autocast dtype).

    Why: the backward of the CPU flash kernel in bf16 has a large cost per (sequence, head) that
    float32's lacks: at 128 tokens (the ``*-tiny`` presets) it is ~4x slower than float32 and a third of
    a bf16 ``llama-tiny`` update; at 256 tokens still ~2x; at 512-1024 tokens with 64-dim heads (the
    paper models) bf16 is the faster one (docs/benchmarks.md, "Wall time of a 20-update `llama-tiny`
    run"). fp32 runs and CUDA keep ``"sdpa"``."""
    fast = precision == "bf16" and torch.device(device).type == "cpu" and seq_len <= FLOAT32_ATTENTION_MAX_SEQ_LEN
    return "sdpa-float32" if fast else "sdpa"


# ---- run directory: named here and nowhere else -------------------------------------------------


def run_name(optimizer: str, *, model: str | None = None, lr: float | None = None, seed: int | None = None) -> str:
    """A run directory's name, ``[<model>-]<optimizer>[-lr<lr>][-s<seed>]``: the parts that tell the
    runs of one directory apart (``compare``: optimizer, seed; ``sweep``: optimizer, lr, seed)."""
    parts = [model, optimizer, None if lr is None else f"lr{lr:g}", None if seed is None else f"s{seed}"]
    return "-".join(p for p in parts if p is not None)


def default_run_dir(cfg: TrainConfig) -> Path:
    """``runs/<model>-<optimizer>-lr<lr>-s<seed>``; an unset lr is the optimizer's default (0 if unknown)."""
    from meqmuon.optim.registry import REGISTRY

    known = REGISTRY.get(str(cfg.optimizer).lower())  # not validated yet: an unknown name fails later
    lr = cfg.lr if cfg.lr is not None else known.default_lr if known else 0.0
    return Path("runs") / run_name(cfg.optimizer, model=cfg.model, lr=lr, seed=cfg.seed)


def run_dir_of(cfg: TrainConfig) -> Path:
    """The run directory: ``cfg.out``, else the run a ``--resume PATH`` points into, else the default name."""
    if cfg.out is not None:
        return Path(cfg.out)
    if cfg.resume not in (None, "auto"):
        p = Path(cfg.resume)
        return p if p.is_dir() else p.parent.parent
    return default_run_dir(cfg)


# ---- the resolved, frozen config ------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedConfig:
    """Every setting of one run, concrete; what ``config.json`` and checkpoints store (:meth:`to_dict`).

    Built by :func:`resolve` and :meth:`for_model`, never changed. The fields are :class:`TrainConfig`'s,
    in its order (so ``config.json`` keeps its keys); containers are read-only (mappings, tuples).
    ``steps``, ``tokens``, ``eval_every``, ``save_every`` and ``data_source`` are ``None`` until
    :meth:`for_model` (they need the model's size and the data); everything else is set by :func:`resolve`.
    """

    model: str
    optimizer: str  # the registry's canonical name
    lr: float
    weight_decay: float
    optimizer_args: Mapping[str, Any]  # with the resolved ns_dtype of Muon-family optimizers
    data: str
    tokenizer: str | None
    vocab_size: int
    val_fraction: float
    val_tokens: int
    cache_dir: str | None
    tokens: int | None
    steps: int | None
    seq_len: int
    global_batch: int
    micro_batch: int
    warmup_ratio: float
    min_lr_ratio: float
    clip: float | None
    seed: int
    precision: str  # "bf16" or "fp32"
    tf32: bool
    device: str
    compile: bool
    fsdp: bool
    tp: int
    threads: int | None
    out: str  # the run directory
    eval_every: int | None
    save_every: int | None
    keep_checkpoints: int
    stop_at_step: int | None
    resume: str | None
    capture_steps: tuple[int, ...] | None
    capture_layers: tuple[int, ...] | None
    quiet: bool
    tensorboard: bool
    numerics: Mapping[str, Any]
    data_source: str | None

    @classmethod
    def of(cls, cfg: TrainConfig) -> ResolvedConfig:
        """Freeze a config whose fields are already resolved (containers become read-only)."""
        values = config_to_dict(cfg)
        for key in ("optimizer_args", "numerics"):
            values[key] = MappingProxyType(values[key] or {})
        for key in ("capture_steps", "capture_layers"):
            values[key] = None if values[key] is None else tuple(values[key])
        return cls(**values)

    def for_model(self, *, unique_params: int, data_source: str, vocab_size: int | None = None) -> ResolvedConfig:
        """Second stage: the run length (from the model's size), the data source and the vocabulary the
        model was built with (the data's tokenizer may differ from ``vocab_size``: issue 46), once they exist."""
        vocab = {} if vocab_size is None else {"vocab_size": vocab_size}
        return dataclasses.replace(self, data_source=data_source, **vocab, **_budget(self, unique_params))

    @property
    def run_dir(self) -> Path:
        return Path(self.out)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per update and rank: ``global_batch / (world_size x micro_batch)``."""
        return self.global_batch // (world_size * self.micro_batch)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict of ``config.json`` and checkpoints: plain dicts and lists, TrainConfig's keys."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("optimizer_args", "numerics"):
            out[key] = copy.deepcopy(dict(out[key]))
        for key in ("capture_steps", "capture_layers"):
            out[key] = None if out[key] is None else list(out[key])
        return out


#: Settings that ``config.json`` states as the run resolved them (what ran) and whose request it keeps in
#: ``numerics["requested_<key>"]``: the micro-batch ("auto" depends on the world size), TF32 (applies on
#: CUDA only) and the vocabulary (a tokenizer brought by the data decides it). A resume asks again as the
#: run first asked (:func:`resume_requests`), instead of inheriting a value resolved for another launch.
REQUESTED_KEYS = ("micro_batch", "tf32", "vocab_size")


def resume_requests(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's stored ``config.json`` with :data:`REQUESTED_KEYS` set back to what was asked:
    ``micro_batch`` ``"auto"`` -> ``None`` (resolved again for this world size), ``tf32`` and ``vocab_size``
    as requested. Configs written before the record are returned unchanged."""
    asked = saved.get("numerics") or {}
    out = dict(saved)
    for key in REQUESTED_KEYS:
        if f"requested_{key}" in asked:
            value = asked[f"requested_{key}"]
            out[key] = None if value == "auto" else value
    return out


def resolve(cfg: TrainConfig, *, device: torch.device | str, world_size: int) -> ResolvedConfig:
    """First stage: ``cfg`` (already checked by :func:`validate_config`) with everything that needs
    neither data nor model resolved: canonical optimizer name, lr, model defaults, micro-batch,
    numerics for ``device`` and the run directory. :meth:`ResolvedConfig.for_model` does the rest."""
    from meqmuon.optim.registry import spec

    c = fill_model_defaults(dataclasses.replace(cfg, optimizer=spec(cfg.optimizer).name))
    c = resolve_numerics(c, device)
    # The micro-batch only splits a rank's rows (the sums' order changes, not the update), and "auto"
    # depends on the world size: the request is recorded beside the value so that a resume on another
    # number of ranks resolves it again (:func:`resume_requests`) instead of inheriting a value that
    # may not divide there (issue 46).
    record = {**(c.numerics or {}), "requested_micro_batch": "auto" if c.micro_batch is None else c.micro_batch,
              "requested_vocab_size": c.vocab_size}
    c = dataclasses.replace(c, lr=c.lr if c.lr is not None else spec(c.optimizer).default_lr,
                            micro_batch=_micro_batch(c.global_batch, c.micro_batch, world_size),
                            out=str(run_dir_of(c)), numerics=record)
    return ResolvedConfig.of(c)
