"""Writing prepared data (``meqmuon prepare``): local files tokenised in parallel into token shards.

The directory layout and the reader are in :mod:`meqmuon.train.shards`.

Token stream
    Each document is tokenised without special tokens and followed by EOS. Shard ``k`` holds the
    documents of task ``k`` in source order and the train stream is the concatenation of the
    shards in manifest order, so it equals :func:`meqmuon.train.data.pack_documents` of all train
    documents in source order: sharding never changes the stream, only how it is stored.

Tasks (one shard each; run in parallel)
    One task per source file; an uncompressed ``.jsonl``/``.json`` file larger than ``chunk_bytes``
    is cut into byte ranges of about that size (a line belongs to the range its first byte is in),
    so one big file still uses every core. ``.gz`` and ``.txt`` files are one task each (a gzip
    stream cannot be entered in the middle). C4's files (~320 MB of text each) are one task each.

Train/validation split (manifest ``validation.split``)
    ``hash``: plain local files and the built-in corpus; a document is held out when
    :func:`meqmuon.train.corpus.is_validation` says so (5 %), and the held-out documents, in source
    order, form the validation stream. ``c4``: the ``c4-train.*`` files are the train split and the
    first documents of the ``c4-validation.*`` files (in file order) the validation stream, as with
    C4 from the hub. ``val_tokens`` caps the stored validation stream at whole documents once it
    holds that many tokens (``None``: no cap); held-out documents past the cap are dropped.

Resume and atomicity
    Shards are written to ``NAME.tmp`` and renamed; a rerun with the same plan skips every shard
    that has its record. The manifest is written (atomically) only after every shard and the
    validation stream, so an interrupted or failed prepare (bad input, full disk) leaves a
    directory that training refuses and that a rerun completes.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meqmuon.train import corpus as _corpus
from meqmuon.train.shards import FORMAT, MANIFEST, PLAN, VERSION, read_json, token_dtype
from meqmuon.train.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_VAL_TOKENS", "prepare", "prepare_documents"]

#: Uncompressed .jsonl/.json files are cut into tasks of about this many bytes (~30M tokens each).
DEFAULT_CHUNK_BYTES = 128 << 20
#: Validation tokens ``meqmuon prepare`` keeps by default: twice the paper's 1M validation tokens.
DEFAULT_VAL_TOKENS = 2_000_000
_ENCODE_CHUNK = 256  # documents per encode_batch call


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"writing {path}: {e.strerror}") from None


@dataclass(frozen=True)
class _Task:
    index: int
    path: str  # "" for the in-memory documents of prepare_documents
    start: int = 0
    end: int | None = None
    hash_split: bool = True  # held-out documents (is_validation) go to this task's validation part


class _Writer:
    """Appends packed documents to ``path`` through a temporary file; :meth:`commit` renames it."""

    def __init__(self, path: Path, dtype: np.dtype, eos_id: int, per_doc: bool = False):
        self.path, self.dtype, self.eos_id = path, dtype, eos_id
        self.tmp = path.with_name(path.name + ".tmp")
        self.f = open(self.tmp, "wb")
        self.documents = self.tokens = self.bytes = 0
        self.per_doc: list[tuple[int, int]] | None = [] if per_doc else None

    def add(self, texts: Sequence[str], ids: Sequence[Sequence[int]]) -> None:
        if not texts:
            return
        lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint32, count=int(lens.sum()))
        if self.dtype.itemsize == 2 and flat.size and int(flat.max()) >= 1 << 16:
            raise ValueError(f"token id {int(flat.max())} does not fit uint16; the tokenizer's vocab_size is wrong")
        packed = np.insert(flat, np.cumsum(lens), self.eos_id).astype(self.dtype)
        nbytes = [len(t.encode("utf-8")) for t in texts]
        self._write(packed.tobytes())
        self.documents += len(texts)
        self.tokens += packed.size
        self.bytes += sum(nbytes)
        if self.per_doc is not None:
            self.per_doc.extend(zip((lens + 1).tolist(), nbytes, strict=True))

    def _write(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError as e:
            raise OSError(e.errno, f"writing {self.tmp}: {e.strerror}") from None

    def commit(self) -> None:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            if self.per_doc is not None:
                idx = self.path.with_suffix(".npy")
                tmp = idx.with_name(idx.name + ".tmp")
                with open(tmp, "wb") as f:
                    np.save(f, np.array(self.per_doc, dtype=np.int64).reshape(-1, 2))
                os.replace(tmp, idx)
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise OSError(e.errno, f"writing {self.tmp}: {e.strerror}") from None

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


_W: dict[str, Any] = {}  # per-process state of the task runner (tokenizer, output directory, options)


def _init_worker(tokenizer: TextTokenizer | str, out: str, dtype: str, val_fraction: float,
                 docs: Sequence[str] | None, single_threaded: bool) -> None:
    if single_threaded:  # see _runner
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    _W.update(tok=tok, out=Path(out), dtype=np.dtype(dtype), val_fraction=val_fraction, docs=docs)


def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(it)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def _run_task(task: _Task) -> dict[str, Any]:
    tok: TextTokenizer = _W["tok"]
    out: Path = _W["out"]
    docs = _W["docs"] if task.path == "" else _corpus.iter_file_documents(task.path, start=task.start, end=task.end)
    name = f"train-{task.index:05d}"
    train = _Writer(out / f"{name}.bin", _W["dtype"], tok.eos_id)
    val = _Writer(out / f"val-part-{task.index:05d}.bin", _W["dtype"], tok.eos_id, per_doc=True) \
        if task.hash_split else None
    try:
        for chunk in _batched(docs, _ENCODE_CHUNK):
            ids = tok.encode_batch(chunk)
            if val is None:
                train.add(chunk, ids)
                continue
            held = [_corpus.is_validation(t, _W["val_fraction"]) for t in chunk]
            for w, side in ((train, False), (val, True)):
                pick = [i for i, h in enumerate(held) if h is side]
                w.add([chunk[i] for i in pick], [ids[i] for i in pick])
        train.commit()
        if val is not None:
            val.commit()
    except BaseException:
        train.abort()
        if val is not None:
            val.abort()
        raise
    rec = {"file": f"{name}.bin", "source": task.path, "start": task.start, "end": task.end,
           "documents": train.documents, "tokens": train.tokens, "bytes": train.bytes,
           "val_documents": val.documents if val else 0, "val_tokens": val.tokens if val else 0}
    _atomic_write_text(out / f"{name}.json", json.dumps(rec) + "\n")
    return rec


def _source_stats(files: Sequence[Path]) -> list[dict[str, Any]]:
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _file_tasks(files: Sequence[Path], chunk_bytes: int, hash_split: bool) -> list[_Task]:
    tasks: list[_Task] = []
    for f in files:
        size = f.stat().st_size
        if size == 0:
            raise ValueError(f"data file is empty: {f}")
        name = f.name.lower()
        if name.endswith(".gz") or name.endswith(".txt") or size <= chunk_bytes:
            tasks.append(_Task(len(tasks), str(f), hash_split=hash_split))
            continue
        n = math.ceil(size / chunk_bytes)
        bounds = [round(i * size / n) for i in range(n + 1)]
        for lo, hi in itertools.pairwise(bounds):
            tasks.append(_Task(len(tasks), str(f), lo, hi if hi < size else None, hash_split=hash_split))
    return tasks


def prepare(paths: str | Path | Sequence[str | Path], tokenizer: TextTokenizer | str, out: str | Path, *,
            val_fraction: float = 0.05, val_tokens: int | None = DEFAULT_VAL_TOKENS, workers: int | None = None,
            max_tokens: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            progress: bool = True) -> dict[str, Any]:
    """Tokenise local files into a prepared directory ``out`` (``meqmuon prepare``); returns the manifest.

    ``paths``: files and directories (``.jsonl/.json/.txt`` and ``.gz``). When every file has one of
    C4's names the train/validation split is C4's (see the module docstring), else ``hash`` with
    ``val_fraction``. ``tokenizer``: a tokenizer, hub id or directory. ``workers``: processes
    (default: every core). ``max_tokens``: stop after the first shards (in source order) that hold
    at least this many train tokens. A rerun of the same command resumes; an ``out`` holding
    another preparation is an error.
    """
    files = _corpus.expand_paths(paths)
    c4 = _corpus.c4_split(files)
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    if c4 is not None:
        train_files = [Path(f) for f in c4["train"]]
        tasks = _file_tasks(train_files, chunk_bytes, hash_split=False)
        val_files = c4["validation"]

        def val_docs() -> Iterator[str]:
            for f in val_files:
                yield from _corpus.iter_file_documents(f)

        kind, sources, split = "c4-local", _source_stats(train_files + [Path(f) for f in val_files]), "c4"
    else:
        tasks = _file_tasks(files, chunk_bytes, hash_split=True)
        val_docs, kind, sources, split = None, "local", _source_stats(files), "hash"
    opts = {"val_fraction": val_fraction if split == "hash" else None, "val_tokens": val_tokens,
            "max_tokens": max_tokens, "chunk_bytes": chunk_bytes}
    return _prepare(Path(out), tok, kind, split, sources, opts, tasks, val_docs, workers=workers,
                    max_tokens=max_tokens, val_tokens=val_tokens, progress=progress)


def prepare_documents(out: str | Path, tokenizer: TextTokenizer, train_docs: Sequence[str], val_docs: Sequence[str],
                      *, kind: str, sources: list[dict[str, Any]], progress: bool = False) -> dict[str, Any]:
    """Prepare documents already in memory (the built-in corpus) as one shard; returns the manifest."""
    return _prepare(Path(out), tokenizer, kind, "hash", sources, {}, [_Task(0, "", hash_split=False)],
                    lambda: iter(val_docs), docs=train_docs, workers=1, progress=progress)


def _plan(tok: TextTokenizer, dtype: np.dtype, kind: str, split: str, sources: list[dict[str, Any]],
          opts: dict[str, Any], tasks: Sequence[_Task]) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "kind": kind,
            "tokenizer": {"fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
            "dtype": dtype.name, "split": split, "sources": sources, "options": opts,
            "tasks": [asdict(t) for t in tasks]}


def _start_dir(out: Path, plan: dict[str, Any], tok: TextTokenizer) -> dict[str, Any] | None:
    """Check ``out`` against ``plan``; returns the manifest when it is already complete."""
    manifest_path, plan_path = out / MANIFEST, out / PLAN
    if manifest_path.is_file():
        m = read_json(manifest_path)
        if m.get("complete") is True and m.get("plan") == plan:
            return m
    if plan_path.is_file():
        if read_json(plan_path) != plan:
            raise ValueError(f"{out} holds the preparation of other data or another tokenizer; remove it or "
                             "choose another --out")
    elif out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} is not empty and holds no preparation; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):  # left by a killed run
        if stale.is_dir():
            import shutil

            shutil.rmtree(stale)
        else:
            stale.unlink()
    manifest_path.unlink(missing_ok=True)
    _atomic_write_text(plan_path, json.dumps(plan, indent=1) + "\n")
    if not (out / "tokenizer").is_dir():
        tmp = out / "tokenizer.tmp"
        tok.save(tmp)
        os.replace(tmp, out / "tokenizer")
    return None


def _prepare(out: Path, tok: TextTokenizer, kind: str, split: str, sources: list[dict[str, Any]],
             opts: dict[str, Any], tasks: list[_Task], val_docs: Callable[[], Iterator[str]] | None, *,
             docs: Sequence[str] | None = None, workers: int | None = None, max_tokens: int | None = None,
             val_tokens: int | None = None, progress: bool = True) -> dict[str, Any]:
    t0 = time.perf_counter()
    dtype = token_dtype(tok.vocab_size)
    plan = _plan(tok, dtype, kind, split, sources, opts, tasks)
    done = _start_dir(out, plan, tok)
    if done is not None:
        return done
    records: dict[int, dict[str, Any]] = {}
    for t in tasks:
        path = out / f"train-{t.index:05d}.json"
        if path.is_file() and (out / f"train-{t.index:05d}.bin").is_file():
            rec = read_json(path)
            # its held-out part is deleted once val.bin is written: then the task runs again
            if rec["val_tokens"] == 0 or (out / f"val-part-{t.index:05d}.bin").is_file():
                records[t.index] = rec
    pending = [t for t in tasks if t.index not in records]
    n_proc = max(1, min(workers or _cpu_count(), len(pending)))
    from tqdm import tqdm

    bar = tqdm(desc=f"prepare {out.name}", unit="tok", unit_scale=True, file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    chosen: list[dict[str, Any]] = []
    try:
        with _runner(n_proc, tok, out, dtype, opts.get("val_fraction") or 0.0, docs) as run:
            results = run(pending)
            total = 0
            for t in tasks:
                rec = records[t.index] if t.index in records else next(results)
                if t.index not in records:
                    bar.update(rec["tokens"] + rec["val_tokens"])
                chosen.append(rec)
                total += rec["tokens"]
                bar.set_postfix_str(f"{len(chosen)}/{len(tasks)} shards", refresh=False)
                if max_tokens is not None and total >= max_tokens:
                    break
    finally:
        bar.close()
        for stale in out.glob("*.tmp"):  # a failed task, or tasks cut short by max_tokens
            stale.unlink(missing_ok=True)
    for t in tasks[len(chosen):]:  # past --max-tokens: not part of this preparation
        for suffix in (".bin", ".json"):
            (out / f"train-{t.index:05d}{suffix}").unlink(missing_ok=True)
        for suffix in (".bin", ".npy"):
            (out / f"val-part-{t.index:05d}{suffix}").unlink(missing_ok=True)
    _check_sources(chosen, tasks)
    train_tokens = sum(r["tokens"] for r in chosen)
    if train_tokens == 0:
        raise ValueError(f"no train documents in {', '.join(sorted({s['path'] for s in sources}))}")
    val = _write_validation(out, tok, dtype, chosen, val_docs, val_tokens, split)
    seconds = time.perf_counter() - t0
    manifest = {
        "format": FORMAT, "version": VERSION, "complete": True, "kind": kind,
        "tokenizer": {"name": tok.name, **plan["tokenizer"], "dir": "tokenizer"}, "dtype": dtype.name,
        "sources": sources,
        "train": {"documents": sum(r["documents"] for r in chosen), "tokens": train_tokens,
                  "bytes": sum(r["bytes"] for r in chosen),
                  "shards": [{k: r[k] for k in ("file", "source", "start", "end", "documents", "tokens", "bytes")}
                             for r in chosen]},
        "validation": val, "options": opts, "workers": n_proc, "seconds": round(seconds, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "plan": plan,
    }
    _atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def _check_sources(chosen: list[dict[str, Any]], tasks: list[_Task]) -> None:
    """A whole source file without a single document is bad input (an empty or blank file)."""
    docs: dict[str, int] = {}
    for r in chosen:
        if r["source"]:
            docs[r["source"]] = docs.get(r["source"], 0) + r["documents"] + r["val_documents"]
    cut = {t.path for t in tasks[len(chosen):]}  # files only partly read because of max_tokens
    for path, n in docs.items():
        if n == 0 and path not in cut:
            raise ValueError(f"data file holds no text: {path}")


def _write_validation(out: Path, tok: TextTokenizer, dtype: np.dtype, chosen: list[dict[str, Any]],
                      val_docs: Callable[[], Iterator[str]] | None, cap: int | None, split: str) -> dict[str, Any]:
    w = _Writer(out / "val.bin", dtype, tok.eos_id, per_doc=True)
    try:
        if val_docs is not None:  # C4 validation files or in-memory documents: read only what the cap needs
            for chunk in _batched(val_docs(), _ENCODE_CHUNK // 4):
                w.add(chunk, tok.encode_batch(chunk))
                if cap is not None and w.tokens >= cap:
                    break
        else:  # the held-out parts of the tasks, in task order, up to the cap
            for rec in chosen:
                part = out / f"val-part-{Path(rec['file']).stem.split('-')[1]}.bin"
                if cap is not None and w.tokens >= cap:
                    break
                if rec["val_tokens"] == 0:
                    continue
                per_doc = np.load(part.with_suffix(".npy"))
                tokens = np.fromfile(part, dtype=dtype)
                lens = per_doc[:, 0]
                if cap is not None:
                    keep = int(np.searchsorted(np.cumsum(lens), cap - w.tokens, side="left")) + 1
                    per_doc, tokens = per_doc[:keep], tokens[: int(lens[:keep].sum())]
                w._write(tokens.tobytes())
                w.documents += len(per_doc)
                w.tokens += tokens.size
                w.bytes += int(per_doc[:, 1].sum())
                w.per_doc.extend(map(tuple, per_doc.tolist()))
        if w.documents == 0:
            raise ValueError("no validation documents: every document went to the train split "
                             "(more or longer documents, or a larger val_fraction, are needed)")
        w.commit()
    except BaseException:
        w.abort()
        raise
    for part in itertools.chain(out.glob("val-part-*.bin"), out.glob("val-part-*.npy")):
        part.unlink()
    return {"split": split, "file": "val.bin", "index": "val.npy", "documents": w.documents, "tokens": w.tokens,
            "bytes": w.bytes, "cap": cap}


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _runner:
    """Context manager returning ``run(tasks) -> iterator of records in task order``: in this process
    for one worker, else a pool of processes.

    The pool forks where the platform can (Linux): no re-import of the caller's ``__main__`` (which
    ``spawn`` needs, and which breaks scripts without an ``if __name__ == "__main__"`` guard), and
    the tokenizer is inherited instead of loaded again. Workers use numpy and the tokenizer only,
    one thread each (``TOKENIZERS_PARALLELISM=false``; with one process per core the tokenizer's own
    thread pool would oversubscribe the cores). Elsewhere the pool spawns and loads the tokenizer
    from ``DIR/tokenizer``.
    """

    def __init__(self, n: int, tok: TextTokenizer, out: Path, dtype: np.dtype, val_fraction: float,
                 docs: Sequence[str] | None):
        self.n, self.tok, self.out, self.dtype, self.vf, self.docs = n, tok, out, dtype, val_fraction, docs
        self.pool = None

    def __enter__(self) -> Callable[[list[_Task]], Iterator[dict[str, Any]]]:
        if self.n == 1:
            _init_worker(self.tok, str(self.out), self.dtype.name, self.vf, self.docs, single_threaded=False)
            return lambda tasks: map(_run_task, tasks)
        fork = "fork" in multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if fork else "spawn")
        tok = self.tok if fork else str(self.out / "tokenizer")
        # Set around the fork too: the tokenizer library warns in a child forked after it used threads.
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            self.pool = ctx.Pool(self.n, initializer=_init_worker,
                                 initargs=(tok, str(self.out), self.dtype.name, self.vf, None, True))
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        return lambda tasks: self.pool.imap(_run_task, tasks)

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
        _W.clear()
