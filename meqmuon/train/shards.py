"""Prepared data: the on-disk format of token shards and its memory-mapped reader used by training.

One code path for every source: ``meqmuon prepare`` writes a directory the user names; the built-in
corpus and local files given to ``meqmuon train --data`` are prepared into the cache automatically
(:func:`meqmuon.train.data.build_data`), so all of them are read through :class:`TokenStore`.

Directory layout::

    DIR/manifest.json        written last, with "complete": true; without it DIR is not usable
    DIR/plan.json            what is being prepared (sources with size and mtime, tokenizer, options):
                             a rerun resumes only when it is the same
    DIR/tokenizer/           the tokenizer (TextTokenizer.save), so training needs no --tokenizer
    DIR/train-00000.bin      token ids, raw little-endian uint16 (uint32 when the vocabulary has
                             more than 65,536 ids), no header
    DIR/train-00000.json     that shard's record (source, byte range, documents, tokens, bytes),
                             written after its .bin: a shard with a record is finished
    DIR/val.bin              the validation token stream
    DIR/val.npy              int64 (documents, 2): tokens (EOS included) and UTF-8 bytes per document

Writing (``meqmuon prepare``, the cache of built-in and local data): :mod:`meqmuon.train.prepare`.
"""

from __future__ import annotations

import json
import mmap
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meqmuon.train.tokenizer import TextTokenizer, load_tokenizer

__all__ = [
    "FORMAT",
    "MANIFEST",
    "token_dtype",
    "val_set_from_stream",
    "TokenStore",
    "PreparedData",
    "is_prepared_dir",
    "read_json",
]

FORMAT = "meqmuon-prepared"
VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
_MAX_OPEN_SHARDS = 64  # memory maps kept open by a TokenStore (each holds a file descriptor)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabulary <= 65,536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# ------------------------------------------------------------------------------------------- validation


