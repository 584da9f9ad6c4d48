"""The ``meqmuon`` command: ``train | compare | sweep | plot | prepare`` (+ ``memory | diagnose | ablation``).

``python -m meqmuon ...`` is the same command. Every run flag maps to a :class:`TrainConfig` field
(``--global-batch`` -> ``global_batch``); flags that are not given keep the config's default, or,
when resuming, the value stored in the run's ``config.json``. Errors are one line on stderr,
``meqmuon: error: ...``, with exit status 1 (2 for command-line syntax: argparse's message on the
same one line, pointing at ``--help``). Set ``MEQMUON_DEBUG=1`` to get the traceback instead.
SIGINT/SIGTERM during a run save a checkpoint and end with one line saying how to resume, exit
status ``128 + signal`` (:mod:`meqmuon.train.preempt`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meqmuon.registry_names import registry_names

__all__ = ["build_parser", "main", "parse_count"]

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
    """``"1.16B"`` -> 1160000000, ``"500k"``, ``"2e6"``, ``"1000"``; for ``--tokens``."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)\s*", text)
    try:
        value = float(m.group(1)) * _SUFFIX.get(m.group(2).lower(), 1) if m else float("nan")
    except ValueError:
        value = float("nan")
    if value != value:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 1000, 2e6, 500M, 1.16B)")
    return int(round(value))


