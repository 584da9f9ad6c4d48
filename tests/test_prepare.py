"""Prepared token shards (``meqmuon prepare``), local C4 copies and tokenizer directories."""

from __future__ import annotations

import errno
import gzip
import json
import random

import numpy as np
import pytest
import torch

import meqmuon.train.corpus as corpus
import meqmuon.train.hub as hub_mod
import meqmuon.train.prepare as prep
import meqmuon.train.shards as shards
from meqmuon.cli import main
from meqmuon.train.data import (
    PackedTrainStream,
    StreamingPackedStream,
    as_sequences,
    build_data,
    make_val_set,
    pack_documents,
)
from meqmuon.train.tokenizer import EOS_TOKEN, load_tokenizer, train_bpe

_rng = random.Random(0)
# ~3000 distinct made-up words (and a few accented ones), Zipf-like use below: enough for a 2k BPE vocabulary
WORDS = ["".join(_rng.choice("abcdefghijklmnopqrstuvwxyzé") for _ in range(_rng.randint(2, 9))) for _ in range(3000)]


def _docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(WORDS[min(int(rng.paretovariate(0.7)), len(WORDS)) - 1] for _ in range(rng.randint(20, 160)))
            + f". Document {seed}-{i}." for i in range(n)]


def _write_c4_file(path, docs):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://x.org/{i}"}) + "\n")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE (up to 2k tokens; ~1.6k learnt from this text) saved as transformers saves hub tokenizers."""
    from transformers import PreTrainedTokenizerFast

    bpe = train_bpe(_docs(400, 99), 2048)
    d = tmp_path_factory.mktemp("tok") / "bpe2k"
    PreTrainedTokenizerFast(tokenizer_object=bpe._tok, eos_token=EOS_TOKEN).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def c4_copy(tmp_path_factory):
    """A local copy of C4 in allenai/c4's layout: 4 train files and 2 validation files (~2 MB of text)."""
    root = tmp_path_factory.mktemp("c4")
    docs = {}
    for i in range(4):
        docs[f"train{i}"] = _docs(300, i)
        _write_c4_file(root / "en" / f"c4-train.{i:05d}-of-00004.json.gz", docs[f"train{i}"])
    for i in range(2):
        docs[f"val{i}"] = _docs(60, 100 + i)
        _write_c4_file(root / "en" / f"c4-validation.{i:05d}-of-00002.json.gz", docs[f"val{i}"])
    return root, docs