def val_set_from_stream(tokens: np.ndarray, doc_tokens: Sequence[int], doc_bytes: Sequence[int], seq_len: int,
                        val_tokens: int) -> tuple[np.ndarray, int, int]:
    """The validation rows of the packed stream of documents with ``doc_tokens`` tokens (EOS included)
    and ``doc_bytes`` UTF-8 bytes each; the rule of :func:`meqmuon.train.data.make_val_set`.

    Returns ``(rows, val_bytes, n_docs)``: ``rows`` int64 ``(n, seq_len + 1)`` with
    ``n = max(1, val_tokens // seq_len)`` (fewer when the documents run out), ``val_bytes`` the
    bytes covered by its ``n * seq_len`` targets, ``n_docs`` the documents read (the first ones
    until the rows are filled). ``tokens`` needs to hold at least those documents.
    """
    want_rows = max(1, val_tokens // seq_len)
    need = want_rows * seq_len + 1
    total, k = 0, 0
    for n in doc_tokens:
        total += int(n)
        k += 1
        if total >= need:
            break
    n_rows = min(want_rows, max(0, (total - 1) // seq_len))
    if n_rows == 0:
        raise ValueError(f"validation text too short for one sequence of {seq_len + 1} tokens ({total} tokens)")
    stream = np.asarray(tokens[: n_rows * seq_len + 1], dtype=np.int64)
    rows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len][:n_rows].copy()
    # Targets are stream positions [1, n*L]; document i occupies [start, start + tokens_i).
    lo, hi = 1, n_rows * seq_len + 1
    covered_bytes, start = 0.0, 0
    for ntok, nbytes in zip(doc_tokens[:k], doc_bytes[:k], strict=True):
        end = start + int(ntok)
        overlap = max(0, min(end, hi) - max(start, lo))
        covered_bytes += int(nbytes) * overlap / (end - start)
        start = end
    return rows, int(round(covered_bytes)), k


# ------------------------------------------------------------------------------------------- reading


class TokenStore:
    """A 1-D token stream stored as consecutive shards (memory-mapped files or in-memory arrays),
    read as one stream.

    Reads touch only the pages they need, and :meth:`rows` hands the pages of the shards it read back
    to the kernel afterwards (``madvise(MADV_DONTNEED)``; they stay in the page cache), so the
    resident memory of a training process does not grow with the dataset or with the number of
    batches read. At most :data:`_MAX_OPEN_SHARDS` maps are open at a time (each holds a file
    descriptor; C4 has 1024 files).
    """

    def __init__(self, shards: Sequence[np.ndarray | Path | str], dtype: np.dtype | str | None = None,
                 lengths: Sequence[int] | None = None):
        items = list(shards)
        self._files: list[Path | None] = []
        self._arrays: list[np.ndarray | None] = []
        lens: list[int] = []
        for i, s in enumerate(items):
            if isinstance(s, (str, Path)):
                if dtype is None or lengths is None:
                    raise ValueError("file shards need dtype and lengths")
                n = int(lengths[i])
                if n == 0:
                    continue
                self._files.append(Path(s))
                self._arrays.append(None)
                lens.append(n)
            else:
                a = np.asarray(s).reshape(-1)
                if a.size == 0:
                    continue
                self._files.append(None)
                self._arrays.append(a)
                lens.append(a.size)
        self.dtype = np.dtype(dtype) if dtype is not None else (self._arrays[0].dtype if self._arrays else np.int64)
        self.lengths = np.array(lens, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self._maps: OrderedDict[int, tuple[mmap.mmap, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def num_shards(self) -> int:
        return len(self.lengths)

    def _shard(self, i: int) -> np.ndarray:
        a = self._arrays[i]
        if a is not None:
            return a
        if i in self._maps:
            self._maps.move_to_end(i)
            return self._maps[i][1]
        with open(self._files[i], "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        arr = np.frombuffer(m, dtype=self.dtype, count=int(self.lengths[i]))
        self._maps[i] = (m, arr)
        if len(self._maps) > _MAX_OPEN_SHARDS:
            _, (old, _arr) = self._maps.popitem(last=False)
            del _arr
            _close(old)
        return arr

    def release(self) -> None:
        """Drop the pages of every open map from this process (they stay in the page cache)."""
        for m, _ in self._maps.values():
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                m.madvise(mmap.MADV_DONTNEED)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream (a copy, stored dtype)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"token range [{start}, {stop}) outside a stream of {len(self)}")
        parts = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            lo = start - int(self.starts[i])
            take = min(stop - start, int(self.lengths[i]) - lo)
            parts.append(np.array(self._shard(i)[lo : lo + take]))
            start += take
            i += 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def take(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at the given stream positions, int64."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(positions.size, dtype=np.int64)
        shard = np.searchsorted(self.starts, positions, side="right") - 1
        for i in np.unique(shard):
            sel = shard == i
            out[sel] = self._shard(int(i))[positions[sel] - self.starts[i]]
        return out

    def rows(self, index: np.ndarray, seq_len: int) -> np.ndarray:
        """Packed rows ``index`` (row ``i`` = tokens ``[i*L, i*L + L + 1)``) as int64 ``(n, L + 1)``."""
        index = np.asarray(index, dtype=np.int64)
        out = np.empty((index.size, seq_len + 1), dtype=np.int64)
        first = index * seq_len
        shard = np.searchsorted(self.starts, first, side="right") - 1
        inside = first + seq_len + 1 <= self.starts[shard + 1]
        span = np.arange(seq_len + 1)
        for i in np.unique(shard[inside]):
            sel = inside & (shard == i)
            out[sel] = self._shard(int(i))[(first[sel] - self.starts[i])[:, None] + span]
        for j in np.flatnonzero(~inside):  # rows that cross into the next shard
            out[j] = self.read(int(first[j]), int(first[j]) + seq_len + 1)
        self.release()
        return out

    def close(self) -> None:
        while self._maps:
            _, (m, arr) = self._maps.popitem()
            del arr
            _close(m)


def _close(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a caller still holds a view into it: let garbage collection close it
        pass


def is_prepared_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by ``meqmuon prepare`` (finished or not)."""
    p = Path(path).expanduser()
    return p.is_dir() and ((p / MANIFEST).is_file() or (p / PLAN).is_file())


def read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return d


class PreparedData:
    """A finished prepared directory (see the module docstring), opened for reading.

    Raises ``ValueError`` naming the directory when it is not finished (no manifest, or
    ``"complete"`` not true), of another format, or when a shard's size disagrees with the manifest.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory).expanduser()
        path = self.dir / MANIFEST
        if not path.is_file():
            hint = " (an unfinished `meqmuon prepare`: rerun it to finish)" if (self.dir / PLAN).is_file() else ""
            raise ValueError(f"{self.dir} is not a prepared data directory: no {MANIFEST}{hint}")
        m = read_json(path)
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise ValueError(f"{path}: not a {FORMAT} v{VERSION} manifest")
        if m.get("complete") is not True:
            raise ValueError(f"{self.dir}: prepare did not finish (manifest not complete); rerun it")
        self.manifest = m
        self.dtype = np.dtype(m["dtype"])
        for rec in m["train"]["shards"]:
            self._check_size(self.dir / rec["file"], rec["tokens"])
        self._check_size(self.dir / m["validation"]["file"], m["validation"]["tokens"])

    def _check_size(self, path: Path, tokens: int) -> None:
        want = tokens * self.dtype.itemsize
        have = path.stat().st_size if path.is_file() else None
        if have != want:
            raise ValueError(f"{path}: expected {want} bytes ({tokens} tokens), found "
                             f"{'no file' if have is None else f'{have} bytes'}: damaged prepared data")

    @property
    def source(self) -> str:
        """``"local"``, ``"c4-local"`` or ``"builtin"``: what was prepared."""
        return self.manifest["kind"]

    @property
    def fingerprint(self) -> str:
        return self.manifest["tokenizer"]["fingerprint"]

    def tokenizer(self) -> TextTokenizer:
        """The tokenizer the data was made with (from ``DIR/tokenizer``)."""
        tok = load_tokenizer(self.dir / "tokenizer")
        if tok.fingerprint != self.fingerprint:
            raise ValueError(f"{self.dir}/tokenizer has fingerprint {tok.fingerprint}, the manifest says "
                             f"{self.fingerprint}: damaged prepared data")
        return tok

    def train_store(self) -> TokenStore:
        shards = self.manifest["train"]["shards"]
        return TokenStore([self.dir / r["file"] for r in shards], self.dtype, [r["tokens"] for r in shards])

    def val_set(self, seq_len: int, val_tokens: int) -> tuple[np.ndarray, int, int]:
        """``(rows, val_bytes, n_docs)`` of :func:`val_set_from_stream` on the stored validation stream."""
        v = self.manifest["validation"]
        docs = np.load(self.dir / v["index"])
        ends = np.cumsum(docs[:, 0])
        need = max(1, val_tokens // seq_len) * seq_len + 1
        k = min(len(ends), int(np.searchsorted(ends, need, side="left")) + 1)  # the documents the rows use
        store = TokenStore([self.dir / v["file"]], self.dtype, [v["tokens"]])
        try:
            tokens = store.read(0, int(ends[k - 1]) if k else 0)
        finally:
            store.close()
        return val_set_from_stream(tokens, docs[:k, 0].tolist(), docs[:k, 1].tolist(), seq_len, val_tokens)
