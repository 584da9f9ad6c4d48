"""Tokenizers behind one small interface: a byte-level BPE trained on the built-in corpus, and
Hugging Face hub tokenizers (T5-base for Llama, SmolLM2's, Qwen2's) for C4 and local data.

Interface (:class:`TextTokenizer`): ``name``, ``encode(text) -> list[int]``,
``encode_batch(texts) -> list[list[int]]``, ``decode(ids) -> str``, ``eos_id``, ``vocab_size``
(the number of ids the tokenizer can emit, i.e. the embedding rows a model needs) and
``fingerprint`` (a short string that changes whenever the token ids could change; used in cache
keys and prepared-data manifests). ``encode`` never adds special tokens: the packer appends ``eos_id``
after each document.

Fingerprints hash the tokenizer's content, never its name: the byte-level BPE hashes its
``tokenizer.json``; a ``transformers`` fast tokenizer hashes its backend's JSON (without the
run-time truncation/padding settings) plus its EOS id and length. So ``t5-base`` from the hub and a
directory it was ``save_pretrained`` into give the same fingerprint, and a prepared directory can
check that ``--tokenizer`` names the tokenizer it was made with.

Directories (:func:`load_tokenizer`, :meth:`TextTokenizer.save`): a ``transformers``
``save_pretrained`` directory, or one written by :meth:`TextTokenizer.save`, which adds
``meqmuon_tokenizer.json`` (kind and original name) so that a saved built-in BPE loads as itself and
a saved hub tokenizer keeps its hub name (the model registry picks embedding rows by that name).

The built-in BPE (GPT-2 style byte-level BPE, ``tokenizers`` library) has ``<|endoftext|>`` as its
only special token, with id 0, and is trained on the *train* documents only, so validation text
is never seen by the tokenizer. Training on ~2 MB takes about a second; on the ~25 MB sample of
``--data pysrc``, ~5-8 s (:data:`BPE_MB_PER_S`). It happens once per corpus and vocabulary (the
cache holds it), with one line saying so where the caller asks (``announce``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "EOS_TOKEN",
    "TextTokenizer",
    "BPETokenizer",
    "HFTokenizer",
    "train_bpe",
    "load_or_train_bpe",
    "load_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"
#: Speed of training the built-in BPE, for the rough time :func:`load_or_train_bpe` announces: 3.2-4.7 MB
#: of text per second at 4,096-1,280 ids on 2 ``AVX512+AVX512_BF16`` cores (tokenizers 0.23, its Rust
#: threads on both cores): 1.8 MB of the built-in corpus in 0.4-0.6 s, the 24.9 MB sample of pysrc in 5.5 s.
BPE_MB_PER_S = 3.0
#: Marker file of a tokenizer directory written by :meth:`TextTokenizer.save`.
MARKER = "meqmuon_tokenizer.json"


class TextTokenizer:
    """Common interface of the harness tokenizers (see the module docstring)."""

    name: str
    eos_id: int
    vocab_size: int
    fingerprint: str

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer into ``directory`` so that :func:`load_tokenizer` loads it back with the
        same fingerprint (prepared data carries its tokenizer this way)."""
        raise NotImplementedError

    def _write_marker(self, directory: Path, kind: str) -> None:
        (directory / MARKER).write_text(json.dumps({"kind": kind, "name": self.name,
                                                     "fingerprint": self.fingerprint}) + "\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class BPETokenizer(TextTokenizer):
    """Wrapper of a ``tokenizers.Tokenizer`` (the built-in byte-level BPE)."""

    def __init__(self, tok, name: str = "builtin-bpe"):
        self._tok = tok
        self.name = name
        eos = tok.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"tokenizer {name!r} has no {EOS_TOKEN} token")
        self.eos_id = eos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = "bpe-" + hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The Rust thread pool, without offsets (the _fast variant): same ids, ~1.8x the speed.
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        self._write_marker(d, "bpe")

    @classmethod
    def load(cls, path: str | Path, name: str = "builtin-bpe") -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), name=name)


