"""Data pipeline: ``meqmuon prepare`` throughput, training memory on prepared sets of size N
and 8N, and the data-loading share of a ``llama-tiny`` step.

Data: C4-format files (``c4-train.NNNNN-of-NNNNN.json.gz`` with ``text``/``timestamp``/``url``) whose
documents are the built-in corpus's, shuffled and repeated (English prose and code, the kind of text a
BPE sees in C4); tokenizer: the built-in corpus's 4096-token byte-level BPE saved as a transformers
directory (``PreTrainedTokenizerFast.save_pretrained``), i.e. what ``--tokenizer DIR`` reads.

1. ``prepare`` tokens/s at 1 and 2 worker processes (fresh output directories, wall time of the
   whole command: reading, gunzip, JSON, tokenising, writing).
2. Peak RSS (``ru_maxrss`` of a child process) of ``meqmuon train --model llama-tiny`` on a prepared
   set of N tokens and one of 8N tokens, same steps.
3. Data-loading share: ``next_batch`` time over the train step time of the same run.

    PYTHONPATH=. python benchmarks/data_pipeline.py --files 16 --mb-per-file 2.5
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meqmuon.precision import detect_cpu_capability


def make_c4(root: Path, files: int, mb_per_file: float) -> int:
    """C4-format train files (and one validation file) from the built-in corpus; returns text bytes."""
    from meqmuon.train.corpus import builtin_documents

    docs = builtin_documents()
    rng = random.Random(0)
    total = 0
    (root / "en").mkdir(parents=True)
    names = [f"c4-train.{i:05d}-of-{files:05d}.json.gz" for i in range(files)]
    names.append("c4-validation.00000-of-00001.json.gz")
    for name in names:
        size = 0
        with gzip.open(root / "en" / name, "wt", encoding="utf-8", compresslevel=1) as f:
            while size < mb_per_file * 1e6:
                text = rng.choice(docs)
                f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": "https://example.org/"})
                        + "\n")
                size += len(text.encode())
        total += size
    return total


def save_tokenizer(cache: Path, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from meqmuon.train.data import build_data
    from meqmuon.train.tokenizer import EOS_TOKEN

    tok = build_data(None, seq_len=128, cache_dir=cache, val_tokens=4096).tokenizer
    PreTrainedTokenizerFast(tokenizer_object=tok._tok, eos_token=EOS_TOKEN).save_pretrained(str(out))


_WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
         "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
         "print(u.ru_maxrss, u.ru_utime + u.ru_stime, file=sys.stderr); sys.exit(r.returncode)")


def run(cmd: list[str], env: dict[str, str]) -> tuple[str, float, int, float]:
    """stdout, wall seconds, peak RSS (KiB) and CPU seconds (user + system, all its processes) of a
    child command, measured by a wrapper process whose only child it is, so that an earlier, larger
    child cannot mask its peak."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _WRAP, *cmd], env=env, check=True, capture_output=True, text=True)
    peak, cpu = r.stderr.strip().splitlines()[-1].split()
    return r.stdout, time.perf_counter() - t0, int(peak), float(cpu)


LOADER = r"""
import json, resource, sys, time
from meqmuon.train.data import build_data
b = build_data(sys.argv[1], seq_len=128, val_tokens=4096)
n = int(sys.argv[2]); t0 = time.perf_counter()
for _ in range(n):
    b.train.next_batch(32)
dt = time.perf_counter() - t0
print(json.dumps({"batch_ms": 1e3 * dt / n, "rows": b.train.num_sequences,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--mb-per-file", type=float, default=2.5)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        env = {**os.environ, "MEQMUON_CACHE": str(tmp / "cache"), "PYTHONPATH": os.getcwd()}
        text_bytes = make_c4(tmp / "c4", args.files, args.mb_per_file)
        save_tokenizer(tmp / "cache", tmp / "tok")
        print(f"data: {args.files} train files, {text_bytes / 1e6:.1f} MB of text; CPU {detect_cpu_capability()}, "
              f"{os.cpu_count()} cores, Python {platform.python_version()}")
        for workers in (1, 2):
            out, seconds, _, cpu = run([py, "-m", "meqmuon", "prepare", "--data", str(tmp / "c4"), "--tokenizer",
                                        str(tmp / "tok"), "--out", str(tmp / f"prep{workers}"), "--workers",
                                        str(workers), "--quiet"], env)
            m = json.loads(out.strip().splitlines()[-1])
            n = m["tokens"] + m["val_tokens"]
            print(f"prepare, {workers} worker(s): {n:,} tokens in {seconds:.1f} s (command wall time) = "
                  f"{n / seconds:,.0f} tokens/s; inside prepare {m['tokens_per_s']:,} tokens/s; {cpu:.1f} CPU s "
                  f"= {n / cpu:,.0f} tokens per CPU second; load average before: {os.getloadavg()[0]:.1f}")
        full = tmp / "prep2"
        n_tokens = json.loads((full / "manifest.json").read_text())["train"]["tokens"]
        small = tmp / "small"  # the first eighth of the train files, the same validation file
        c4_files = sorted((tmp / "c4" / "en").glob("c4-train.*"))[: max(1, args.files // 8)]
        out, *_ = run([py, "-m", "meqmuon", "prepare", "--data", *map(str, c4_files),
                       str(tmp / "c4" / "en" / "c4-validation.00000-of-00001.json.gz"), "--tokenizer",
                       str(tmp / "tok"), "--out", str(small), "--quiet"], env)
        small_tokens = json.loads(out.strip().splitlines()[-1])["tokens"]
        for name, d, tokens in (("N", small, small_tokens), ("8N", full, n_tokens)):
            out, *_ = run([py, "-c", LOADER, str(d), "300"], env)
            loader = json.loads(out)
            run_dir = tmp / f"run-{name}"
            _, _, peak, _ = run([py, "-m", "meqmuon", "train", "--model", "llama-tiny", "--data", str(d), "--steps",
                              str(args.steps), "--val-tokens", "4096", "--threads", "1", "--quiet", "--out",
                              str(run_dir), "--eval-every", str(args.steps)], env)
            s = json.loads((run_dir / "summary.json").read_text())
            step_ms = 1e3 * s["train_time_s"] / s["steps"]
            print(f"{name}: {tokens:,} train tokens, {loader['rows']:,} rows of 129; loader alone: peak RSS "
                  f"{loader['rss_mib']:.0f} MiB, {loader['batch_ms']:.3f} ms per 32-row batch; train llama-tiny "
                  f"{args.steps} steps: peak RSS {peak / 1024:.0f} MiB, step {step_ms:.0f} ms, data loading "
                  f"{100 * loader['batch_ms'] / step_ms:.2f} % of the step")


if __name__ == "__main__":
    main()
