"""The Python-sources corpus (``--data pysrc``): files, documents, cache key, split and preparation on
small trees (and one real standard-library package); ``sweep --finished-only``."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from meqmuon.cli import main
from meqmuon.train import corpus, pysrc
from meqmuon.train.data import build_data, data_source, pack_documents

LONG = "def f(x):\n    return x + 1\n" * 10  # longer than MIN_DOC_CHARS


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")


def small_tree(tmp_path: Path) -> list[pysrc.Root]:
    a, b = tmp_path / "liba", tmp_path / "libb"
    _write(a / "mod.py", "  \n" + LONG + "\n\n")
    _write(a / "dup.py", LONG)  # same text as mod.py once stripped; sorts first, so it is the one kept
    _write(a / "short.py", "x = 1\n")  # under MIN_DOC_CHARS
    _write(a / "latin.txt", "caf\xe9 ".encode("latin-1") * 100)  # not UTF-8
    _write(a / "sub" / "x.py", "class X:\n    pass\n" * 20)
    _write(a / "big.txt", "y" * (pysrc.MAX_FILE_BYTES + 1))  # over the size limit
    _write(a / "data.bin", LONG + "#bin")  # suffix not listed
    _write(a / "__pycache__" / "c.py", LONG + "#cache")
    _write(a / "site-packages" / "pkg" / "y.py", LONG + "#site")  # the first root's installed packages: skipped
    _write(b / "core.py", "import os\n" * 40)
    _write(b / "README.md", "# Title\n\nSome prose about the package. " * 10)
    _write(b / "site-packages" / "z.py", "z = 2\n" * 50)  # kept: only the standard library skips it
    return [("python", "cpython3.0.0", a), ("pkgb", "1.0", b)]


def test_files_documents_and_order_on_a_small_tree(tmp_path):
    roots = small_tree(tmp_path)
    files = pysrc.source_files(roots)
    labels = [label for label, _, _ in files]
    assert labels == ["python/dup.py", "python/latin.txt", "python/mod.py", "python/short.py", "python/sub/x.py",
                      "pkgb/README.md", "pkgb/core.py", "pkgb/site-packages/z.py"]
    assert all(size == path.stat().st_size for _, path, size in files)
    docs = pysrc.file_documents(files)
    kept = ["python/dup.py", "python/sub/x.py", "pkgb/README.md", "pkgb/core.py", "pkgb/site-packages/z.py"]
    by_label = {label: path for label, path, _ in files}
    assert docs == [f"{k}\n\n{by_label[k].read_text(encoding='utf-8').strip()}" for k in kept]
    assert pysrc.file_documents(pysrc.source_files(roots)) == docs  # deterministic


def test_a_real_standard_library_package_in_sorted_order():
    top = Path(sysconfig.get_paths()["stdlib"]) / "json"
    roots = [("python", "v", top)]
    files = pysrc.source_files(roots)
    want = sorted(p.relative_to(top).as_posix() for p in top.rglob("*.py") if "__pycache__" not in p.parts)
    assert [label for label, _, _ in files] == [f"python/{r}" for r in want] and "decoder.py" in want
    docs = pysrc.file_documents(files)
    decoder = (top / "decoder.py").read_text(encoding="utf-8").strip()
    assert f"python/decoder.py\n\n{decoder}" in docs and len(docs) == len(set(docs))


def test_roots_name_the_python_build_and_package_versions():
    roots = pysrc.corpus_roots(("torch", "numpy"))
    assert [r[0] for r in roots] == ["python", "torch", "numpy"]
    assert roots[0][1] == f"{sys.implementation.name}{'.'.join(map(str, sys.version_info[:3]))}"
    assert roots[0][2] == Path(sysconfig.get_paths()["stdlib"])
    assert roots[1][1] == importlib.metadata.version("torch") and (roots[1][2] / "nn").is_dir()
    with pytest.raises(ValueError, match="needs the package 'no_such_package_xyz'"):
        pysrc.corpus_roots(("no_such_package_xyz",))


def test_cache_key_follows_versions_and_files(tmp_path):
    roots = small_tree(tmp_path)
    key = pysrc.corpus_key(roots, pysrc.source_files(roots))
    assert key.startswith("pysrc-v1-cpython3.0.0-") and key == pysrc.corpus_key(roots, pysrc.source_files(roots))
    newer = [roots[0], ("pkgb", "1.1", roots[1][2])]
    assert pysrc.corpus_key(newer, pysrc.source_files(newer)) != key
    (roots[1][2] / "core.py").write_text("import sys\n" * 40)  # another size
    assert pysrc.corpus_key(roots, pysrc.source_files(roots)) != key


def test_bpe_sample_takes_every_kth_document():
    docs = [f"{i:09d}" for i in range(10)]  # 90 characters in all: a step of ceil(90 / 30) = 3
    assert pysrc.bpe_sample(docs, max_bytes=30) == docs[::3]
    assert pysrc.bpe_sample(docs, max_bytes=1000) == docs


def many_files(tmp_path: Path) -> list[pysrc.Root]:
    top = tmp_path / "many"
    for i in range(60):
        _write(top / f"m{i:02d}.py", f"# module {i}\n" + f"def g{i}(a, b):\n    return a * {i} + b\n" * 8)
    return [("python", "cpython3.0.0", top)]


def test_prepare_splits_without_overlap_and_packs_in_order(tmp_path):
    roots = many_files(tmp_path)
    docs = pysrc.file_documents(pysrc.source_files(roots))
    prepared, what = pysrc.prepare_pysrc(None, cache=tmp_path / "cache", vocab_size=300, val_fraction=0.2,
                                         roots=roots)
    assert "pysrc-v1-cpython3.0.0-" in what and prepared.source == "pysrc"
    train = [d for d in docs if not corpus.is_validation(d, 0.2)]
    val = [d for d in docs if corpus.is_validation(d, 0.2)]
    assert train and val and not set(train) & set(val) and len(train) + len(val) == len(docs)
    m = prepared.manifest
    assert (m["train"]["documents"], m["validation"]["documents"]) == (len(train), len(val))
    tok = prepared.tokenizer()
    stored = prepared.train_store().read(0, m["train"]["tokens"])
    assert np.array_equal(stored, pack_documents((tok.encode(d) for d in train), tok.eos_id))
    # validation documents in the order of the SHA-256 of their text
    val_sorted = sorted(val, key=lambda d: hashlib.sha256(d.encode()).digest())
    val_stream = np.fromfile(prepared.dir / "val.bin", dtype=prepared.dtype)
    assert np.array_equal(val_stream, pack_documents((tok.encode(d) for d in val_sorted), tok.eos_id))
    # prepared once: a second call reuses it
    stamp = (prepared.dir / "manifest.json").stat().st_mtime_ns
    again, _ = pysrc.prepare_pysrc(None, cache=tmp_path / "cache", vocab_size=300, val_fraction=0.2, roots=roots)
    assert again.dir == prepared.dir and (again.dir / "manifest.json").stat().st_mtime_ns == stamp


def test_first_preparation_says_what_it_does_and_roughly_how_long(tmp_path, capsys):
    """On first use (~45 s for the real corpus, silent before) one line before training the BPE and one before
    tokenising, with their sizes and rough times; nothing once prepared, nothing without ``announce``."""
    roots = many_files(tmp_path)
    docs = pysrc.file_documents(pysrc.source_files(roots))
    sample = pysrc.bpe_sample([d for d in docs if not corpus.is_validation(d, 0.2)])
    for _ in range(2):
        prepared, _ = pysrc.prepare_pysrc(None, cache=tmp_path / "cache", vocab_size=300, val_fraction=0.2,
                                          announce=True, roots=roots)
    pysrc.prepare_pysrc(None, cache=tmp_path / "other", vocab_size=300, val_fraction=0.2, roots=roots)
    mb, sample_mb = (sum(len(d.encode()) for d in x) / 1e6 for x in (docs, sample))
    assert capsys.readouterr().err.splitlines() == [
        f"meqmuon: training the built-in BPE tokenizer (300 ids) on {sample_mb:.1f} MB of text, once: roughly a "
        f"second (~3 MB/s on 2 cores); cached in {prepared.dir.parent}",
        f"meqmuon: tokenising the pysrc corpus ({mb:.1f} MB) once into {prepared.dir}: roughly a second (~4 MB/s "
        "on 2 cores)"]


def test_data_and_prepare_command_name_the_corpus(tmp_path, monkeypatch, capsys):
    roots = many_files(tmp_path)
    monkeypatch.setattr(pysrc, "corpus_roots", lambda packages=pysrc.PACKAGES: roots)
    monkeypatch.setenv("MEQMUON_CACHE", str(tmp_path / "cache"))  # the prepare command's BPE cache
    assert data_source("pysrc") == "pysrc" and data_source("PYSRC") == "pysrc"
    bundle = build_data("pysrc", seq_len=16, cache_dir=tmp_path / "cache", vocab_size=300, val_tokens=64)
    assert bundle.source == "pysrc" and bundle.val.shape == (4, 17) and "pysrc corpus" in bundle.description
    out = tmp_path / "prepared"
    assert main(["prepare", "--data", "pysrc", "--out", str(out), "--vocab-size", "300", "--quiet"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["kind"] == "pysrc" and line["tokenizer"] == bundle.tokenizer.fingerprint
    cached, _ = pysrc.prepare_pysrc(None, cache=tmp_path / "cache", vocab_size=300, roots=roots)
    assert line["tokens"] == cached.manifest["train"]["tokens"]  # the same stream as the cache's
    assert (out / "train-00000.bin").read_bytes() == (cached.dir / "train-00000.bin").read_bytes()
    assert data_source(str(out)) == "prepared"
    (tmp_path / "a.txt").write_text("some text\n")
    assert main(["prepare", "--data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "p2"), "--quiet"]) == 1
    assert "needs --tokenizer" in capsys.readouterr().err


def test_sweep_finished_only_tabulates_and_lists_missing(tmp_path, capsys):
    cache, out = str(tmp_path / "cache"), tmp_path / "sweep"
    common = ["--optimizers", "adamw", "--seeds", "0", "--vocab-size", "512", "--seq-len", "32", "--global-batch",
              "8", "--steps", "3", "--eval-every", "3", "--val-tokens", "256", "--cache-dir", cache, "--out",
              str(out), "--quiet"]
    assert main(["sweep", "--lrs", "1e-3", *common]) == 0
    capsys.readouterr()
    assert main(["sweep", "--lrs", "1e-3,3e-3", "--finished-only", *common]) == 0
    table = (out / "sweep.md").read_text()
    assert table in capsys.readouterr().out + "\n"
    assert "Not finished (1): adamw-lr0.003-s0" in table and not (out / "adamw-lr0.003-s0").exists()
    results = json.loads((out / "results.json").read_text())
    assert results["missing"] == ["adamw-lr0.003-s0"] and [r["lr"] for r in results["runs"]] == [1e-3]
    assert main(["sweep", "--lrs", "3e-3", "--finished-only", *common]) == 1
    assert "no finished run of this grid" in capsys.readouterr().err