class _Parser(argparse.ArgumentParser):
    """argparse with errors on one line, ``meqmuon: error: ...`` like every other error (exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        msg = " ".join(message.split())
        self.exit(2, f"meqmuon: error: {msg} (see `{self.prog} --help`)\n")


_NEGATIVE = re.compile(r"-(\d|\.\d)[\d.]*([eE][-+]?\d+)?")


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--lr -1e-3`` -> ``--lr=-1e-3``: argparse takes ``-1e-3`` for an option (only ``-1`` and ``-.5``
    count as numbers there) and would print its usage; joined, the value reaches the config's check."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.fullmatch(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _csv_numbers(text: str, flag: str, kind: type) -> list[Any]:
    """A comma-separated list of numbers; a bad item is an error naming the flag and the item."""
    out = []
    for item in _csv(text):
        try:
            out.append(kind(item))
        except ValueError:
            what = "a number" if kind is float else "a whole number"
            raise ValueError(f"{flag}: {item!r} is not {what} (in {text!r}; comma-separated, e.g. "
                             f"{'1e-3,2e-3' if kind is float else '0,1,2'})") from None
    return out


def _add_run_args(p: argparse.ArgumentParser, *, compare: bool = False) -> None:
    """Flags shared by train/compare/sweep. Defaults are SUPPRESSed so that only given flags override."""
    S = argparse.SUPPRESS
    g = p.add_argument_group("run")
    g.add_argument("--config", metavar="FILE", default=S, help="JSON config (e.g. a run's config.json); flags override")
    g.add_argument("--model", default=S, help="registry name (llama-60m ... qwen2-0.5b, llama-tiny, ...)")
    if not compare:
        g.add_argument("--optimizer", default=S, help=", ".join(registry_names().names))
        g.add_argument("--lr", type=float, default=S, help="peak learning rate (default: per optimizer)")
    g.add_argument("--weight-decay", type=float, default=S, help="decoupled weight decay (0.1)")
    g.add_argument("--optimizer-arg", action="append", metavar="KEY=VALUE", default=S,
                   help="extra optimizer keyword, validated by build_optimizer (repeatable)")
    g.add_argument("--data", default=S, help="builtin (offline), c4 (streamed from the hub), a directory written by "
                   "`meqmuon prepare`, a local C4 copy (c4-train.*.json.gz, c4-validation.*), or a .jsonl/.txt "
                   "file or directory")
    g.add_argument("--tokenizer", default=S, help="HF tokenizer id or save_pretrained directory; default: the "
                   "model's own for c4, a prepared directory's own, else the built-in BPE")
    g.add_argument("--vocab-size", type=int, default=S, help="built-in BPE vocabulary (4096; llama-micro 1280)")
    g.add_argument("--val-tokens", type=parse_count, default=S,
                   help="validation targets (per model: 1M, *-tiny 32768; fewer if less text)")
    g.add_argument("--cache-dir", default=S, help="data cache (default $MEQMUON_CACHE or ~/.cache/meqmuon)")
    g.add_argument("--tokens", type=parse_count, default=S,
                   help="training tokens (default " + ("the demo's 100 updates" if compare else "20 x unique params")
                   + ")")
    g.add_argument("--steps", type=int, default=S, help="optimizer updates (overrides --tokens)"
                   + ("; default 100, the demo's" if compare else ""))
    g.add_argument("--seq-len", type=int, default=S, help="tokens per sequence (per model: 1024, *-tiny 128)")
    g.add_argument("--global-batch", type=int, default=S,
                   help="sequences per update over all ranks (per model: 512, *-tiny 32)")
    g.add_argument("--micro-batch", type=int, default=S, help="sequences per forward per rank (default: all)")
    g.add_argument("--warmup-ratio", type=float, default=S, help="linear warmup share of updates (0.05)")
    g.add_argument("--min-lr-ratio", type=float, default=S, help="cosine decays to this fraction of the lr (0)")
    g.add_argument("--clip", type=float, default=S, help="clip the global grad norm to this value (default: off)")
    g.add_argument("--seed", type=int, default=S, help="init, data order and RNG seed (0)")
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"], default=S,
                   help="auto (default): bf16 autocast where the device runs bf16 natively, else fp32")
    g.add_argument("--no-tf32", dest="tf32", action="store_false", default=S,
                   help="CUDA: keep float32 matmuls in full float32 (default: TF32)")
    g.add_argument("--device", default=S, help="auto (cuda:LOCAL_RANK if available), cpu, cuda:0, ...")
    g.add_argument("--compile", action="store_true", default=S, help="torch.compile the model")
    g.add_argument("--fsdp", action="store_true", default=S,
                   help="FSDP2 (fully_shard) per decoder layer over the data-parallel ranks (torchrun)")
    g.add_argument("--tp", type=int, default=S, metavar="N",
                   help="tensor parallelism over N ranks (torchtitan's plan); world size = N x data-parallel ranks")
    g.add_argument("--threads", type=int, default=S,
                   help="CPU threads for the run (default 1 on CPU: 2+ threads stall when other jobs share the "
                        "cores; more are faster on idle cores)")
    g.add_argument("--out", default=S, help="run directory" + (" for all runs" if compare else ""))
    g.add_argument("--eval-every", type=int, default=S,
                   help="evaluate every N updates (and at the end); default: ~20 evaluations per run, fewer "
                   "where they would take over 10 %% of the training compute")
    g.add_argument("--save-every", type=int, default=S, help="checkpoint every N updates (default ~10 per run)")
    g.add_argument("--keep-checkpoints", type=int, default=S, help="checkpoints kept per run (2)")
    g.add_argument("--quiet", action="store_true", default=S, help="no progress bar or log lines")
    g.add_argument("--tensorboard", action="store_true", default=S, help="also log to <run>/tensorboard")
    if not compare:
        g.add_argument("--stop-at-step", type=int, default=S, help="save and exit after this update")
        g.add_argument("--resume", default=S, metavar="auto|PATH", help="continue the latest checkpoint of the run")
        g.add_argument("--capture-steps", default=S, help="comma-separated updates to capture optimizer inputs at")
        g.add_argument("--capture-layers", default=S, help="comma-separated layer indices to capture (default all)")


_NOT_CONFIG = {"command", "func", "config", "optimizers", "lr_overrides", "lrs", "seeds", "finished_only", "files",
               "metric", "title"}


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from meqmuon.train.config import parse_int_list, parse_optimizer_args

    d = {k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}
    if "optimizer_arg" in d:
        d["optimizer_args"] = parse_optimizer_args(d.pop("optimizer_arg"))
    for key in ("capture_steps", "capture_layers"):
        if key in d:
            d[key] = parse_int_list(d[key], "--" + key.replace("_", "-"))
    return d


def _base_dict(args: argparse.Namespace) -> dict[str, Any]:
    from meqmuon.train.config import load_config_file

    return load_config_file(args.config) if "config" in args else {}


def _cmd_train(args: argparse.Namespace) -> int:
    from meqmuon.train.checkpoint import list_checkpoints
    from meqmuon.train.config import (
        IDENTITY_KEYS,
        config_from_dict,
        load_config_file,
        resume_requests,
        run_dir_of,
        validate_config,
    )
    from meqmuon.train.loop import train

    over = _overrides(args)
    d = {**_base_dict(args), **over}
    if d.get("resume"):
        # Resuming: start from the run's own resolved config so a bare `--resume auto --out DIR` suffices.
        run_dir = run_dir_of(config_from_dict(d))
        saved_path = run_dir / "config.json"
        if saved_path.is_file():
            # micro-batch, TF32 and vocabulary as first asked (an "auto" micro-batch resolves again for this
            # world size), and the layout is per invocation too: a run resumes on whatever ranks and flags
            # it is given
            saved = resume_requests(load_config_file(saved_path))
            for per_invocation in ("stop_at_step", "resume", "quiet", "out", "fsdp", "tp"):
                saved.pop(per_invocation, None)
            d = {**saved, **_base_dict(args), **over}
        if d["resume"] == "auto" and not list_checkpoints(run_dir):
            validate_config(config_from_dict(d))  # bad input: its one error line, not a note before it
            # the run's settings: what defines its trajectory, and its length
            described = "config" in args or any(k in over for k in (*IDENTITY_KEYS, "tokens"))
            _resume_auto_without_checkpoint(run_dir, started=saved_path.is_file(), described=described)
    summary = train(config_from_dict(d))
    if summary.get("finished") and os.environ.get("RANK", "0") == "0":  # one line, from rank 0 under torchrun
        keys = ("val_loss", "val_ppl", "val_bpb", "tokens", "tokens_per_s", "optimizer_state_mib", "run_dir")
        print(json.dumps({k: summary[k] for k in keys}))
    return 0


def _resume_auto_without_checkpoint(run_dir: Path, *, started: bool, described: bool) -> None:
    """``--resume auto`` where ``run_dir`` holds no checkpoint: the first launch of a job script that always
    passes it, or a mistyped ``--out`` (docs/training.md, ``--resume``). Returns where a run starts (with one
    note line), raises ``ValueError`` where the command names no run to start:

    * ``run_dir`` holds a run that stopped before its first checkpoint (its ``config.json``): it starts
      again from step 0, with its own settings;
    * ``run_dir`` holds run directories (``--out runs``): an error naming them;
    * the command gives the run's settings (``described``: a flag of
      :data:`~meqmuon.train.config.IDENTITY_KEYS`, ``--tokens`` or ``--config``), as a job script does: the
      run starts there;
    * only ``--out`` (and flags that do not change a run), as in the line a stopped run prints: an error
      naming the run directories nearest to ``run_dir``, since a run of defaults is not what it asks for.
    """
    say = int(os.environ.get("RANK", "0")) == 0  # one note for the job; every rank raises the same error
    if started:
        if say:
            print(f"meqmuon: note: --resume auto found no checkpoint in {run_dir} (the run stopped before its "
                  "first one); starting it again from step 0", file=sys.stderr)
        return
    inside = _run_dirs(run_dir)
    if inside:
        raise ValueError(f"--resume auto: {run_dir} is not a run but holds run directories "
                         f"({_listed(inside)}); give one of them to --out")
    if not described:
        raise ValueError(f"--resume auto: {run_dir} {'holds no run' if run_dir.exists() else 'does not exist'}"
                         f"{_nearest_runs(run_dir)}; to start a new run there, give its settings (--model, "
                         "--optimizer, ... or --config)")
    if say:
        print(f"meqmuon: note: --resume auto found no checkpoint in {run_dir}; starting a new run there",
              file=sys.stderr)


def _run_dirs(folder: Path) -> list[Path]:
    """The run directories (those with a ``config.json``) directly in ``folder``, by name."""
    return sorted(p for p in folder.iterdir() if (p / "config.json").is_file()) if folder.is_dir() else []


def _listed(paths: list[Path], most: int = 3) -> str:
    return ", ".join(str(p) for p in paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def _nearest_runs(run_dir: Path) -> str:
    """``"; nearest run directories: A, B"``: the runs beside ``run_dir`` whose names are closest to its
    (``difflib``'s ratio >= 0.6), else the runs there, else that there are none."""
    import difflib

    parent = run_dir.parent
    if not parent.is_dir():
        return f" (nor does {parent})"
    runs = _run_dirs(parent)
    if not runs:
        return f" (no run directory beside it in {parent})"
    close = difflib.get_close_matches(run_dir.name, [p.name for p in runs], n=3, cutoff=0.6)
    if close:
        return f"; nearest run director{'y' if len(close) == 1 else 'ies'}: {_listed([parent / c for c in close])}"
    return f"; run directories beside it: {_listed(runs)}"


def _compare_lrs(items: list[str] | None) -> dict[str, float]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            lr = float(value)
        except ValueError:
            lr = float("nan")
        if not sep or not name or not lr > 0 or lr == float("inf"):
            raise ValueError(f"--lr expects NAME=VALUE with a positive, finite VALUE, got {item!r}")
        out[name.strip().lower()] = lr
    return out


def _check_optimizers(names: list[str]) -> list[str]:
    from meqmuon.optim.registry import REGISTRY

    names = [n.lower() for n in names]
    bad = [n for n in names if n not in REGISTRY]
    if bad:
        raise ValueError(f"unknown optimizer(s) {bad}; valid optimizers: {', '.join(REGISTRY)}")
    return names


def _seed_count(text: str) -> int:
    """``--seeds N`` of ``compare``: a whole number >= 1 (argparse turns the error into exit status 2)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of seeds >= 1, got {text!r}")
    return n


def _cmd_compare(args: argparse.Namespace) -> int:
    from meqmuon.optim.registry import DEMO_NAMES
    from meqmuon.train.compare import demo_config, format_compare_seeds_table, format_table, run_compare
    from meqmuon.train.config import config_from_dict, config_to_dict, validate_config

    optimizers = _check_optimizers(_csv(args.optimizers) if args.optimizers else list(DEMO_NAMES))
    lrs = _compare_lrs(args.lr_overrides)
    over = _overrides(args)
    if args.seeds > 1 and "seed" in over:
        raise ValueError(f"--seed {over['seed']} and --seeds {args.seeds} together: --seeds N runs seeds "
                         f"0..{args.seeds - 1}; give one of the two")
    seeds = list(range(args.seeds)) if args.seeds > 1 else None
    out = Path(over.pop("out", "runs/compare"))
    base = config_from_dict({**config_to_dict(demo_config()), **_base_dict(args), **over})
    validate_config(base)  # fail before the first run, not after it
    rows = run_compare(optimizers, lrs, base, out, seeds=seeds)
    print(format_table(rows) if seeds is None else format_compare_seeds_table(rows))
    print(f"\n(table: {out / 'table.md'}, plot: {out / 'val_ppl.png'})")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from meqmuon.train.compare import demo_config, run_sweep
    from meqmuon.train.config import config_from_dict, config_to_dict, validate_config

    optimizers = _check_optimizers(_csv(args.optimizers))
    lrs = _csv_numbers(args.lrs, "--lrs", float)
    seeds = _csv_numbers(args.seeds, "--seeds", int)
    over = _overrides(args)
    out = Path(over.pop("out", "runs/sweep"))
    base = config_from_dict({**config_to_dict(demo_config()), **_base_dict(args), **over})
    validate_config(base)
    run_sweep(optimizers, lrs, seeds, base, out, finished_only=args.finished_only)
    print((out / "sweep.md").read_text().rstrip("\n"))
    print(f"\n(table: {out / 'sweep.md'}, plot: {out / 'val_ppl.png'})")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from meqmuon.train.plot import METRICS, default_output, default_title, plot_runs

    if args.metric not in METRICS:
        raise ValueError(f"unknown metric {args.metric!r}; valid: {', '.join(METRICS)}")
    out = args.out if args.out is not None else default_output(args.files, args.metric)
    title = args.title if args.title is not None else default_title(args.files, args.metric)
    path = plot_runs(args.files, out, metric=args.metric, title=title)
    print(path)
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from meqmuon.train.prepare import prepare
    from meqmuon.train.shards import MANIFEST

    out = Path(args.out)
    was_complete = (out / MANIFEST).is_file()
    builtin = args.tokenizer is not None and args.tokenizer.lower() == "builtin"
    if [d.lower() for d in args.data] == ["pysrc"]:  # the named corpus: its own files, the built-in BPE by default
        from meqmuon.train.data import cache_root
        from meqmuon.train.pysrc import prepare_pysrc

        m = prepare_pysrc(out, cache=cache_root(args.cache_dir), tokenizer_name=None if builtin else args.tokenizer,
                          vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                          progress=not args.quiet, announce=not args.quiet)[0].manifest
    elif args.tokenizer is None:
        raise ValueError("prepare --data PATH... needs --tokenizer: a hub id, a save_pretrained directory, or "
                         "builtin (a byte-level BPE trained on the files' train documents, offline)")
    else:
        tokenizer: Any = args.tokenizer
        if builtin:  # trained on the files (or reused from the data cache), as `train --data PATHS` does
            from meqmuon.train.data import local_bpe

            tokenizer = local_bpe(args.data, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                                  cache_dir=args.cache_dir, announce=not args.quiet)
        m = prepare(args.data, tokenizer, out, val_fraction=args.val_fraction, val_tokens=args.val_tokens,
                    workers=args.workers, max_tokens=args.max_tokens, chunk_bytes=int(args.chunk_mb * 2**20),
                    progress=not args.quiet)
    if was_complete and not args.quiet:
        print(f"meqmuon: {out} was already complete with these sources and tokenizer; nothing to do",
              file=sys.stderr)
    tr, va = m["train"], m["validation"]
    print(json.dumps({"out": str(out), "kind": m["kind"], "shards": len(tr["shards"]), "documents": tr["documents"],
                      "tokens": tr["tokens"], "val_documents": va["documents"], "val_tokens": va["tokens"],
                      "dtype": m["dtype"], "tokenizer": m["tokenizer"]["fingerprint"], "workers": m["workers"],
                      "seconds": m["seconds"], "tokens_per_s": round((tr["tokens"] + va["tokens"]) / m["seconds"])}))
    return 0


def _add_prepare_parser(sub: Any) -> None:
    from meqmuon.train.prepare import DEFAULT_CHUNK_BYTES, DEFAULT_VAL_TOKENS

    p = sub.add_parser("prepare", help="tokenise local text into memory-mapped token shards for `train --data DIR`",
                       description="Tokenise .jsonl/.json/.txt files (optionally .gz; a local C4 copy included) on "
                                   "all cores into memory-mapped token shards with a manifest. Resumable: rerun the "
                                   "same command after an interruption. Example: meqmuon prepare --data c4/en "
                                   "--tokenizer t5-base --out data/c4-t5 --max-tokens 1.2B")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH",
                   help="files and directories, or pysrc (the Python-sources corpus, ~44M tokens)")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_DIR",
                   help="HF hub id, save_pretrained directory, or builtin: a byte-level BPE trained on the train "
                        "documents (offline; cached, shared with `train --data PATHS`); required but for pysrc, "
                        "whose default is builtin")
    p.add_argument("--vocab-size", type=int, default=4096, help="built-in BPE vocabulary (4096)")
    p.add_argument("--cache-dir", default=None,
                   help="where the built-in BPE is cached (default ~/.cache/meqmuon or $MEQMUON_CACHE)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (new, or an unfinished preparation)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of documents held out for validation (0.05; C4 uses its validation files)")
    p.add_argument("--val-tokens", type=parse_count, default=DEFAULT_VAL_TOKENS,
                   help=f"validation tokens kept, whole documents ({DEFAULT_VAL_TOKENS:,})")
    p.add_argument("--max-tokens", type=parse_count, default=None,
                   help="stop after the first shards (source order) holding this many train tokens (e.g. 1.2B)")
    p.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20,
                   help="uncompressed .jsonl files are split into tasks of about this many MB "
                        f"({DEFAULT_CHUNK_BYTES >> 20})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_prepare)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``meqmuon`` (diagnostics subcommands added when that package is present).

    Building it imports no torch (nor any other heavy package): ``--help`` and argparse's errors answer
    in a fraction of a second; the commands import what they need when they run."""
    parser = _Parser(prog="meqmuon", description="MeqMuon pretraining harness")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("train", help="train one model with one optimizer",
                       description="Train one run. Example: meqmuon train --model llama-60m --optimizer meqmuon "
                                   "--lr 2e-3 --data c4. Ctrl-C or SIGTERM finishes the current update, saves a "
                                   "checkpoint and exits (status 130/143); --resume auto --out DIR continues it.")
    _add_run_args(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("compare", help="offline demo: the same tiny run with several optimizers",
                       description="Same model, initial weights, data order and validation set for every optimizer; "
                                   "prints and saves a markdown table and a perplexity plot. With --seeds N: "
                                   "every optimizer for seeds 0..N-1, then per optimizer the mean final "
                                   "validation loss, its 95 % Student-t interval and the paired difference "
                                   "against meqmuon on the same seeds; the plot shows mean curves with a "
                                   "min-max band.")
    p.add_argument("--optimizers", default=None, help=f"comma-separated (default {','.join(registry_names().demo)})")
    p.add_argument("--lr", dest="lr_overrides", action="append", metavar="NAME=VALUE", default=None,
                   help="per-optimizer lr override, e.g. --lr meqmuon=2e-2 (repeatable)")
    p.add_argument("--seeds", type=_seed_count, default=1, metavar="N",
                   help="run seeds 0..N-1 (run dirs <out>/<optimizer>-s<seed>) and report mean, 95%% interval "
                        "and paired difference vs meqmuon (default 1: one run per optimizer at --seed, "
                        "dirs <out>/<optimizer>)")
    _add_run_args(p, compare=True)
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("sweep", help="grid over optimizers x learning rates x seeds",
                       description="Trains every optimizer x lr x seed; sweep.md reports per optimizer at its best "
                                   "lr (lowest mean final validation loss over seeds) the mean, its 95 % "
                                   "Student-t interval and the paired difference against meqmuon on the same "
                                   "seeds, then every optimizer x lr cell; val_ppl.png shows mean curves with "
                                   "a min-max band over seeds.")
    p.add_argument("--optimizers", required=True, help="comma-separated optimizer names")
    p.add_argument("--lrs", required=True, help="comma-separated learning rates")
    p.add_argument("--seeds", default="0", help="comma-separated distinct seeds >= 0 (0)")
    p.add_argument("--finished-only", action="store_true",
                   help="train nothing: tabulate the grid's finished runs and list the missing ones")
    _add_run_args(p, compare=True)
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser("plot", help="plot metrics.jsonl files against tokens",
                       description="One curve per run against training tokens. Example, after the demo: "
                                   "meqmuon plot runs/compare/*/metrics.jsonl (or: meqmuon plot runs/compare)")
    p.add_argument("files", nargs="+", help="metrics.jsonl files, run directories, or directories of runs")
    p.add_argument("--out", default=None, help="PNG path (default: <run>/<metric>.png for one run, else "
                   "<common directory>/<metric>-<run names>.png)")
    p.add_argument("--metric", default="val_ppl", help="val_ppl (default), val_loss, val_bpb or loss (train)")
    p.add_argument("--title", default=None, help="default: the runs' model, the metric and their directory")
    p.set_defaults(func=_cmd_plot)

    _add_prepare_parser(sub)

    try:
        from meqmuon.diagnostics import cli as diagnostics_cli
    except ModuleNotFoundError as e:
        if e.name not in ("meqmuon.diagnostics", "meqmuon.diagnostics.cli"):
            raise
    else:
        diagnostics_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``meqmuon``; returns the exit status (argparse errors raise ``SystemExit(2)``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(_join_negative_values(argv))
    # after parsing: --help and argparse's errors end above, without torch (these modules import it)
    from meqmuon.train.checkpoint import CheckpointError
    from meqmuon.train.config import check_out_dir
    from meqmuon.train.loop import TrainingDiverged
    from meqmuon.train.preempt import RunInterrupted

    try:
        if args.command != "plot" and getattr(args, "out", None) is not None:
            check_out_dir(args.out)  # every command's --out is a directory (plot's is the PNG file)
        return int(args.func(args) or 0)
    except RunInterrupted as e:
        if int(os.environ.get("RANK", "0")) == 0:  # one line for the job, not one per rank
            print(f"meqmuon: {e}; resume with: {_resume_command(args, argv, e)}", file=sys.stderr)
        return e.exit_status
    except (ValueError, TypeError, CheckpointError, TrainingDiverged, RuntimeError, OSError) as e:
        if os.environ.get("MEQMUON_DEBUG"):
            raise
        line = _error_line(e, int(os.environ.get("RANK", "0")))
        if line:
            print(line, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("meqmuon: interrupted", file=sys.stderr)
        return 130


def _error_line(e: BaseException, rank: int) -> str | None:
    """The one ``meqmuon: error:`` line of ``e``, or ``None`` where this rank stays silent under torchrun.

    Every rank checks the same input the same way, so an input error (``ValueError``, ``TypeError``,
    ``CheckpointError``) or a divergence (the loss is all-reduced) is the same line on every rank: rank 0
    alone prints it. An error raised inside ``torch.distributed`` on another rank is the echo of a peer
    that stopped (rank 0 failing while the others wait in a barrier: gloo's "Connection reset by
    peer"): silent, rank 0 says why. Anything else may be this rank's own: printed with its rank.
    """
    from meqmuon.train.checkpoint import CheckpointError
    from meqmuon.train.loop import TrainingDiverged

    msg = " ".join(str(e).split()) or type(e).__name__
    if rank == 0:
        return f"meqmuon: error: {msg}"
    if isinstance(e, ValueError | TypeError | CheckpointError | TrainingDiverged) or _raised_in_torch_distributed(e):
        return None
    return f"meqmuon: error: rank {rank}: {msg}"


def _raised_in_torch_distributed(e: BaseException) -> bool:
    """Whether ``e`` came out of ``torch.distributed`` (a collective, a store, DCP): a frame of its traceback
    runs there."""
    import torch.distributed

    if isinstance(e, torch.distributed.DistError):
        return True
    home = Path(torch.distributed.__file__).resolve().parent
    tb = e.__traceback__
    while tb is not None:
        if home in Path(tb.tb_frame.f_code.co_filename).resolve().parents:
            return True
        tb = tb.tb_next
    return False


def _resume_command(args: argparse.Namespace, argv: list[str], stop: Any) -> str:
    """How to continue a stopped run: ``train`` from the run's own config, ``compare``/``sweep`` by
    running the same command again (finished runs are reused, the stopped one resumes with ``auto``)."""
    launcher = "torchrun ... -m meqmuon" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "meqmuon"
    if args.command == "train":
        # --threads is stored in config.json and reused, but is shown so the line says how the run continues.
        threads = f" --threads {args.threads}" if getattr(args, "threads", None) is not None else ""
        return f"{launcher} train --out {shlex.quote(str(stop.run_dir))} --resume auto{threads}"
    return f"{launcher} {shlex.join(argv)}"


def _entry() -> None:  # pragma: no cover - exercised through subprocesses
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo processes sometimes abort in their atexit handlers after finishing; leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
