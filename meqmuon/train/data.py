"""Data pipeline of the pretraining harness: packing, a resumable rank-aware train stream, a fixed
validation set with its byte count, and one entry point, :func:`build_data`.

Sources (``spec`` of :func:`build_data`)
    ``None`` / ``"builtin"``: the offline built-in corpus (Python documentation text, see
    :mod:`meqmuon.train.corpus`) with a byte-level BPE trained on its train split.
    ``"c4"``: English C4 streamed from the hub (train split for training, the first documents of
    the validation split for validation); needs ``tokenizer_name`` (T5-base for Llama, SmolLM2's or
    Qwen2's own).
    Paths: local ``.jsonl``/``.json`` (one ``{"text": ...}`` per line, e.g. C4 shards),
    ``.txt`` (documents separated by blank lines), any of them gzipped; directories are expanded.
    Validation documents are held out by a stable hash of their text (5 %); without
    ``tokenizer_name`` a BPE is trained on the train split.

Packing
    Each document is tokenised without special tokens and followed by EOS; the documents are
    concatenated into one token stream ``t``. Row ``i`` is ``t[i*L : i*L + L + 1]`` (``L`` =
    ``seq_len``): rows hold ``L + 1`` tokens and consecutive rows share one boundary token, so every
    token after the first is a prediction target exactly once. The loop feeds
    ``inputs, targets = batch[:, :-1], batch[:, 1:]`` (:func:`split_batch`) and computes the
    cross-entropy itself, i.e. exactly ``L`` predicted tokens per row, no HF-internal shift.
    Attention crosses document boundaries (standard packed pretraining, no masking).

Train stream (:class:`PackedTrainStream`, built-in corpus and local files)
    The rows are permuted per epoch with ``numpy.random.default_rng([seed, epoch])``; the stream
    position is one global row counter. ``next_batch(G)`` consumes the next ``G`` rows of the global
    order and returns this rank's contiguous ``G / world_size`` of them, so the union over ranks of
    one call is exactly the batch a single process gets from ``next_batch(G)``. The state
    (``state_dict``) is that counter plus identity checks; it does not depend on the world size, so
    a run may even be resumed on a different number of ranks. Epochs roll over seamlessly.

    For C4 (:class:`StreamingPackedStream`) each rank packs its own document stream
    (``split_dataset_by_node``): ranks see disjoint data, but not the same global batch as one
    process would. Its state is the source position plus the not-yet-emitted tokens; the shuffle
    buffer of a streamed ``datasets`` source is not part of it (a ``datasets`` limitation).

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
    <cache>/<data key>/train-<tokenizer fp>.npy  int32 train token stream (EOS-separated)
    <cache>/<data key>/val-<tokenizer fp>-L<L>-T<val_tokens>.pt   {"val", "val_bytes", ...}

    data key: ``builtin-v1-cpython3.11.7-<sha12 of the corpus>-vf0.05`` (Python version included),
    ``local-<sha12 of (resolved path, size, mtime) of every file>-vf0.05`` or ``c4-en``.
    Files are written atomically (temp file + rename), so concurrent ranks are safe; in DDP build on
    rank 0 first and barrier to avoid redundant tokenisation.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meqmuon.train import corpus as _corpus
from meqmuon.train.tokenizer import TextTokenizer, load_or_train_bpe, load_tokenizer

__all__ = [
    "DEFAULT_CACHE_DIR",
    "cache_root",
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
    want_rows = max(1, val_tokens // seq_len)
    need = want_rows * seq_len + 1
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
    n = min(want_rows, num_sequences(stream.size, seq_len))
    if n == 0:
        raise ValueError(f"validation text too short for one sequence of {seq_len + 1} tokens "
                         f"({stream.size} tokens)")
    val = as_sequences(torch.from_numpy(stream.astype(np.int64)), seq_len)[:n].clone()
    # Targets are stream positions [1, n*L]; document i occupies [start, start + len_i + 1).
    lo, hi = 1, n * seq_len + 1
    covered_bytes, start = 0.0, 0
    for ids, nbytes in zip(token_docs, doc_bytes, strict=True):
        end = start + len(ids) + 1
        overlap = max(0, min(end, hi) - max(start, lo))
        covered_bytes += nbytes * overlap / (end - start)
        start = end
    return val, int(round(covered_bytes)), len(token_docs)


class PackedTrainStream:
    """Deterministic, resumable, rank-aware batches of packed rows from an in-memory token stream.

    See the module docstring for the order and the rank split. ``tokens`` is the 1-D token stream.
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray, seq_len: int, *, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.tokens = torch.as_tensor(tokens)
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_sequences = num_sequences(self.tokens.numel(), seq_len)
        if self.num_sequences == 0:
            raise ValueError(f"train data too short for one sequence of {seq_len + 1} tokens")
        self._rows = as_sequences(self.tokens, seq_len)
        self.position = 0  # rows consumed by all ranks together
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None
        # Cheap identity check for load_state_dict: size plus a sample of the tokens.
        sample = self.tokens[:: max(1, self.tokens.numel() // 4096)].to(torch.int64)
        checksum = int((sample * torch.arange(1, sample.numel() + 1)).sum())
        self._fingerprint = f"{self.tokens.numel()}-{checksum}"

    @property
    def epoch(self) -> int:
        """Epochs completed (fractional progress is ``position / num_sequences``)."""
        return self.position // self.num_sequences

    @property
    def num_tokens(self) -> int:
        """Prediction targets per epoch (``num_sequences * seq_len``)."""
        return self.num_sequences * self.seq_len

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
            self._perm, self._perm_epoch = torch.from_numpy(perm), epoch
        return self._perm

    def _global_rows(self, start: int, count: int) -> torch.Tensor:
        idx = []
        pos, end = start, start + count
        while pos < end:  # may span an epoch boundary
            epoch, within = divmod(pos, self.num_sequences)
            take = min(end - pos, self.num_sequences - within)
            idx.append(self._order(epoch)[within : within + take])
            pos += take
        return torch.cat(idx)

    def next_batch(self, global_batch_size: int) -> torch.Tensor:
        """Next ``global_batch_size`` rows of the global order; returns this rank's share,
        an int64 tensor ``(global_batch_size // world_size, seq_len + 1)``."""
        _check_divisible(global_batch_size, self.world_size)
        local = global_batch_size // self.world_size
        idx = self._global_rows(self.position + self.rank * local, local)
        self.position += global_batch_size
        return self._rows[idx].to(torch.int64)

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


def _train_tokens(path: Path, tokenizer: TextTokenizer, docs: Sequence[str]) -> np.ndarray:
    if path.exists():
        return np.load(path)
    tokens = pack_documents(encode_documents(tokenizer, docs), tokenizer.eos_id)
    _atomic_save(path, lambda f: np.save(f, tokens))
    return tokens


def _val_set(path: Path, docs: Iterable[str], tokenizer: TextTokenizer, seq_len: int,
             val_tokens: int) -> tuple[torch.Tensor, int, int]:
    if path.exists():
        d = torch.load(path, weights_only=True)
        return d["val"], int(d["val_bytes"]), int(d["n_docs"])
    val, nbytes, ndocs = make_val_set(docs, tokenizer, seq_len, val_tokens)
    _atomic_save(path, lambda f: torch.save({"val": val, "val_bytes": nbytes, "n_docs": ndocs,
                                             "tokenizer": tokenizer.fingerprint}, f))
    return val, nbytes, ndocs


def build_data(
    spec: str | Sequence[str] | None = None,
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
) -> DataBundle:
    """Tokenizer, train stream and validation set for ``spec`` (see the module docstring).

    ``tokenizer_name``: HF hub id; ``None`` means a byte-level BPE of ``vocab_size`` trained on the
    source's train split (not allowed for C4). ``val_tokens``: validation targets wanted (rounded
    down to whole rows). ``val_fraction``: share of documents held out (built-in and local data).
    """
    root = cache_root(cache_dir)
    paths = [spec] if isinstance(spec, (str, Path)) else (list(spec) if spec is not None else [])
    if len(paths) == 1 and str(paths[0]).lower() == "c4":
        return _build_c4(tokenizer_name, seq_len, seed, rank, world_size, root, val_tokens)
    if not paths or (len(paths) == 1 and str(paths[0]).lower() == "builtin"):
        docs = _corpus.builtin_documents()
        key = f"{_corpus.builtin_corpus_key()}-{_sha12(docs)}-vf{val_fraction}"
        what = f"built-in corpus ({key})"
    else:
        files, docs = _corpus.local_documents(paths)
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        key = f"local-{_sha12(stats)}-vf{val_fraction}"
        what = f"{len(files)} local file(s) ({key})"
    train_docs, val_docs = _corpus.split_documents(docs, val_fraction)
    if not train_docs or not val_docs:
        raise ValueError(f"need both train and held-out documents, got {len(train_docs)} train / "
                         f"{len(val_docs)} validation from {what}")
    data_dir = root / key
    if tokenizer_name is None:
        tokenizer = load_or_train_bpe(train_docs, vocab_size, data_dir / f"tokenizer-bpe{vocab_size}.json")
    else:
        tokenizer = load_tokenizer(tokenizer_name)
    fp = tokenizer.fingerprint
    tokens = _train_tokens(data_dir / f"train-{fp}.npy", tokenizer, train_docs)
    train = PackedTrainStream(torch.from_numpy(tokens), seq_len, seed=seed, rank=rank, world_size=world_size)
    val, val_bytes, n_val_docs = _val_set(data_dir / f"val-{fp}-L{seq_len}-T{val_tokens}.pt", val_docs,
                                          tokenizer, seq_len, val_tokens)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    desc = (f"{what}: {len(docs)} docs, {n_bytes / 1e6:.2f} MB; {len(train_docs)} train / {len(val_docs)} "
            f"validation docs; tokenizer {tokenizer.name} (vocab {tokenizer.vocab_size}); train "
            f"{train.num_tokens:,} tokens = {train.num_sequences:,} x {seq_len}; validation "
            f"{val.shape[0]} x {seq_len} tokens from {n_val_docs} docs, {val_bytes:,} bytes")
    return DataBundle(tokenizer, train, val, val_bytes, desc, seq_len)


def _build_c4(tokenizer_name: str | None, seq_len: int, seed: int, rank: int, world_size: int, root: Path,
              val_tokens: int) -> DataBundle:
    if tokenizer_name is None:
        raise ValueError("--data c4 needs a hub tokenizer "
                         "(t5-base, HuggingFaceTB/SmolLM2-135M or Qwen/Qwen2-0.5B)")
    tokenizer = load_tokenizer(tokenizer_name)
    path = root / "c4-en" / f"val-{tokenizer.fingerprint}-L{seq_len}-T{val_tokens}.pt"
    # Validation: first documents of the validation split, unshuffled and unsplit (same on all ranks).
    val_docs = (row["text"] for row in _corpus.c4_documents("validation")) if not path.exists() else ()
    val, val_bytes, n_val_docs = _val_set(path, val_docs, tokenizer, seq_len, val_tokens)
    train_docs = _corpus.c4_documents("train", rank=rank, world_size=world_size, seed=seed)
    train = StreamingPackedStream(train_docs, tokenizer, seq_len, rank=rank, world_size=world_size)
    desc = (f"C4 en (streamed, rank {rank}/{world_size}); tokenizer {tokenizer.name} (vocab "
            f"{tokenizer.vocab_size}); validation {val.shape[0]} x {seq_len} tokens from {n_val_docs} docs, "
            f"{val_bytes:,} bytes")
    return DataBundle(tokenizer, train, val, val_bytes, desc, seq_len)
