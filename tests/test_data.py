"""Data pipeline: built-in corpus, BPE, packing, train stream (seed/resume/ranks), local files, cache."""

from __future__ import annotations

import gzip
import hashlib
import json
import random

import numpy as np
import pytest
import torch

import meqmuon.train.data as data_mod
import meqmuon.train.prepare as prepare_mod
import meqmuon.train.tokenizer as tok_mod
from meqmuon.train import corpus
from meqmuon.train.data import (
    PackedTrainStream,
    StreamingPackedStream,
    as_sequences,
    build_data,
    cache_root,
    make_val_set,
    num_sequences,
    pack_documents,
    split_batch,
)
from meqmuon.train.tokenizer import EOS_TOKEN, TextTokenizer, train_bpe

SEQ = 64
VOCAB = 512


class CharTokenizer(TextTokenizer):
    """One token per character (ids = code points + 1); EOS = 0. Independent of the BPE code."""

    name = "chars"
    eos_id = 0
    vocab_size = 0x110000 + 1
    fingerprint = "chars"

    def encode(self, text):
        return [ord(c) + 1 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 1) for i in ids if i)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def builtin(cache):
    return build_data(None, seq_len=SEQ, seed=0, cache_dir=cache, val_tokens=4096, vocab_size=VOCAB)


def _synthetic_docs(n, seed=0):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "optimizer", "matrix", "équilibre", "muon", "rank", "norm"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + f" #{i}" for i in range(n)]


# ---------------------------------------------------------------- corpus and tokenizer


def test_builtin_corpus_deterministic_and_split_disjoint(monkeypatch):
    a = corpus.builtin_documents()
    monkeypatch.setattr(corpus, "_CACHED", None)  # force a second, independent collection
    b = corpus.builtin_documents()
    assert a == b
    assert len(a) == len(set(a))  # deduplicated
    assert all(len(d) >= corpus.MIN_DOC_CHARS for d in a)
    assert sum(len(d.encode()) for d in a) > 1_000_000
    train, val = corpus.split_documents(a)
    assert set(train).isdisjoint(val) and len(train) + len(val) == len(a)
    assert 0.02 < len(val) / len(a) < 0.09  # ~5 % held out
    # the split depends on the text only, not on order
    train_r, val_r = corpus.split_documents(list(reversed(a)))
    assert set(val_r) == set(val)


def test_bpe_tokenizer(builtin):
    tok = builtin.tokenizer
    assert tok.vocab_size == VOCAB and tok.eos_id == 0
    text = "def f(x):\n    return x ** 2  # ünïcode ✓"
    assert tok.decode(tok.encode(text)) == text  # byte-level: lossless, no UNK
    assert tok.encode(EOS_TOKEN) == [tok.eos_id]
    docs = _synthetic_docs(300)
    assert train_bpe(docs, 300).fingerprint == train_bpe(docs, 300).fingerprint
    assert train_bpe(docs, 300).fingerprint != train_bpe(docs[:150], 300).fingerprint


# ---------------------------------------------------------------- packing and validation bytes


def test_packing_eos_and_lengths():
    stream = pack_documents([[5, 6, 7], [8, 9], [10]], eos_id=0)
    assert stream.tolist() == [5, 6, 7, 0, 8, 9, 0, 10, 0]
    rows = as_sequences(stream, 2)
    assert rows.shape == (num_sequences(9, 2), 3) == (4, 3)
    assert rows.tolist() == [[5, 6, 7], [7, 0, 8], [8, 9, 0], [0, 10, 0]]
    # every token after the first is a target exactly once
    inputs, targets = split_batch(rows)
    assert targets.reshape(-1).tolist() == stream[1:].tolist()
    assert inputs.shape == targets.shape == (4, 2)
    assert num_sequences(1, 4) == 0 and as_sequences(np.array([1], dtype=np.int32), 4).shape == (0, 5)


