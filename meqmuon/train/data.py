"""Data pipeline of the pretraining harness: packing, a resumable rank-aware train stream, a fixed
validation set with its byte count, and one entry point, :func:`build_data`.

Sources (``spec`` of :func:`build_data`; :func:`data_source` names them, and every run records the
name as ``data_source`` in ``config.json`` and ``summary.json``)
    ``builtin`` (``None`` / ``"builtin"``): the offline built-in corpus (Python documentation text,
    see :mod:`meqmuon.train.corpus`) with a byte-level BPE trained on its train split.
    ``pysrc``: the Python-sources corpus (the standard library's and the harness's dependencies'
    source and documentation files, ~44M tokens; :mod:`meqmuon.train.pysrc`) with the same BPE.
    ``local``: paths to ``.jsonl``/``.json`` (one ``{"text": ...}`` per line) or ``.txt``
    (documents separated by blank lines) files, any of them gzipped; directories are expanded.
    Validation documents are held out by a stable hash of their text (5 %); without
    ``tokenizer_name`` a BPE is trained on the train split.
    ``prepared``: a directory written by ``meqmuon prepare`` (:mod:`meqmuon.train.prepare`; format and
    reader in :mod:`meqmuon.train.shards`); its tokenizer comes with it, and a ``tokenizer_name``
    whose fingerprint differs is an error.
    ``c4-hub`` (``"c4"``): English C4 streamed from the hub; ``c4-local``: a directory (or files)
    with C4's file names (``c4-train.NNNNN-of-01024.json.gz``, ``c4-validation.*``). Both need
    ``tokenizer_name`` (T5-base for Llama, SmolLM2's or Qwen2's own) and run through the same code,
    :class:`meqmuon.train.corpus.C4Documents` with a different opener, for training and the first
    documents of the validation files for validation.

    The built-in corpus and local files are prepared into the cache by the code of
    ``meqmuon prepare`` and then read like a prepared directory, memory-mapped.

Packing
    Each document is tokenised without special tokens and followed by EOS; the documents are
    concatenated into one token stream ``t``. Row ``i`` is ``t[i*L : i*L + L + 1]`` (``L`` =
    ``seq_len``): rows hold ``L + 1`` tokens and consecutive rows share one boundary token, so every
    token after the first is a prediction target exactly once. The loop feeds
    ``inputs, targets = batch[:, :-1], batch[:, 1:]`` (:func:`split_batch`) and computes the
    cross-entropy itself, i.e. exactly ``L`` predicted tokens per row, no HF-internal shift.
    Attention crosses document boundaries (standard packed pretraining, no masking).

Train stream (:class:`PackedTrainStream`: built-in corpus, local files, prepared directories)
    The stream is the concatenation of all train shards (rows may span two shards). The rows are
    permuted per epoch with ``numpy.random.default_rng([seed, epoch])``, a global permutation over
    all shards (int32: 4 bytes per row, 39 MB for 9.9B tokens at ``L`` = 1024, the only memory that
    grows with the data); the stream position is one global row counter. ``next_batch(G)``
    consumes the next ``G`` rows of the global order and returns this rank's contiguous
    ``G / world_size`` of them, so the ranks' rows are disjoint and their union over one call is
    exactly the batch a single process gets from ``next_batch(G)``. The state (``state_dict``) is
    that counter plus identity checks; it does not depend on the world size, so a run may even be
    resumed on a different number of ranks. Epochs roll over seamlessly.

    For C4 (:class:`StreamingPackedStream`) each rank packs its own document stream (its own C4
    files): ranks see disjoint data, but not the same global batch as one process would. Its state
    is the source position (:class:`meqmuon.train.corpus.C4Documents`) plus the not-yet-emitted
    tokens, so a resumed run continues exactly.

Validation set and bits per byte
    The first validation documents (in source order) are packed the same way into
    ``n = max(1, val_tokens // L)`` rows (fewer if the held-out text is shorter), a LongTensor
    ``(n, L + 1)`` whose ``n * L`` targets are stream positions ``1 .. n*L``. ``val_bytes`` is the
    UTF-8 byte count of the text those targets cover: each document's bytes are spread evenly over
    its tokens (its EOS included) and summed over the covered positions, i.e. whole documents count
    fully and the (at most two) partially covered ones pro rata. Then
    ``bits_per_byte = mean_loss_nats * n * L / (val_bytes * ln 2)`` (:meth:`DataBundle.bits_per_byte`).

Cache (``cache_dir`` argument, else ``$MEQMUON_CACHE``, else ``~/.cache/meqmuon``)::

    <cache>/<data key>/tokenizer-bpe<V>.json     BPE trained on that source's train split
    <cache>/<data key>/prepared-<tokenizer fp>/  the prepared shards (all held-out documents as validation)
    <cache>/<c4 key>/val-<tokenizer fp>-L<L>-T<val_tokens>.pt   C4's {"val", "val_bytes", ...}

    data key: ``builtin-v1-cpython3.11.7-<sha12 of the corpus>-vf0.05`` (Python version included),
    ``local-<sha12 of (resolved path, size, mtime) of every file>-vf0.05``, ``c4-en`` (hub) or
    ``c4-local-<sha12 of the validation files' (path, size, mtime)>``.
    Files are written atomically (temp file + rename) and a prepared directory is used only once its
    manifest is complete; in DDP rank 0 builds first and the others wait at a barrier.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meqmuon.train import corpus as _corpus
from meqmuon.train import hub as _hub
from meqmuon.train import prepare as _prepare
from meqmuon.train import shards as _shards
from meqmuon.train.shards import TokenStore
from meqmuon.train.tokenizer import TextTokenizer, load_or_train_bpe, load_tokenizer

__all__ = [
    "DATA_SOURCES",
    "data_source",
    "DEFAULT_CACHE_DIR",
    "cache_root",
    "local_bpe",
    "encode_documents",
    "pack_documents",
    "num_sequences",
    "as_sequences",
    "split_batch",
    "make_val_set",
    "PackedTrainStream",
    "StreamingPackedStream",
    "DataBundle",
    "build_data",
]

DEFAULT_CACHE_DIR = Path("~/.cache/meqmuon")
#: What ``--data`` can name (see the module docstring); recorded as ``data_source`` by every run.
DATA_SOURCES = ("builtin", "pysrc", "local", "prepared", "c4-hub", "c4-local")
_ENCODE_CHUNK = 256  # documents per encode_batch call: big enough for the Rust thread pool


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Cache directory: the argument, else ``$MEQMUON_CACHE``, else ``~/.cache/meqmuon``."""
    root = cache_dir if cache_dir is not None else os.environ.get("MEQMUON_CACHE") or DEFAULT_CACHE_DIR
    return Path(root).expanduser()