@pytest.fixture(scope="module")
def prepared(c4_copy, tok_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "c4-bpe"
    manifest = prep.prepare([c4_copy[0]], str(tok_dir), out, workers=2, val_tokens=5000, progress=False)
    return out, manifest


def _stream_of(tok, docs):
    return pack_documents(tok.encode_batch(docs), tok.eos_id)


# ---------------------------------------------------------------- prepare -> train round trip


def test_prepare_c4_layout_round_trip(prepared, c4_copy, tok_dir, tmp_path):
    out, m = prepared
    _, docs = c4_copy
    tok = load_tokenizer(tok_dir)
    assert m["complete"] is True and m["kind"] == "c4-local" and m["dtype"] == "uint16"
    assert m["tokenizer"]["fingerprint"] == tok.fingerprint and m["workers"] == 2
    assert len(m["sources"]) == 6 and all(s["size"] > 0 and s["mtime_ns"] > 0 for s in m["sources"])
    assert [r["documents"] for r in m["train"]["shards"]] == [300] * 4
    # the shards hold exactly the packed train documents, in file order
    train_docs = [d for i in range(4) for d in docs[f"train{i}"]]
    store = shards.PreparedData(out).train_store()
    assert np.array_equal(store.read(0, len(store)), _stream_of(tok, train_docs))
    assert m["train"]["tokens"] == len(store) == sum(r["tokens"] for r in m["train"]["shards"])
    # validation: the first documents of the validation files, whole documents up to the cap
    v = m["validation"]
    assert v["split"] == "c4" and v["tokens"] >= 5000 and v["documents"] < 120
    # train on it: no tokenizer needed, the tokenizer's own fingerprint, the validation set of the manifest
    b = build_data(str(out), seq_len=32, seed=1, cache_dir=tmp_path, val_tokens=4096)
    assert b.source == "prepared" and b.tokenizer.fingerprint == tok.fingerprint
    val, nbytes, _ = make_val_set(docs["val0"] + docs["val1"], tok, 32, 4096)
    assert torch.equal(b.val, val) and b.val_bytes == nbytes
    rows = b.train.next_batch(8)
    assert rows.shape == (8, 33) and rows.dtype == torch.int64
    # the same data prepared in one process is byte-identical
    one = tmp_path / "one"
    prep.prepare([c4_copy[0]], str(tok_dir), one, workers=1, val_tokens=5000, progress=False)
    for rec in m["train"]["shards"] + [{"file": "val.bin"}]:
        assert (one / rec["file"]).read_bytes() == (out / rec["file"]).read_bytes()


def test_rows_across_shards_rank_split_and_resume(prepared):
    out, _ = prepared
    store = shards.PreparedData(out).train_store()
    assert store.num_shards == 4
    L = 37  # not aligned with the shards: some rows span two of them
    whole = store.read(0, len(store))
    rows = as_sequences(torch.from_numpy(whole.astype(np.int64)), L)
    assert torch.equal(torch.from_numpy(store.rows(np.arange(rows.shape[0]), L)), rows)
    single = PackedTrainStream(store, L, seed=4)
    ranks = [PackedTrainStream(shards.PreparedData(out).train_store(), L, seed=4, rank=r, world_size=2)
             for r in range(2)]
    n = single.num_sequences
    for _ in range(n // 16):  # one epoch of global batches of 16
        g = single.next_batch(16)
        parts = [s.next_batch(16) for s in ranks]
        assert torch.equal(torch.cat(parts), g)
    # disjoint per rank: the rows each rank was given are different rows of the global order
    idx = [np.concatenate([ranks[r]._global_rows(k * 16 + r * 8, 8) for k in range(n // 16)]) for r in range(2)]
    assert not set(idx[0].tolist()) & set(idx[1].tolist())
    assert len(set(idx[0].tolist()) | set(idx[1].tolist())) == (n // 16) * 16
    # bit-exact resume mid-epoch from a fresh reader of the same directory
    state = single.state_dict()
    cont = [single.next_batch(16) for _ in range(5)]  # crosses into the next epoch
    again = PackedTrainStream(shards.PreparedData(out).train_store(), L, seed=4)
    again.load_state_dict(state)
    assert all(torch.equal(x, again.next_batch(16)) for x in cont)


def test_prepare_local_files_chunked_resumable(tok_dir, tmp_path):
    docs = _docs(500, 7)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:350]))
    (src / "b.txt").write_text("\n\n".join(docs[350:]) + "\n")
    tok = load_tokenizer(tok_dir)
    out = tmp_path / "out"
    m = prep.prepare([src], tok, out, workers=2, chunk_bytes=40_000, val_tokens=None, progress=False)
    assert m["kind"] == "local" and m["validation"]["split"] == "hash"
    assert len(m["train"]["shards"]) > 3  # a.jsonl was cut into byte ranges
    train, val = corpus.split_documents(docs)
    store = shards.PreparedData(out).train_store()
    assert np.array_equal(store.read(0, len(store)), _stream_of(tok, train))
    assert m["validation"]["documents"] == len(val) and m["train"]["documents"] == len(train)
    assert prep.prepare([src], tok, out, chunk_bytes=40_000, val_tokens=None, progress=False) == m  # complete
    # interrupted at the third shard: unusable; the rerun keeps the finished shards and does the rest
    resumed = tmp_path / "resumed"
    real = prep._run_task

    def dies_at_2(task):
        if task.index == 2:
            raise KeyboardInterrupt
        return real(task)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prep, "_run_task", dies_at_2)
        with pytest.raises(KeyboardInterrupt):
            prep.prepare([src], tok, resumed, workers=1, chunk_bytes=40_000, val_tokens=None, progress=False)
    assert not list(resumed.glob("*.tmp")) and not (resumed / "train-00002.bin").exists()
    with pytest.raises(ValueError, match="unfinished"):
        build_data(str(resumed), cache_dir=tmp_path)
    mtime = (resumed / "train-00000.bin").stat().st_mtime_ns
    m2 = prep.prepare([src], tok, resumed, workers=1, chunk_bytes=40_000, val_tokens=None, progress=False)
    assert (resumed / "train-00000.bin").stat().st_mtime_ns == mtime and m2["train"] == m["train"]
    assert (resumed / "val.bin").read_bytes() == (out / "val.bin").read_bytes()
    # another tokenizer (or changed sources) into the same directory is refused
    with pytest.raises(ValueError, match="other data or another tokenizer"):
        prep.prepare([src], train_bpe(docs, 300), out, chunk_bytes=40_000, val_tokens=None, progress=False)
    # --max-tokens keeps the first shards that reach it
    capped = prep.prepare([src], tok, tmp_path / "cap", chunk_bytes=40_000, max_tokens=5000, progress=False)
    assert 5000 <= capped["train"]["tokens"] < m["train"]["tokens"]


# ---------------------------------------------------------------- local C4 copy through the hub code


def test_c4_local_copy_streams_through_the_hub_code(c4_copy, tok_dir, tmp_path, monkeypatch):
    root, docs = c4_copy
    b = build_data(str(root), tokenizer_name=str(tok_dir), seq_len=32, seed=2, cache_dir=tmp_path, val_tokens=2048)
    assert b.source == "c4-local" and isinstance(b.train, StreamingPackedStream)
    tok = b.tokenizer
    val, nbytes, _ = make_val_set(docs["val0"] + docs["val1"], tok, 32, 2048)
    assert torch.equal(b.val, val) and b.val_bytes == nbytes
    # shard order from the seed, whole disjoint files per rank
    src = [corpus.C4Documents(sorted(str(p) for p in root.rglob("c4-train*")), seed=2, rank=r, world_size=2)
           for r in range(2)]
    f0, f1 = src[0].rank_files(0), src[1].rank_files(0)
    assert len(f0) == len(f1) == 2 and not set(f0) & set(f1)
    assert f0 != src[0].rank_files(1) or f1 != src[1].rank_files(1)  # a new shard order per epoch
    # shuffle buffer: block permutations of the rank's documents in file order
    small = corpus.C4Documents(f0 + f1, seed=2, shuffle_buffer=100)
    got = list(small)
    by_file = {str(root / "en" / f"c4-train.{i:05d}-of-00004.json.gz"): docs[f"train{i}"] for i in range(4)}
    in_order = [d for f in small.rank_files(0) for d in by_file[f]]
    assert got != in_order and sorted(got) == sorted(in_order)
    assert all(sorted(got[k:k + 100]) == sorted(in_order[k:k + 100]) for k in range(0, 1200, 100))
    # bit-exact resume mid-block and across files and epochs
    s = StreamingPackedStream(corpus.C4Documents(f0, seed=2, shuffle_buffer=100), tok, 32)
    for _ in range(7):
        s.next_batch(64)
    state = s.state_dict()
    cont = [s.next_batch(64) for _ in range(50)]
    r = StreamingPackedStream(corpus.C4Documents(f0, seed=2, shuffle_buffer=100), tok, 32)
    r.load_state_dict(json.loads(json.dumps(state)))  # a checkpoint's state survives serialisation
    assert all(torch.equal(x, r.next_batch(64)) for x in cont)
    assert s.state_dict()["epoch"] >= 1
    # --data c4 runs the same code with hub file names and the hub opener: point them at the local copy
    local = {split: sorted(str(p) for p in root.rglob(f"c4-{split}.*")) for split in ("train", "validation")}
    names = {split: [f"en/{p.rsplit('/', 1)[1]}" for p in ps] for split, ps in local.items()}
    monkeypatch.setattr(corpus, "c4_hub_files", lambda split: names[split])
    monkeypatch.setattr(corpus, "open_hub", lambda name: open(root / name, "rb"))
    monkeypatch.setattr(hub_mod, "require_hub", lambda *a: None)  # the hub is "reachable": it is the local copy
    hub = build_data("c4", tokenizer_name=str(tok_dir), seq_len=32, seed=2, cache_dir=tmp_path / "h", val_tokens=2048)
    assert hub.source == "c4-hub" and torch.equal(hub.val, b.val)
    assert all(torch.equal(hub.train.next_batch(8), b.train.next_batch(8)) for _ in range(5))


def test_c4_needs_a_tokenizer_and_validation_files(c4_copy, tmp_path):
    root, _ = c4_copy
    with pytest.raises(ValueError, match="needs --tokenizer"):
        build_data(str(root), cache_dir=tmp_path)
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "c4-train.00000-of-01024.json.gz").write_bytes((root / "en" / "c4-train.00000-of-00004.json.gz")
                                                           .read_bytes())
    with pytest.raises(ValueError, match="no c4-validation"):
        build_data(str(lone), tokenizer_name="x", cache_dir=tmp_path)


# ---------------------------------------------------------------- tokenizer directories


def test_tokenizer_directory_fingerprint(tok_dir, tmp_path):
    a = load_tokenizer(tok_dir)
    a._tok.save_pretrained(str(tmp_path / "resaved"))  # as a user would copy a hub tokenizer
    b = load_tokenizer(str(tmp_path / "resaved"))
    a.save(tmp_path / "marked")
    c = load_tokenizer(tmp_path / "marked")
    assert a.fingerprint == b.fingerprint == c.fingerprint and c.name == a.name
    assert a.fingerprint.startswith("hf-") and 1000 < a.vocab_size <= 2048
    bpe = train_bpe(_docs(100, 3), 300, name="builtin-bpe")
    bpe.save(tmp_path / "bpe")
    again = load_tokenizer(tmp_path / "bpe")
    assert again.fingerprint == bpe.fingerprint and again.name == "builtin-bpe"
    with pytest.raises(RuntimeError, match="directory"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- CLI: train on it, records, bad input


def _small_train(data, out, *extra):
    return ["train", "--model", "llama-tiny", "--data", str(data), "--seq-len", "32", "--global-batch", "8",
            "--steps", "2", "--val-tokens", "256", "--threads", "1", "--quiet", "--out", str(out), *extra]


def test_cli_prepare_then_train_records_the_source(c4_copy, tok_dir, tmp_path, capsys):
    out = tmp_path / "prep"
    assert main(["prepare", "--data", str(c4_copy[0]), "--tokenizer", str(tok_dir), "--out", str(out),
                 "--workers", "1", "--quiet", "--max-tokens", "10k"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["kind"] == "c4-local" and line["tokens"] >= 10_000 and line["tokens_per_s"] > 0
    run = tmp_path / "run"
    assert main(_small_train(out, run, "--cache-dir", str(tmp_path / "cache"))) == 0
    assert json.loads((run / "config.json").read_text())["data_source"] == "prepared"
    assert json.loads((run / "summary.json").read_text())["data_source"] == "prepared"
    # stopped and resumed on a prepared directory: the same losses as without the stop
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(_small_train(out, straight, "--steps", "4")) == 0
    assert main(_small_train(out, split, "--steps", "4", "--stop-at-step", "2")) == 0
    assert main(_small_train(out, split, "--steps", "4", "--resume", "auto")) == 0

    def losses(d):
        return [r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                if r["kind"] == "train"]

    assert losses(straight) == losses(split) and len(losses(split)) == 4
    # a different tokenizer than the one the directory was prepared with: one line, nothing written
    other = tmp_path / "other-tok"
    train_bpe(_docs(50, 5), 300).save(other)
    capsys.readouterr()
    assert main(_small_train(out, tmp_path / "run2", "--tokenizer", str(other))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prepared with tokenizer" in err[0] and not (tmp_path / "run2").exists()


def _gz_truncated(path):
    _write_c4_file(path, _docs(200, 1))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("case", ["corrupt_gz", "not_json", "no_text", "empty", "full_disk"])
def test_prepare_bad_input_one_line_nothing_usable(case, tok_dir, tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    good = _docs(40, 2)
    (src / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in good))
    bad = {"corrupt_gz": "b.jsonl.gz", "not_json": "b.jsonl", "no_text": "b.jsonl", "empty": "b.jsonl",
           "full_disk": None}[case]
    if case == "corrupt_gz":
        _gz_truncated(src / bad)
    elif case == "not_json":
        (src / bad).write_text(json.dumps({"text": "fine"}) + "\n" + "{not json\n")
    elif case == "no_text":
        (src / bad).write_text(json.dumps({"text": "fine"}) + "\n\n" + json.dumps({"body": "x"}) + "\n")
    elif case == "empty":
        (src / bad).write_text("")
    else:
        def no_space(self, data):
            raise OSError(errno.ENOSPC, f"writing {self.tmp}: No space left on device")

        monkeypatch.setattr(prep._Writer, "_write", no_space)
    out = tmp_path / "out"
    code = main(["prepare", "--data", str(src), "--tokenizer", str(tok_dir), "--out", str(out), "--workers", "1",
                 "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("meqmuon: error: ")
    needle = {"corrupt_gz": "b.jsonl.gz: corrupt or truncated gzip", "not_json": "b.jsonl:2: not a JSON line",
              "no_text": "b.jsonl:3: expected a JSON object with a 'text'", "empty": "data file is empty",
              "full_disk": "No space left on device"}[case]
    assert needle in err[0], err[0]
    if case in ("empty", "full_disk"):
        assert (str(src / "b.jsonl") in err[0]) if case == "empty" else ("train-00000.bin" in err[0])
    # nothing that train would accept
    assert not (out / "manifest.json").exists() and not list(out.glob("*.tmp"))
    assert main(_small_train(out, tmp_path / "run", "--cache-dir", str(tmp_path / "c"))) == 1
    assert "meqmuon: error:" in capsys.readouterr().err


def test_bad_line_number_in_a_later_chunk(tok_dir, tmp_path):
    lines = [json.dumps({"text": d}) for d in _docs(300, 4)]
    lines[250] = '{"text": 5}'
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"big\.jsonl:251: expected a JSON object"):
        prep.prepare([tmp_path / "big.jsonl"], str(tok_dir), tmp_path / "o", workers=1, chunk_bytes=20_000,
                       progress=False)


# ---------------------------------------------------------------- the built-in BPE, offline


def test_prepare_tokenizer_builtin_trains_once_and_matches_train(tmp_path, capsys, monkeypatch):
    """``prepare --data FILE.txt --tokenizer builtin`` trains the byte-level BPE on the file's train
    documents (no hub), caches it where ``train --data FILE.txt`` looks for it (the same fingerprint,
    so both runs see the same token ids), and a second preparation reuses it instead of training
    again. A .txt file is cut into documents at blank lines."""
    import meqmuon.train.data as data_mod

    text = tmp_path / "corpus.txt"
    docs = _docs(120, 7)
    text.write_text("\n\n".join(d.replace(". Document", ".\nDocument") for d in docs) + "\n")  # 2 lines each
    cache = tmp_path / "cache"
    out = tmp_path / "prepared"
    assert main(["prepare", "--data", str(text), "--tokenizer", "builtin", "--vocab-size", "512", "--out", str(out),
                 "--cache-dir", str(cache), "--workers", "1", "--quiet"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    manifest = json.loads((out / shards.MANIFEST).read_text())
    assert line["documents"] + line["val_documents"] == len(docs)  # one document per blank-line block
    (bpe_file,) = cache.rglob("tokenizer-bpe512.json")
    built = build_data(str(text), seq_len=32, cache_dir=cache, val_tokens=256, vocab_size=512)
    assert manifest["tokenizer"]["fingerprint"] == built.tokenizer.fingerprint == line["tokenizer"]
    on_prepared = build_data(str(out), seq_len=32, cache_dir=cache, val_tokens=256)
    assert line["shards"] == 1 and "(local, 1 shard):" in on_prepared.description  # not "1 shards"

    # The second time, the cached BPE is loaded: training it again would fail here.
    monkeypatch.setattr(data_mod, "load_or_train_bpe", lambda texts, v, f: (
        pytest.fail("retrained") if not f.is_file() else load_tokenizer_file(f)))
    again = tmp_path / "again"
    assert main(["prepare", "--data", str(text), "--tokenizer", "builtin", "--vocab-size", "512", "--out",
                 str(again), "--cache-dir", str(cache), "--workers", "1", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokenizer"] == line["tokenizer"]
    assert list(cache.rglob("tokenizer-bpe512.json")) == [bpe_file]


def load_tokenizer_file(path):
    from meqmuon.train.tokenizer import BPETokenizer

    return BPETokenizer.load(path)