def test_val_bytes_prorated():
    tok = CharTokenizer()
    docs = ["abc", "héllo wörld", "x" * 50, "last doc"]
    val, nbytes, ndocs = make_val_set(docs, tok, seq_len=5, val_tokens=12)
    assert val.shape == (2, 6) and val.dtype == torch.int64
    # independent per-position computation: each stream position carries its document's bytes / tokens
    per_pos = []
    for d in docs:
        per_pos += [len(d.encode()) / (len(d) + 1)] * (len(d) + 1)
    assert nbytes == round(sum(per_pos[1 : 2 * 5 + 1]))
    assert ndocs == 2  # 4 + 12 tokens already fill the 11 needed; later documents are not read
    assert val[0, 3].item() == tok.eos_id  # "abc" then EOS
    # everything covered -> all bytes but the first token's share
    full, fbytes, _ = make_val_set(["ab", "cd"], tok, seq_len=5, val_tokens=100)
    assert full.shape == (1, 6) and fbytes == round(4 - 2 / 3)
    with pytest.raises(ValueError):
        make_val_set(["a"], tok, seq_len=5, val_tokens=10)


def test_builtin_val_bytes_match_token_bytes(builtin):
    # byte-level BPE: every target token's bytes are exact; the pro-rated count must agree closely
    tok = builtin.tokenizer
    targets = builtin.val[:, 1:].reshape(-1).tolist()
    exact = sum(len(tok.decode([t]).encode()) for t in targets if t != tok.eos_id)
    assert abs(builtin.val_bytes - exact) / exact < 0.02
    assert builtin.val_target_tokens == builtin.val.shape[0] * SEQ == (4096 // SEQ) * SEQ
    bpb = builtin.bits_per_byte(2.0)
    assert bpb == pytest.approx(2.0 * builtin.val_target_tokens / (builtin.val_bytes * np.log(2)))


# ---------------------------------------------------------------- train stream


def _stream(tokens, seed=0, rank=0, world=1):
    return PackedTrainStream(tokens, SEQ, seed=seed, rank=rank, world_size=world)


def test_stream_seed_determinism_and_epoch_permutation(builtin):
    tokens = builtin.train.tokens
    a, b, c = _stream(tokens, 1), _stream(tokens, 1), _stream(tokens, 2)
    ba = [a.next_batch(8) for _ in range(3)]
    assert all(torch.equal(x, b.next_batch(8)) for x in ba)
    assert not torch.equal(ba[0], c.next_batch(8))
    assert ba[0].shape == (8, SEQ + 1) and ba[0].dtype == torch.int64
    # one epoch visits every packed row exactly once
    s = _stream(tokens[: 40 * SEQ + 1], 3)
    assert s.num_sequences == 40
    seen = torch.cat([s.next_batch(8) for _ in range(5)])
    rows = as_sequences(tokens[: 40 * SEQ + 1], SEQ)
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(seen) == key(rows)
    assert s.epoch == 1
    assert not torch.equal(s.next_batch(8), seen[:8])  # a new permutation in epoch 1


def test_stream_resume_exact(builtin):
    tokens = builtin.train.tokens[: 50 * SEQ + 1]  # small: the continuation crosses epochs
    s = _stream(tokens, 7)
    for _ in range(4):
        s.next_batch(12)
    state = s.state_dict()
    cont = [s.next_batch(12) for _ in range(6)]
    r = _stream(tokens, 7)
    r.load_state_dict(state)
    assert all(torch.equal(x, r.next_batch(12)) for x in cont)
    with pytest.raises(ValueError):
        _stream(tokens, 8).load_state_dict(state)  # different seed
    with pytest.raises(ValueError):
        _stream(tokens[:-SEQ], 7).load_state_dict(state)  # different data


def test_rank_split_union_equals_single_process(builtin):
    tokens = builtin.train.tokens[: 30 * SEQ + 1]
    single = _stream(tokens, 5)
    ranks = [_stream(tokens, 5, r, 2) for r in range(2)]
    for _ in range(5):  # 5 x 8 rows > 30: crosses an epoch boundary
        g = single.next_batch(8)
        parts = [s.next_batch(8) for s in ranks]
        assert all(p.shape == (4, SEQ + 1) for p in parts)
        assert torch.equal(torch.cat(parts), g)
    # the state is global: resuming a 2-rank run on 1 process continues the same global stream
    one = _stream(tokens, 5)
    one.load_state_dict(ranks[0].state_dict())
    assert torch.equal(one.next_batch(8), single.next_batch(8))
    with pytest.raises(ValueError):
        ranks[0].next_batch(7)


def test_streaming_packer_matches_and_resumes():
    tok = CharTokenizer()
    docs = _synthetic_docs(15)  # ~30 rows: the continuation below wraps around
    s = StreamingPackedStream(docs, tok, SEQ)
    got = torch.cat([s.next_batch(4) for _ in range(3)])
    expected = as_sequences(pack_documents(tok.encode_batch(docs), tok.eos_id), SEQ)[:12].to(torch.int64)
    assert torch.equal(got, expected)
    state = s.state_dict()
    cont = [s.next_batch(4) for _ in range(10)]  # runs past the end: restarts the source
    r = StreamingPackedStream(docs, tok, SEQ)
    r.load_state_dict(state)
    assert all(torch.equal(x, r.next_batch(4)) for x in cont)
    assert s.state_dict()["epoch"] >= 1


# ---------------------------------------------------------------- local files, errors, cache


def _write_fixtures(root):
    docs = _synthetic_docs(240, seed=1)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:80]))
    with gzip.open(root / "b.json.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d, "url": "x"}) + "\n" for d in docs[80:160])
    (root / "sub").mkdir()
    (root / "sub" / "c.txt").write_text("\n\n\n".join(docs[160:]) + "\n")
    return docs


def test_local_files(tmp_path, cache):
    docs = _write_fixtures(tmp_path)
    files, got = corpus.local_documents([tmp_path])
    assert [f.name for f in files] == ["a.jsonl", "b.json.gz", "c.txt"]
    assert got == docs
    # a multi-line .txt document stays one document until a blank line
    (tmp_path / "sub" / "d.txt").write_text("line one\nline two\n\n\nnext doc\n")
    assert list(corpus.iter_file_documents(tmp_path / "sub" / "d.txt")) == ["line one\nline two", "next doc"]
    b = build_data([str(tmp_path / "a.jsonl"), str(tmp_path / "b.json.gz"), str(tmp_path / "sub")],
                   seq_len=16, cache_dir=cache, val_tokens=64, vocab_size=300)
    assert b.val.shape == (4, 17) and b.tokenizer.vocab_size == 300
    assert "local" in b.description and b.train.next_batch(4).shape == (4, 17)


def test_first_training_of_the_bpe_is_announced_once(tmp_path, capsys):
    """Training the built-in BPE prints nothing itself, for seconds: with ``announce`` one line says what it
    trains on and roughly how long, once (the cached tokenizer is loaded silently); without it, nothing."""
    (tmp_path / "data").mkdir()
    docs = _write_fixtures(tmp_path / "data")
    mb = sum(len(d.encode()) for d in corpus.split_documents(docs, 0.05)[0]) / 1e6
    for cache in (tmp_path / "quiet", tmp_path / "told"):
        for _ in range(2):
            build_data(str(tmp_path / "data"), seq_len=16, cache_dir=cache, val_tokens=64, vocab_size=300,
                       announce=cache.name == "told")
    (bpe,) = (tmp_path / "told").glob("*/tokenizer-bpe300.json")
    assert capsys.readouterr().err.splitlines() == [
        f"meqmuon: training the built-in BPE tokenizer (300 ids) on {mb:.1f} MB of text, once: roughly a second "
        f"(~3 MB/s on 2 cores); cached in {bpe.parent}"]


def test_rough_duration():
    assert [tok_mod.rough_duration(s) for s in (0.2, 1.4, 8.3, 89, 91, 600)] == [
        "a second", "a second", "8 s", "89 s", "2 min", "10 min"]


def test_bad_paths_raise(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match="nope.jsonl"):
        build_data([str(missing)], cache_dir=tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt"):
        build_data(str(empty), cache_dir=tmp_path)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("")
    with pytest.raises(ValueError, match="blank.jsonl"):
        corpus.local_documents(blank)
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="d"):
        corpus.local_documents(tmp_path / "d")
    with pytest.raises(ValueError, match="tokenizer"):
        build_data("c4", cache_dir=tmp_path)


def test_cache_reused_and_val_identical(builtin, cache, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("cache miss: recomputed")

    monkeypatch.setattr(tok_mod, "train_bpe", boom)
    monkeypatch.setattr(data_mod, "encode_documents", boom)
    monkeypatch.setattr(data_mod, "make_val_set", boom)
    monkeypatch.setattr(prepare_mod, "_run_task", boom)
    again = build_data(None, seq_len=SEQ, seed=0, cache_dir=cache, val_tokens=4096, vocab_size=VOCAB)
    assert torch.equal(again.val, builtin.val) and again.val_bytes == builtin.val_bytes
    assert torch.equal(again.train.tokens, builtin.train.tokens)
    assert again.tokenizer.fingerprint == builtin.tokenizer.fingerprint
    # a different seed changes the train order, never the validation set
    other = build_data(None, seq_len=SEQ, seed=1, cache_dir=cache, val_tokens=4096, vocab_size=VOCAB)
    assert torch.equal(other.val, builtin.val)
    assert not torch.equal(other.train.next_batch(8), _stream(builtin.train.tokens, 0).next_batch(8))


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MEQMUON_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("MEQMUON_CACHE")
    assert cache_root().name == "meqmuon"


# ---------------------------------------------------------------- the stream before the prepared shards


def _digest_batches(bundle, global_batch, n):
    h = hashlib.sha256()
    for _ in range(n):
        h.update(bundle.train.next_batch(global_batch).numpy().tobytes())
    return h.hexdigest()[:16]


def _digest(t):
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


# Recorded with the in-memory pipeline of commit 9498201 (before the built-in corpus and local files went
# through prepared shards): the token stream, the sequence order (also per rank) and the validation set
# must not change, or the demo's losses would.
PINNED = {
    "builtin512": ("47a8a7b74af94d77", "068e5b96569cb922", 8081),
    "builtin512_rank1": "169a42cad117a322",
    "local": ("3f32c0ab43b13a25", "01345efa2372cca2", 347),
    "demo": ("11692a3dad46fcb4", "675f4147e8c5571c", 107140),
}


def test_builtin_and_local_streams_unchanged_by_prepared_shards(cache, tmp_path):
    b = build_data(None, seq_len=SEQ, seed=0, cache_dir=cache, val_tokens=4096, vocab_size=VOCAB)
    assert b.source == "builtin"
    assert (_digest_batches(b, 8, 20), _digest(b.val), b.val_bytes) == PINNED["builtin512"]
    r1 = build_data(None, seq_len=SEQ, seed=0, cache_dir=cache, val_tokens=4096, vocab_size=VOCAB, rank=1,
                    world_size=2)
    assert _digest_batches(r1, 8, 20) == PINNED["builtin512_rank1"]
    docs = _synthetic_docs(600, seed=5)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:300]))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[300:])
    loc = build_data(str(tmp_path), seq_len=16, seed=3, cache_dir=cache, val_tokens=128, vocab_size=300)
    assert loc.source == "local"
    assert (_digest_batches(loc, 8, 30), _digest(loc.val), loc.val_bytes) == PINNED["local"]
    assert list(cache.glob("local-*/prepared-*/manifest.json"))  # read through the prepared-shard code


def test_demo_stream_unchanged_by_prepared_shards(cache):
    # The demo's own setting (meqmuon compare: 4096-token BPE, 128-token rows, batch 32, 32,768 val tokens).
    b = build_data(None, seq_len=128, seed=0, cache_dir=cache, val_tokens=32768, vocab_size=4096)
    assert (_digest_batches(b, 32, 30), _digest(b.val), b.val_bytes) == PINNED["demo"]
    assert b.train.num_sequences == 3934 and b.val.shape == (235, 129)