def _atomic_save(path: Path, save_fn) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        save_fn(f)
    os.replace(tmp, path)


def encode_documents(tokenizer: TextTokenizer, docs: Iterable[str]) -> Iterator[list[int]]:
    """Token ids of each document (no special tokens), encoded in batches for speed."""
    it = iter(docs)
    while chunk := list(itertools.islice(it, _ENCODE_CHUNK)):
        yield from tokenizer.encode_batch(chunk)


def pack_documents(token_docs: Iterable[Sequence[int]], eos_id: int) -> np.ndarray:
    """Concatenate documents, each followed by ``eos_id``, into one int32 token stream."""
    parts: list[np.ndarray] = []
    eos = np.array([eos_id], dtype=np.int32)
    for ids in token_docs:
        parts.append(np.asarray(ids, dtype=np.int32))
        parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def num_sequences(n_tokens: int, seq_len: int) -> int:
    """Rows of ``seq_len + 1`` tokens (stride ``seq_len``) that fit in ``n_tokens`` tokens."""
    return max(0, (n_tokens - 1) // seq_len)


def as_sequences(tokens: torch.Tensor | np.ndarray, seq_len: int) -> torch.Tensor:
    """View a 1-D token stream as its ``(num_sequences, seq_len + 1)`` packed rows (no copy)."""
    t = torch.as_tensor(tokens)
    n = num_sequences(t.numel(), seq_len)
    return t[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len) if n else t.new_zeros(0, seq_len + 1)


def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of a packed batch ``(B, L + 1)``: ``batch[:, :-1]``, ``batch[:, 1:]``."""
    return batch[:, :-1], batch[:, 1:]


def make_val_set(docs: Iterable[str], tokenizer: TextTokenizer, seq_len: int,
                 val_tokens: int) -> tuple[torch.Tensor, int, int]:
    """Pack the first validation documents into ``(n, seq_len + 1)`` rows.

    Returns ``(val, val_bytes, n_docs)``: ``val`` int64, ``val_bytes`` the UTF-8 bytes covered by
    the ``n * seq_len`` targets (see the module docstring), ``n_docs`` documents touched.
    ``n = max(1, val_tokens // seq_len)``, fewer when the documents run out; none at all is an error.
    """
    need = max(1, val_tokens // seq_len) * seq_len + 1
    token_docs: list[list[int]] = []
    doc_bytes: list[int] = []
    total = 0
    it = iter(docs)
    while total < need and (chunk := list(itertools.islice(it, 64))):
        for text, ids in zip(chunk, tokenizer.encode_batch(chunk), strict=True):
            token_docs.append(ids)
            doc_bytes.append(len(text.encode("utf-8")))
            total += len(ids) + 1
            if total >= need:
                break
    stream = pack_documents(token_docs, tokenizer.eos_id)
    rows, nbytes, ndocs = _shards.val_set_from_stream(stream, [len(t) + 1 for t in token_docs], doc_bytes, seq_len,
                                                      val_tokens)
    return torch.from_numpy(rows), nbytes, ndocs


class PackedTrainStream:
    """Deterministic, resumable, rank-aware batches of packed rows of a token stream.

    See the module docstring for the order and the rank split. ``tokens``: a :class:`TokenStore`
    (memory-mapped shards) or a 1-D tensor/array held in memory.
    """

    def __init__(self, tokens: TokenStore | torch.Tensor | np.ndarray, seq_len: int, *, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if not isinstance(tokens, TokenStore):
            tokens = TokenStore([tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)])
        self.store = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_sequences = num_sequences(len(self.store), seq_len)
        if self.num_sequences == 0:
            raise ValueError(f"train data too short for one sequence of {seq_len + 1} tokens")
        self.position = 0  # rows consumed by all ranks together
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None
        # Cheap identity check for load_state_dict: size plus a sample of the tokens.
        n = len(self.store)
        sample = self.store.take(np.arange(0, n, max(1, n // 4096)))
        checksum = int((sample * np.arange(1, sample.size + 1)).sum())
        self._fingerprint = f"{n}-{checksum}"

    @property
    def tokens(self) -> torch.Tensor:
        """The whole stream as an int64 tensor (reads everything: for small data and tests)."""
        return torch.from_numpy(self.store.read(0, len(self.store)).astype(np.int64))

    @property
    def epoch(self) -> int:
        """Epochs completed (fractional progress is ``position / num_sequences``)."""
        return self.position // self.num_sequences

    @property
    def num_tokens(self) -> int:
        """Prediction targets per epoch (``num_sequences * seq_len``)."""
        return self.num_sequences * self.seq_len

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            # shuffle of an int32 range: the permutation(n) of earlier versions (same draws, same
            # order) at half the memory
            self._perm = None
            perm = np.arange(self.num_sequences, dtype=np.int32 if self.num_sequences < 2**31 else np.int64)
            np.random.default_rng([self.seed, epoch]).shuffle(perm)
            self._perm, self._perm_epoch = perm, epoch
        return self._perm

    def _global_rows(self, start: int, count: int) -> np.ndarray:
        idx = []
        pos, end = start, start + count
        while pos < end:  # may span an epoch boundary
            epoch, within = divmod(pos, self.num_sequences)
            take = min(end - pos, self.num_sequences - within)
            idx.append(self._order(epoch)[within : within + take])
            pos += take
        return np.concatenate(idx)

    def next_batch(self, global_batch_size: int) -> torch.Tensor:
        """Next ``global_batch_size`` rows of the global order; returns this rank's share,
        an int64 tensor ``(global_batch_size // world_size, seq_len + 1)``."""
        _check_divisible(global_batch_size, self.world_size)
        local = global_batch_size // self.world_size
        idx = self._global_rows(self.position + self.rank * local, local)
        self.position += global_batch_size
        return torch.from_numpy(self.store.rows(idx, self.seq_len))

    def batches(self, global_batch_size: int) -> Iterator[torch.Tensor]:
        """Endless iterator over :meth:`next_batch`."""
        while True:
            yield self.next_batch(global_batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "packed", "position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "num_sequences": self.num_sequences, "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("kind", "seed", "seq_len", "num_sequences", "fingerprint"):
            mine = self.state_dict()[key]
            if state.get(key) != mine:
                raise ValueError(f"train stream state does not match this data: {key}={state.get(key)!r}, "
                                 f"expected {mine!r}")
        self.position = int(state["position"])


def _check_divisible(global_batch_size: int, world_size: int) -> None:
    if global_batch_size <= 0 or global_batch_size % world_size:
        raise ValueError(f"global batch {global_batch_size} must be a positive multiple of the world size "
                         f"{world_size}")


def _text_of(item: Any) -> str:
    return item["text"] if isinstance(item, dict) else item


class StreamingPackedStream:
    """Packs a (possibly endless) document stream on the fly: the C4 train path.

    ``documents`` is re-iterable: a list of texts, or a ``datasets.IterableDataset`` of
    ``{"text": ...}`` rows already split for this rank. Its ``state_dict``/``load_state_dict`` are used
    when present; otherwise the position is the number of documents consumed. A finite source is
    restarted (next epoch) when exhausted.
    """

    def __init__(self, documents: Iterable[Any], tokenizer: TextTokenizer, seq_len: int, *,
                 rank: int = 0, world_size: int = 1):
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self._buffer: list[int] = []
        self._epoch = 0
        self._docs_consumed = 0
        self._rows_emitted = 0
        self._source_state: Any = None
        self._it: Iterator[Any] | None = None

    def _has_state(self) -> bool:
        return hasattr(self.documents, "state_dict") and hasattr(self.documents, "load_state_dict")

    def _open(self) -> Iterator[Any]:
        if self._has_state():
            if hasattr(self.documents, "set_epoch"):
                self.documents.set_epoch(self._epoch)
            if self._source_state is not None:
                self.documents.load_state_dict(self._source_state)
            return iter(self.documents)
        return itertools.islice(iter(self.documents), self._docs_consumed, None)

    def _fill(self) -> None:
        if self._it is None:
            self._it = self._open()
        chunk = [_text_of(x) for x in itertools.islice(self._it, 64)]
        if not chunk:
            if self._docs_consumed == 0:
                raise ValueError("document source is empty")
            self._epoch, self._docs_consumed, self._source_state, self._it = self._epoch + 1, 0, None, None
            return
        for ids in self.tokenizer.encode_batch(chunk):
            self._buffer.extend(ids)
            self._buffer.append(self.tokenizer.eos_id)
        self._docs_consumed += len(chunk)
        if self._has_state():
            self._source_state = self.documents.state_dict()

    def next_batch(self, global_batch_size: int) -> torch.Tensor:
        """This rank's ``global_batch_size // world_size`` next rows, int64 ``(B, seq_len + 1)``."""
        _check_divisible(global_batch_size, self.world_size)
        rows = []
        for _ in range(global_batch_size // self.world_size):
            while len(self._buffer) < self.seq_len + 1:
                self._fill()
            rows.append(self._buffer[: self.seq_len + 1])
            del self._buffer[: self.seq_len]  # keep the boundary token: it starts the next row
        self._rows_emitted += len(rows)
        return torch.tensor(rows, dtype=torch.int64)

    def batches(self, global_batch_size: int) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch(global_batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "streaming", "seq_len": self.seq_len, "epoch": self._epoch,
                "docs_consumed": self._docs_consumed, "source": self._source_state,
                "buffer": list(self._buffer), "rows_emitted": self._rows_emitted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "streaming" or state.get("seq_len") != self.seq_len:
            raise ValueError("train stream state does not match this streaming source")
        self._epoch = int(state["epoch"])
        self._docs_consumed = int(state["docs_consumed"])
        self._source_state = state["source"]
        self._buffer = list(state["buffer"])
        self._rows_emitted = int(state["rows_emitted"])
        self._it = None  # reopened lazily at the saved position


@dataclass
class DataBundle:
    """What :func:`build_data` returns to the training loop."""

    tokenizer: TextTokenizer
    train: PackedTrainStream | StreamingPackedStream
    val: torch.Tensor  # int64 (n, seq_len + 1), identical for every optimizer
    val_bytes: int  # UTF-8 bytes covered by the n * seq_len validation targets
    description: str
    seq_len: int
    source: str = "builtin"  # one of DATA_SOURCES

    @property
    def val_target_tokens(self) -> int:
        return self.val.shape[0] * self.seq_len

    def bits_per_byte(self, mean_val_loss_nats: float) -> float:
        """Bits per UTF-8 byte from the mean validation cross-entropy (nats per target token)."""
        return mean_val_loss_nats * self.val_target_tokens / (self.val_bytes * math.log(2))


def _sha12(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()[:12]


def _stats(files: Iterable[Path | str]) -> list[tuple[str, int, int]]:
    return [(str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in files]


def _val_set(path: Path, docs: Iterable[str], tokenizer: TextTokenizer, seq_len: int,
             val_tokens: int) -> tuple[torch.Tensor, int, int]:
    if path.exists():
        d = torch.load(path, weights_only=True)
        return d["val"], int(d["val_bytes"]), int(d["n_docs"])
    val, nbytes, ndocs = make_val_set(docs, tokenizer, seq_len, val_tokens)
    _atomic_save(path, lambda f: torch.save({"val": val, "val_bytes": nbytes, "n_docs": ndocs,
                                             "tokenizer": tokenizer.fingerprint}, f))
    return val, nbytes, ndocs


def _paths(spec: str | Path | Sequence[str | Path] | None) -> list[str]:
    return [str(spec)] if isinstance(spec, (str, Path)) else ([str(p) for p in spec] if spec is not None else [])


def data_source(spec: str | Path | Sequence[str | Path] | None) -> str:
    """Which of :data:`DATA_SOURCES` a ``--data`` value names (raises ``ValueError`` for a bad path)."""
    paths = _paths(spec)
    if not paths or (len(paths) == 1 and paths[0].lower() == "builtin"):
        return "builtin"
    if len(paths) == 1 and paths[0].lower() == "c4":
        return "c4-hub"
    if len(paths) == 1 and paths[0].lower() == "pysrc":
        return "pysrc"
    if len(paths) == 1 and _shards.is_prepared_dir(paths[0]):
        return "prepared"
    return "c4-local" if _corpus.c4_split(_corpus.expand_paths(paths)) is not None else "local"


def build_data(
    spec: str | Path | Sequence[str | Path] | None = None,
    *,
    tokenizer_name: str | None = None,
    seq_len: int = 1024,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    cache_dir: str | Path | None = None,
    val_tokens: int = 1_000_000,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    announce: bool = False,
) -> DataBundle:
    """Tokenizer, train stream and validation set for ``spec`` (see the module docstring).

    ``tokenizer_name``: hub id or local directory; ``None`` means a byte-level BPE of ``vocab_size``
    trained on the source's train split (not allowed for C4), or a prepared directory's own.
    ``val_tokens``: validation targets wanted (rounded down to whole rows). ``val_fraction``: share
    of documents held out (built-in and local data). ``announce``: one line on stderr before a first
    use's long silent work (training the built-in BPE; tokenising ``pysrc``), saying roughly how long.
    """
    root = cache_root(cache_dir)
    paths = _paths(spec)
    source = data_source(paths)
    common = dict(seq_len=seq_len, seed=seed, rank=rank, world_size=world_size, val_tokens=val_tokens)
    if source in ("c4-hub", "c4-local"):
        return _build_c4(source, paths, tokenizer_name, root=root, **common)
    if source == "prepared":
        prepared = _shards.PreparedData(paths[0])
        tokenizer = prepared.tokenizer()
        if tokenizer_name is not None:
            given = load_tokenizer(tokenizer_name)
            if given.fingerprint != tokenizer.fingerprint:
                raise ValueError(f"{prepared.dir} was prepared with tokenizer {tokenizer.name!r} (fingerprint "
                                 f"{tokenizer.fingerprint}), not {tokenizer_name!r} ({given.fingerprint}); leave "
                                 "out --tokenizer or prepare the data again with this one")
        n = len(prepared.manifest["train"]["shards"])
        what = f"prepared data {prepared.dir} ({prepared.source}, {n} shard{'' if n == 1 else 's'})"
        return _bundle(prepared, tokenizer, what, source, **common)
    if source == "pysrc":
        from meqmuon.train import pysrc

        prepared, what = pysrc.prepare_pysrc(None, cache=root, tokenizer_name=tokenizer_name, vocab_size=vocab_size,
                                             val_fraction=val_fraction, announce=announce,
                                             progress=announce and sys.stderr.isatty())
        return _bundle(prepared, prepared.tokenizer(), what, source, **common)
    if source == "builtin":
        docs = _corpus.builtin_documents()
        key = f"{_corpus.builtin_corpus_key()}-{_sha12(docs)}-vf{val_fraction}"
        what = f"built-in corpus ({key})"
        files: list[Path] = []
    else:
        files = _corpus.expand_paths(paths)
        key = _local_key(files, val_fraction)
        what = f"{len(files)} local file(s) ({key})"
        # Documents in memory only to train a BPE on them; a given tokenizer streams the files.
        docs = _corpus.local_documents(files)[1] if tokenizer_name is None else []
    train_docs, val_docs = _corpus.split_documents(docs, val_fraction)
    if docs and (not train_docs or not val_docs):
        raise ValueError(f"need both train and held-out documents, got {len(train_docs)} train / "
                         f"{len(val_docs)} validation from {what}")
    data_dir = root / key
    if tokenizer_name is None:
        tokenizer = load_or_train_bpe(train_docs, vocab_size, data_dir / f"tokenizer-bpe{vocab_size}.json",
                                      announce=announce)
    else:
        tokenizer = load_tokenizer(tokenizer_name)
    out = data_dir / f"prepared-{tokenizer.fingerprint}"
    try:
        prepared = _shards.PreparedData(out)
    except ValueError:
        if source == "builtin":
            _prepare.prepare_documents(out, tokenizer, train_docs, val_docs, kind="builtin",
                                      sources=[{"path": key, "documents": len(docs)}])
        else:
            _prepare.prepare(files, tokenizer, out, val_fraction=val_fraction, val_tokens=None,
                            progress=sys.stderr.isatty())
        prepared = _shards.PreparedData(out)
    return _bundle(prepared, tokenizer, what, source, **common)


def _local_key(files: Sequence[Path], val_fraction: float) -> str:
    """The cache key of local files: their paths, sizes and mtimes, and the held-out share."""
    return f"local-{_sha12(_stats(files))}-vf{val_fraction}"


def local_bpe(paths: str | Path | Sequence[str | Path], *, vocab_size: int = 4096, val_fraction: float = 0.05,
              cache_dir: str | Path | None = None, announce: bool = False) -> TextTokenizer:
    """The built-in BPE of local files, as ``train --data PATHS`` without ``--tokenizer`` uses it:
    trained on their train documents (the same hash split) and cached under the files' data key, so
    ``meqmuon prepare --tokenizer builtin`` and ``train`` train it once and share it. A cached BPE is
    loaded without reading the files; otherwise every document is read into memory to train it."""
    files = _corpus.expand_paths(_paths(paths))
    bpe_file = cache_root(cache_dir) / _local_key(files, val_fraction) / f"tokenizer-bpe{vocab_size}.json"
    if bpe_file.is_file():
        return load_or_train_bpe([], vocab_size, bpe_file)
    train_docs, val_docs = _corpus.split_documents(_corpus.local_documents(files)[1], val_fraction)
    if not train_docs:
        raise ValueError(f"no train documents to train the built-in BPE on in {len(files)} local file(s)")
    return load_or_train_bpe(train_docs, vocab_size, bpe_file, announce=announce)


def _bundle(prepared: _shards.PreparedData, tokenizer: TextTokenizer, what: str, source: str, *, seq_len: int,
            seed: int, rank: int, world_size: int, val_tokens: int) -> DataBundle:
    m = prepared.manifest
    train = PackedTrainStream(prepared.train_store(), seq_len, seed=seed, rank=rank, world_size=world_size)
    rows, val_bytes, n_val_docs = prepared.val_set(seq_len, val_tokens)
    val = torch.from_numpy(rows)
    tr, va = m["train"], m["validation"]
    desc = (f"{what}: {tr['documents'] + va['documents']} docs, {(tr['bytes'] + va['bytes']) / 1e6:.2f} MB; "
            f"{tr['documents']} train / {va['documents']} validation docs; tokenizer {tokenizer.name} (vocab "
            f"{tokenizer.vocab_size}); train {train.num_tokens:,} tokens = {train.num_sequences:,} x {seq_len}; "
            f"validation {val.shape[0]} x {seq_len} tokens from {n_val_docs} doc{'s' * (n_val_docs != 1)}, "
            f"{val_bytes:,} bytes")
    return DataBundle(tokenizer, train, val, val_bytes, desc, seq_len, source)


def _build_c4(source: str, paths: list[str], tokenizer_name: str | None, *, root: Path, seq_len: int, seed: int,
              rank: int, world_size: int, val_tokens: int) -> DataBundle:
    if source == "c4-hub":
        files = {split: _corpus.c4_hub_files(split) for split in ("train", "validation")}
        opener, key, where = _corpus.open_hub, "c4-en", "streamed from the hub"
    else:
        files = _corpus.c4_split(_corpus.expand_paths(paths))
        opener, where = _corpus.open_local, f"local copy {', '.join(paths)}"
        key = f"c4-local-{_sha12(_stats(files['validation']))}"
    if tokenizer_name is None:
        raise ValueError(f"C4 ({where}) needs --tokenizer: a hub id (t5-base, HuggingFaceTB/SmolLM2-135M, "
                         "Qwen/Qwen2-0.5B) or a local directory")
    if source == "c4-hub":  # fail in seconds, before the tokenizer or anything on disk, when offline
        _hub.require_hub("--data c4 streams allenai/c4 from the hub, but",
                         "offline: use --data builtin or --data pysrc, a local C4 copy (--data DIR --tokenizer "
                         "TOKENIZER) or a prepared directory (see docs/training.md)")
    tokenizer = load_tokenizer(tokenizer_name)
    path = root / key / f"val-{tokenizer.fingerprint}-L{seq_len}-T{val_tokens}.pt"
    # Validation: first documents of the validation files, unshuffled and unsplit (same on all ranks).
    val_docs = (text for f in files["validation"] for text in _corpus.iter_file_documents(f, opener)) \
        if not path.exists() else iter(())
    val, val_bytes, n_val_docs = _val_set(path, val_docs, tokenizer, seq_len, val_tokens)
    train_docs = _corpus.C4Documents(files["train"], opener, seed=seed, rank=rank, world_size=world_size)
    train = StreamingPackedStream(train_docs, tokenizer, seq_len, rank=rank, world_size=world_size)
    desc = (f"C4 en ({where}; rank {rank}/{world_size} reads {len(train_docs.rank_files(0))} of "
            f"{len(files['train'])} train files); tokenizer {tokenizer.name} (vocab {tokenizer.vocab_size}); "
            f"validation {val.shape[0]} x {seq_len} tokens from {n_val_docs} doc{'s' * (n_val_docs != 1)}, "
            f"{val_bytes:,} bytes")
    return DataBundle(tokenizer, train, val, val_bytes, desc, seq_len, source)