def train_bpe(texts: Sequence[str], vocab_size: int = 4096, name: str = "builtin-bpe") -> BPETokenizer:
    """Train a byte-level BPE (GPT-2 pre-tokenisation, 256-byte alphabet, ``<|endoftext|>`` = id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"BPE vocab_size must exceed 257 (256 bytes + EOS), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no UNK
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return BPETokenizer(tok, name=name)


def load_or_train_bpe(texts: Sequence[str], vocab_size: int, cache_file: Path, *,
                      announce: bool = False) -> BPETokenizer:
    """Load the BPE cached at ``cache_file``, or train it on ``texts`` and cache it (atomically).

    ``announce``: before training, one line on stderr saying what it trains on and roughly for how long
    (training prints nothing itself, for up to seconds per 10 MB of text)."""
    if cache_file.exists():
        return BPETokenizer.load(cache_file)
    if announce:
        mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        print(f"meqmuon: training the built-in BPE tokenizer ({vocab_size:,} ids) on {mb:,.1f} MB of text, once: "
              f"roughly {rough_duration(mb / BPE_MB_PER_S)} (~{BPE_MB_PER_S:g} MB/s on 2 cores); cached in "
              f"{cache_file.parent}", file=sys.stderr, flush=True)
    tok = train_bpe(texts, vocab_size)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f"{cache_file.name}.tmp{os.getpid()}")
    tok._tok.save(str(tmp))
    os.replace(tmp, cache_file)  # atomic: concurrent ranks never read a half-written file
    return tok


def rough_duration(seconds: float) -> str:
    """``"a second"``, ``"8 s"``, ``"3 min"``: a rough time for a line that announces a wait."""
    if seconds < 1.5:
        return "a second"
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class HFTokenizer(TextTokenizer):
    """Wrapper of a ``transformers`` tokenizer (``AutoTokenizer.from_pretrained``)."""

    def __init__(self, tok, name: str):
        self._tok = tok
        self.name = name
        eos = tok.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer {name!r} defines no EOS token; cannot separate documents")
        self.eos_id = int(eos)
        # len() counts added tokens too (e.g. T5's 100 sentinels: 32100, while the paper's Llama
        # models use 32000 rows; those sentinel ids only appear for literal "<extra_id_N>" text).
        self.vocab_size = len(tok)
        self.fingerprint = _hf_fingerprint(tok, self.eos_id, self.vocab_size, name)

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save_pretrained(str(d))
        self._write_marker(d, "hf")


def _hf_fingerprint(tok, eos_id: int, size: int, name: str) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: no content to hash, fall back to the name
        return f"hf-{name.replace('/', '--')}-{size}"
    spec = json.loads(backend.to_str())
    for runtime in ("truncation", "padding"):  # set per call by transformers; do not change the ids
        spec.pop(runtime, None)
    blob = json.dumps(spec, sort_keys=True, ensure_ascii=False) + f"\x00{eos_id}\x00{size}"
    return "hf-" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def load_tokenizer(name: str | Path) -> TextTokenizer:
    """Tokenizer by hub id (``"t5-base"``, ``"HuggingFaceTB/SmolLM2-135M"``, ``"Qwen/Qwen2-0.5B"``) or
    local directory (``save_pretrained`` or :meth:`TextTokenizer.save`). A hub id needs network
    access unless it is already in the Hugging Face cache."""
    name = str(name)
    if name == "builtin":
        # Asking the hub for a model called "builtin" would retry for a minute and then fail.
        raise ValueError("the built-in BPE is trained on a corpus's own train documents, so there is no saved "
                         "tokenizer called 'builtin' to load: `meqmuon train` (without --tokenizer) and `meqmuon "
                         "prepare --tokenizer builtin` train it on their data")
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise ValueError(f"tokenizer directory does not exist: {name} (a hub id has the form NAME or ORG/NAME)")
    marker = path / MARKER if path.is_dir() else None
    meta = json.loads(marker.read_text()) if marker is not None and marker.is_file() else {}
    if meta.get("kind") == "bpe":
        return BPETokenizer.load(path / "tokenizer.json", name=meta.get("name", "builtin-bpe"))
    from meqmuon.train.hub import HubUnreachable

    try:
        tok = _from_pretrained(str(path) if path.is_dir() else name, hub=not path.is_dir())
    except HubUnreachable:  # already one line that says what to do instead
        raise
    except Exception as e:  # noqa: BLE001 - offline, unknown id, missing files: one clear line
        raise _load_error(name, path, e) from None
    # Packed sequences are far longer than a document-level tokenizer limit; silence its warning.
    tok.model_max_length = int(1e30)
    return HFTokenizer(tok, meta.get("name", name))


def _from_pretrained(name: str, hub: bool):
    """``AutoTokenizer.from_pretrained``; for a hub id the local cache first (no network), then, only if
    the hub answers within a few seconds, the hub itself with its retry warnings silenced."""
    from transformers import AutoTokenizer

    if not hub:
        return AutoTokenizer.from_pretrained(name)
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or a broken cached copy): ask the hub below
        pass
    from meqmuon.train import hub as _hub

    _hub.require_hub(f"cannot load tokenizer {name!r}: it is not in the Hugging Face cache and")
    with _hub.quiet_retries():
        return AutoTokenizer.from_pretrained(name)


def _load_error(name: str, path: Path, e: Exception) -> RuntimeError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    where = "directory" if path.is_dir() else "hub id"
    return RuntimeError(
        f"cannot load tokenizer {name!r} ({where}; a hub id needs the Hugging Face hub or its local "
        f"cache, a directory must hold save_pretrained files; offline? use the built-in "
        f"corpus/tokenizer instead): {type(e).__name__}: {first}"
    )
