"""Training throughput of ``meqmuon train`` against a bare PyTorch loop on the same model and batch.

Both sides: the same registry model and initial weights, the same packed batches from the same data
stream, the same autocast (``--precision``, default ``auto``: bf16 where the CPU runs it natively,
fp32 elsewhere) with fp32 weights, the same optimizer (``build_optimizer``), one micro-batch
per update. The bare loop is forward, cross-entropy, backward, ``opt.step()``, ``zero_grad``: no
gradient norm, no NaN check, no logging, no scheduler. The harness's number is its own
``train_time_s`` (evaluation and checkpointing excluded: both happen only once, at the end).
Runs alternate (harness, bare, harness, bare, ...) and medians are reported.

    PYTHONPATH=. python benchmarks/train_throughput.py --model llama-tiny --steps 40 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

import meqmuon
from meqmuon.precision import detect_cpu_capability, resolve_precision
from meqmuon.train.config import TrainConfig
from meqmuon.train.data import build_data, split_batch
from meqmuon.train.loop import train
from meqmuon.train.models import build_model


def harness_tokens_per_s(args: argparse.Namespace, out: Path, cache: Path) -> float:
    cfg = TrainConfig(model=args.model, optimizer=args.optimizer, lr=args.lr, steps=args.steps, seq_len=args.seq_len,
                      global_batch=args.batch, micro_batch=args.batch, eval_every=args.steps, save_every=args.steps,
                      val_tokens=4096, cache_dir=str(cache), out=str(out), quiet=True, seed=0,
                      precision=args.precision)
    summary = train(cfg)
    return summary["tokens"] / summary["train_time_s"]


def bare_tokens_per_s(args: argparse.Namespace, cache: Path) -> float:
    data = build_data(None, seq_len=args.seq_len, seed=0, cache_dir=cache, val_tokens=4096)
    model = build_model(args.model, vocab_size=data.tokenizer.vocab_size, seed=0)
    opt = meqmuon.build_optimizer(args.optimizer, model, lr=args.lr)
    model.train()
    start = time.perf_counter()
    for _ in range(args.steps):
        inputs, targets = split_batch(data.train.next_batch(args.batch))
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()
        with amp:
            logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return args.steps * args.batch * args.seq_len / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--optimizer", default="meqmuon")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    args = ap.parse_args()
    args.precision = resolve_precision(args.precision, "cpu")
    harness, bare = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        bare_tokens_per_s(argparse.Namespace(**{**vars(args), "steps": 2}), cache)  # build + cache the data
        for r in range(args.repeats):
            harness.append(harness_tokens_per_s(args, Path(tmp) / f"run{r}", cache))
            bare.append(bare_tokens_per_s(args, cache))
    h, b = statistics.median(harness), statistics.median(bare)
    print(f"### Training throughput, {args.model}, {args.optimizer}, {args.batch} x {args.seq_len} tokens per update\n")
    print(f"- date {date.today()}, machine: {platform.machine()}, CPU capability {detect_cpu_capability()}, "
          f"{torch.get_num_threads()} thread"
          f"{'s' * (torch.get_num_threads() != 1)}, torch {torch.__version__}, precision {args.precision}")
    print(f"- command: `python benchmarks/train_throughput.py --model {args.model} --optimizer {args.optimizer} "
          f"--steps {args.steps} --repeats {args.repeats}`\n")
    print("| loop | median tokens/s | runs | / bare |")
    print("|---|---:|---|---:|")
    print(f"| bare PyTorch | {b:,.0f} | {', '.join(f'{x:,.0f}' for x in bare)} | 1.00 |")
    print(f"| meqmuon train | {h:,.0f} | {', '.join(f'{x:,.0f}' for x in harness)} | {h / b:.2f} |")


if __name__ == "__main__":
    main()
