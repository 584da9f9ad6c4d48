"""The Python-sources corpus (``--data pysrc``): a larger offline corpus than the built-in one.

Text every install of the training extras has: the source and documentation files of the standard
library and of the packages the harness depends on (:data:`PACKAGES`: torch, the ``[train]``
extras, and numpy, which torch and datasets need). About 150 MB of text, ~44M tokens with the
4096-token byte-level BPE; the built-in corpus (``--data builtin``, ~0.5M tokens) stays the demo's.

Files
    Under each root (:func:`corpus_roots`: the standard library's directory without its
    ``site-packages``, then each package's directory, in :data:`PACKAGES` order), every file whose
    name ends in one of :data:`SUFFIXES`, in sorted order of its path relative to the root
    (``os.walk`` without following links; ``__pycache__`` skipped). Files larger than
    :data:`MAX_FILE_BYTES` (generated tables) or not UTF-8 (a few test fixtures) are not text for
    this corpus and are left out.

Documents
    One file is one document, ``"<root>/<relative path>\\n\\n<text>"`` with the text stripped;
    texts shorter than :data:`MIN_DOC_CHARS` characters are dropped (empty ``__init__.py`` files),
    and so are texts already seen (identical files, e.g. vendored copies: the first wins), so no text
    is both a train and a validation document. The train/validation split is the built-in one
    (:func:`meqmuon.train.corpus.is_validation`, a hash of the document's text, 5 %). Train documents
    stay in file order (training permutes rows anyway); held-out documents are stored in the order of
    the SHA-256 of their text, so that the validation set (the first held-out documents) mixes the
    roots instead of being the standard library's first files.

Determinism and cache
    The documents are a function of the files, so the corpus is identical for the same environment.
    :func:`corpus_key` names it: the corpus version, the Python implementation and version, and a
    hash of every root's name and version and of every file's relative path and size; the data
    cache (:func:`meqmuon.train.data.build_data`) and ``meqmuon prepare --data pysrc`` prepare it
    once into memory-mapped token shards (:mod:`meqmuon.train.prepare`).

Tokenizer
    The built-in byte-level BPE (:func:`meqmuon.train.tokenizer.train_bpe`) trained on every
    ``k``-th train document, ``k`` the smallest step that keeps the sample under
    :data:`BPE_SAMPLE_BYTES` (training on all 150 MB takes minutes and gives almost the same merges).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import math
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meqmuon.train import corpus as _corpus
from meqmuon.train import prepare as _prepare
from meqmuon.train import shards as _shards
from meqmuon.train.tokenizer import TextTokenizer, load_or_train_bpe, load_tokenizer, rough_duration

__all__ = ["NAME", "PYSRC_VERSION", "PACKAGES", "SUFFIXES", "MAX_FILE_BYTES", "MIN_DOC_CHARS",
           "BPE_SAMPLE_BYTES", "corpus_roots", "source_files", "corpus_key", "file_documents",
           "bpe_sample", "prepare_pysrc"]

#: The name ``--data`` takes.
NAME = "pysrc"
#: Bump when the way the corpus is assembled changes (invalidates caches).
PYSRC_VERSION = 1
#: The packages whose files join the standard library's: torch, the ``[train]`` extras, numpy.
PACKAGES: tuple[str, ...] = ("torch", "numpy", "transformers", "tokenizers", "datasets", "matplotlib", "tqdm")
#: Source and documentation files.
SUFFIXES: tuple[str, ...] = (".py", ".pyi", ".rst", ".md", ".txt")
#: Larger files are generated data (Unicode tables, test vectors), not prose or code.
MAX_FILE_BYTES = 1 << 20
#: Shorter texts (empty or one-line modules) are dropped.
MIN_DOC_CHARS = 200
#: The BPE is trained on a sample of the train documents of at most about this many bytes.
BPE_SAMPLE_BYTES = 24 << 20
#: Speed of tokenising it with the built-in BPE, for the rough time :func:`prepare_pysrc` announces: 4.3 MB of
#: text per second on 2 ``AVX512+AVX512_BF16`` cores (``encode_batch_fast``; 152.5 MB in ~35 s).
TOKENIZE_MB_PER_S = 4.0

#: (root name, version, directory)
Root = tuple[str, str, Path]


def corpus_roots(packages: Sequence[str] = PACKAGES) -> list[Root]:
    """The standard library's directory and each package's, with their versions.

    A package that is not installed raises ``ValueError`` naming it (the ``[train]`` extras provide them).
    """
    impl = sys.implementation.name
    roots: list[Root] = [("python", f"{impl}{'.'.join(map(str, sys.version_info[:3]))}",
                          Path(sysconfig.get_paths()["stdlib"]))]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"the {NAME} corpus needs the package {name!r}, which is not installed "
                             "(pip install 'meqmuon[train]')")
        roots.append((name, importlib.metadata.version(name), Path(next(iter(spec.submodule_search_locations)))))
    return roots


def _walk(top: Path, skip_dirs: frozenset[str]) -> list[str]:
    rel: list[str] = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        base = Path(dirpath).relative_to(top)
        rel.extend((base / f).as_posix() for f in filenames if f.endswith(SUFFIXES))
    return sorted(rel)


def source_files(roots: Sequence[Root] | None = None) -> list[tuple[str, Path, int]]:
    """``(label, path, size)`` of every corpus file in corpus order (label ``"<root>/<relative path>"``)."""
    roots = corpus_roots() if roots is None else roots
    out: list[tuple[str, Path, int]] = []
    for i, (name, _version, top) in enumerate(roots):
        # The standard library's directory holds the installed packages; they are roots of their own.
        skip = frozenset({"__pycache__", "site-packages", "dist-packages"} if i == 0 else {"__pycache__"})
        for rel in _walk(top, skip):
            path = top / rel
            size = path.stat().st_size
            if size <= MAX_FILE_BYTES:
                out.append((f"{name}/{rel}", path, size))
    return out


def corpus_key(roots: Sequence[Root], files: Sequence[tuple[str, Path, int]]) -> str:
    """Cache key: version, Python, and a hash of the roots' names/versions and the files' labels/sizes."""
    h = hashlib.sha256()
    for name, version, _ in roots:
        h.update(f"{name}=={version}\n".encode())
    for label, _, size in files:
        h.update(f"{label}\x00{size}\n".encode("utf-8", "surrogateescape"))
    return f"{NAME}-v{PYSRC_VERSION}-{roots[0][1]}-{h.hexdigest()[:12]}"


def file_documents(files: Sequence[tuple[str, Path, int]]) -> list[str]:
    """The documents of ``files`` (see the module docstring), in file order."""
    docs: list[str] = []
    seen: set[bytes] = set()
    for label, path, _ in files:
        try:
            text = path.read_bytes().decode("utf-8").strip()
        except UnicodeDecodeError:
            continue  # not text (a test fixture in another encoding)
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if len(text) < MIN_DOC_CHARS or digest in seen:
            continue
        seen.add(digest)
        docs.append(f"{label}\n\n{text}")
    return docs


def bpe_sample(train_docs: Sequence[str], max_bytes: int = BPE_SAMPLE_BYTES) -> list[str]:
    """Every ``k``-th train document, ``k = ceil(total characters / max_bytes)`` (all of them when small)."""
    total = sum(len(d) for d in train_docs)
    step = max(1, math.ceil(total / max_bytes))
    return list(train_docs[::step])


def prepare_pysrc(out: Path | None, *, cache: Path, tokenizer_name: str | None = None, vocab_size: int = 4096,
                  val_fraction: float = 0.05, progress: bool = False, announce: bool = False,
                  roots: Sequence[Root] | None = None) -> tuple[_shards.PreparedData, str]:
    """Prepare the corpus (once) and return ``(prepared data, description)``.

    ``out``: the prepared directory (``meqmuon prepare --out``); ``None``: the data cache,
    ``<cache>/<corpus key>-vf<val_fraction>/prepared-<tokenizer fingerprint>``. The BPE (when
    ``tokenizer_name`` is None) is cached in ``<cache>/<corpus key>-vf<val_fraction>/``. A complete
    preparation is reused without reading the files again. ``roots``: default :func:`corpus_roots`
    (tests pass a small tree). ``progress``: a progress bar while tokenising; ``announce``: one line each
    before training the BPE and before tokenising, saying roughly how long they take (~45 s on first use:
    nothing else is printed meanwhile without a bar).
    """
    roots = corpus_roots() if roots is None else roots
    files = source_files(roots)
    key = f"{corpus_key(roots, files)}-vf{val_fraction}"
    data_dir = cache / key
    what = f"{NAME} corpus ({key}: {len(files)} files of {', '.join(r[0] for r in roots)})"
    bpe_file = data_dir / f"tokenizer-bpe{vocab_size}.json"
    docs: list[str] | None = None
    split: tuple[list[str], list[str]] | None = None
    if tokenizer_name is None and not bpe_file.exists():
        docs = file_documents(files)
        split = _corpus.split_documents(docs, val_fraction)
    tokenizer: TextTokenizer = (load_or_train_bpe(bpe_sample(split[0]) if split else [], vocab_size, bpe_file,
                                                  announce=announce)
                                if tokenizer_name is None else load_tokenizer(tokenizer_name))
    target = Path(out) if out is not None else data_dir / f"prepared-{tokenizer.fingerprint}"
    if (target / _shards.MANIFEST).is_file():  # else new, or unfinished: prepare_documents resumes or refuses
        prepared = _shards.PreparedData(target)
        if prepared.fingerprint == tokenizer.fingerprint and prepared.manifest["sources"][0].get("path") == key:
            return prepared, what
    if split is None:
        docs = file_documents(files)
        split = _corpus.split_documents(docs, val_fraction)
    sources: list[dict[str, Any]] = [{"path": key, "documents": len(docs or []), "files": len(files),
                                      "roots": [{"name": n, "version": v} for n, v, _ in roots]}]
    # Held-out documents in hash order, so that the first ones (the validation rows) mix every root.
    val_docs = sorted(split[1], key=lambda d: hashlib.sha256(d.encode("utf-8")).digest())
    if announce:
        mb = sum(len(d.encode("utf-8")) for d in docs or []) / 1e6
        print(f"meqmuon: tokenising the {NAME} corpus ({mb:,.1f} MB) once into {target}: roughly "
              f"{rough_duration(mb / TOKENIZE_MB_PER_S)} (~{TOKENIZE_MB_PER_S:g} MB/s on 2 cores)", file=sys.stderr,
              flush=True)
    _prepare.prepare_documents(target, tokenizer, split[0], val_docs, kind=NAME, sources=sources, progress=progress)
    return _shards.PreparedData(target), what
