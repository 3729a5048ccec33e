"""Data pipeline: indexed files, packing, blending, loader, tokenizer, default corpus, CLI."""

import io
import json
import re
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcore.data import (
    BlendedDataset,
    DataLoader,
    IndexedDataset,
    IndexedWriter,
    PackedDataset,
    Tokenizer,
    collate,
    iter_documents,
    prepare_default,
    train_tokenizer,
)
from mpcore.data import corpus as corpus_mod
from mpcore.data.blend import blend_counts
from mpcore.data.indexed import Progress
from mpcore.launch import prepare_data
from mpcore.progress import ProgressBar
from tests.unit.release_tokenizers import make_release

CORPUS = corpus_mod.DEFAULT_CORPUS


def corpus_docs(n):
    return [d for d, _ in zip(iter_documents([CORPUS]), range(n), strict=False)]


def write(prefix, docs, vocab_size, progress=False):
    with IndexedWriter(prefix, vocab_size, progress=progress) as w:
        for d in docs:
            w.add(d)
    return IndexedDataset(prefix)


def random_docs(rng, n, vocab_size, max_len=40):
    return [rng.integers(0, vocab_size, rng.integers(0, max_len)) for _ in range(n)]


# ---- indexed dataset ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "vocab_size,dtype", [(1000, np.uint16), (2**16, np.uint16), (70000, np.uint32)]
)
def test_indexed_round_trip(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(1)
    docs = random_docs(rng, 50, vocab_size) + [np.array([vocab_size - 1])]
    ds = write(tmp_path / "d", docs, vocab_size)
    assert ds.dtype == dtype and ds.tokens.dtype == dtype
    assert len(ds) == len(docs) and ds.vocab_size == vocab_size
    assert ds.max_token_id == max(int(d.max()) for d in docs if len(d))
    for d, ref in zip(range(len(ds)), docs, strict=True):
        np.testing.assert_array_equal(ds[d], ref)
    np.testing.assert_array_equal(ds.doc_lengths, [len(d) for d in docs])
    assert not list(tmp_path.glob("*.tmp"))


def test_indexed_streaming_many_docs(tmp_path, capsys):
    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 30, 20000)
    with IndexedWriter(tmp_path / "big", 500, progress=True) as w:
        for n in lengths:
            w.add(np.full(n, n % 500))
    ds = IndexedDataset(tmp_path / "big")
    np.testing.assert_array_equal(ds.offsets, np.concatenate(([0], np.cumsum(lengths))))
    for d in rng.integers(0, len(lengths), 50):
        assert len(ds[d]) == lengths[d] and np.all(ds[d] == lengths[d] % 500)
    assert f"{len(lengths):,} docs" in capsys.readouterr().err


def test_progress_line():
    out = io.StringIO()
    Progress("x", stream=out).update(3, 1234, force=True)
    assert out.getvalue().startswith("x: 3 docs, 1,234 tokens")


def test_indexed_bad_files(tmp_path):
    with pytest.raises(ValueError, match="nothere.idx does not exist"):
        IndexedDataset(tmp_path / "nothere")
    write(tmp_path / "d", [np.arange(10), np.arange(5)], 100)
    idx, binf = (tmp_path / "d.idx").read_bytes(), (tmp_path / "d.bin").read_bytes()

    def check(idx_bytes, bin_bytes, pattern):
        (tmp_path / "e.idx").write_bytes(idx_bytes)
        (tmp_path / "e.bin").write_bytes(bin_bytes)
        with pytest.raises(ValueError, match=pattern):
            IndexedDataset(tmp_path / "e")

    check(b"NOTMAGIC" + idx[8:], binf, r"e\.idx is not an mpcore indexed dataset")
    check(idx[:20], binf, r"e\.idx is not an mpcore")
    check(idx[:8] + struct.pack("<I", 9) + idx[12:], binf, r"e\.idx has format version 9")
    check(idx, binf[:-2], r"e\.bin is truncated")
    check(idx[:-8], binf, r"e\.idx is truncated")


def test_writer_rejects_bad_ids_and_cleans_up(tmp_path):
    with pytest.raises(ValueError, match="token id 100 outside"):
        write(tmp_path / "w", [np.arange(5), np.array([3, 100])], 100)
    with pytest.raises(ValueError, match="token id -1 outside"):
        write(tmp_path / "w", [np.array([-1])], 100)
    assert not list(tmp_path.iterdir())


def test_check_vocab_names_file_value_and_fix(tmp_path):
    ds = write(tmp_path / "c", [np.array([5, 5000, 7])], 70000)
    ds.check_vocab(5001)
    ds.check_vocab(5001, scan=True)
    with pytest.raises(ValueError) as e:
        ds.check_vocab(4096, scan=True)
    msg = str(e.value)
    assert "c.bin" in msg and "5000" in msg and "4096" in msg and "model.vocab_size >= 5001" in msg


# ---- packing ------------------------------------------------------------------------------


def reference_packing(docs, seq_len, eos):
    """Independent reference: per-token document id over the stream, segments where it changes."""
    stream = np.concatenate([np.append(d, eos) for d in docs]).astype(np.int64)
    doc_id = np.concatenate([np.full(len(d) + 1, k) for k, d in enumerate(docs)])
    out = []
    for i in range(len(stream) // seq_len):
        sl = slice(i * seq_len, (i + 1) * seq_len)
        ids, dids = stream[sl], doc_id[sl]
        starts = [0] + [t for t in range(1, seq_len) if dids[t] != dids[t - 1]]
        pos = np.zeros(seq_len, np.int64)
        for t in range(1, seq_len):
            pos[t] = 0 if dids[t] != dids[t - 1] else pos[t - 1] + 1
        out.append((ids, np.array(starts + [seq_len]), pos))
    return out


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=25),
    seq_len=st.integers(1, 17),
    seed=st.integers(0, 2**16),
)
def test_packing_invariants(lengths, seq_len, seed):
    rng = np.random.default_rng(seed)
    vocab, eos = 50, 2
    docs = [rng.integers(3, vocab, n) for n in lengths]
    ref = reference_packing(docs, seq_len, eos)
    with tempfile.TemporaryDirectory() as tmp:
        ds = write(Path(tmp) / "p", docs, vocab)
        if not ref:
            with pytest.raises(ValueError, match="fewer than one sample"):
                PackedDataset(ds, seq_len, eos)
            return
        packed = PackedDataset(ds, seq_len, eos)
        assert len(packed) == len(ref)
        for i, (ids, cu, pos) in enumerate(ref):
            s = packed[i]
            assert s.input_ids.dtype == np.int64 and s.input_ids.shape == (seq_len,)
            assert s.cu_seqlens.dtype == np.int32 and s.position_ids.dtype == np.int64
            np.testing.assert_array_equal(s.input_ids, ids)
            np.testing.assert_array_equal(s.cu_seqlens, cu)
            np.testing.assert_array_equal(s.position_ids, pos)
        # every token exactly once, in order: the samples concatenated are the stream prefix
        flat = np.concatenate([packed[i].input_ids for i in range(len(packed))])
        stream = np.concatenate([np.append(d, eos) for d in docs])
        np.testing.assert_array_equal(flat, stream[: len(flat)])


def test_packing_rejects_bad_eos(tmp_path):
    ds = write(tmp_path / "p", [np.arange(10)], 10)
    with pytest.raises(ValueError, match="eos_id 10 is outside"):
        PackedDataset(ds, 4, 10)


# ---- blending -----------------------------------------------------------------------------


def test_blend_proportions_and_determinism():
    datasets = [
        [("a", i) for i in range(7)],
        [("b", i) for i in range(300)],
        [("c", i) for i in range(50)],
    ]
    weights = [0.5, 0.3, 0.2]
    blend = BlendedDataset(datasets, weights, seed=3, num_samples=1000)
    counts = np.bincount(blend.dataset_index, minlength=3)
    np.testing.assert_array_equal(counts, [500, 300, 200])
    for j in (10, 97, 333, 1000):  # every prefix follows the weights
        frac = np.bincount(blend.dataset_index[:j], minlength=3) / j
        assert np.all(np.abs(frac - weights) <= 2 / j), (j, frac)
    for j in range(0, 1000, 37):
        assert blend[j] == datasets[blend.dataset_index[j]][blend.sample_index[j]]
    # dataset 0 (7 samples) is upsampled: each full pass covers it exactly once
    picks = blend.sample_index[blend.dataset_index == 0]
    for p in range(500 // 7):
        assert sorted(picks[p * 7 : (p + 1) * 7]) == list(range(7))
    again = BlendedDataset(datasets, weights, seed=3, num_samples=1000)
    np.testing.assert_array_equal(again.sample_index, blend.sample_index)
    other = BlendedDataset(datasets, weights, seed=4, num_samples=1000)
    assert not np.array_equal(other.sample_index, blend.sample_index)


def test_blend_counts_and_errors():
    c = blend_counts([1, 1, 1], 10)
    assert c.sum() == 10 and c.max() - c.min() == 1
    assert len(BlendedDataset([[1, 2], [3]], [1, 1], seed=0)) == 3
    with pytest.raises(ValueError, match="non-negative"):
        blend_counts([1, -1], 10)
    with pytest.raises(ValueError, match="2 datasets but 1 blend weights"):
        BlendedDataset([[1], [2]], [1.0], seed=0)


# ---- loader -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    rng = np.random.default_rng(5)
    docs = [rng.integers(3, 300, n) for n in rng.integers(1, 30, 400)]
    ds = write(tmp_path_factory.mktemp("loader") / "l", docs, 300)
    packed = PackedDataset(ds, 16, 2)
    # which sample a row of tokens is (the random samples are all distinct)
    packed.table = {packed[i].input_ids.tobytes(): i for i in range(len(packed))}
    assert len(packed.table) == len(packed)
    return packed


def sample_ids(batch, packed):
    """Recover which samples a micro-batch holds by matching their tokens."""
    table = packed.table
    rows = batch["input_ids"].numpy().reshape(-1, packed.seq_len)
    return [table[r.tobytes()] for r in rows]


def test_loader_ranks_disjoint_and_cover_global_batch(packed):
    micro, accum = 2, 3
    for dp in (1, 2, 3):
        loaders = [DataLoader(packed, micro, accum, dp, r, seed=7) for r in range(dp)]
        gb = micro * accum * dp
        seen = []
        for step in range(loaders[0].steps_per_epoch):
            per_rank = [
                [i for b in ld.next_step() for i in sample_ids(b, packed)] for ld in loaders
            ]
            flat = [i for r in per_rank for i in r]
            assert len(set(flat)) == gb  # disjoint
            order = loaders[0].order(0)
            assert sorted(flat) == sorted(order[step * gb : (step + 1) * gb])
            seen += flat
        assert len(set(seen)) == len(seen) == loaders[0].steps_per_epoch * gb
        # the next step starts epoch 1, in a new order, rank-strided as documented
        order = loaders[0].order(1)
        assert not np.array_equal(order, loaders[0].order(0))
        for r, ld in enumerate(loaders):
            mine = order[:gb][r::dp]
            for m in range(accum):
                assert sample_ids(next(ld), packed) == list(mine[m * micro : (m + 1) * micro])


def test_loader_same_global_batch_under_other_split(packed):
    a = DataLoader(packed, 2, 1, 2, 0, seed=1), DataLoader(packed, 2, 1, 2, 1, seed=1)
    b = DataLoader(packed, 2, 2, 1, 0, seed=1)
    for _ in range(5):
        ids_a = sorted(i for ld in a for m in ld.next_step() for i in sample_ids(m, packed))
        ids_b = sorted(i for m in b.next_step() for i in sample_ids(m, packed))
        assert ids_a == ids_b


def test_loader_seed_determinism_and_collate(packed):
    a, b = DataLoader(packed, 3, 1, 1, 0, seed=11), DataLoader(packed, 3, 1, 1, 0, seed=11)
    c = DataLoader(packed, 3, 1, 1, 0, seed=12)
    ba, bb, bc = next(a), next(b), next(c)
    for key in ba:
        assert ba[key].equal(bb[key])
    assert not ba["input_ids"].equal(bc["input_ids"])
    samples = [packed[i] for i in sample_ids(ba, packed)]
    assert ba["input_ids"].dtype == torch.int64 and ba["input_ids"].shape == (48,)
    assert ba["cu_seqlens"].dtype == torch.int32 and ba["position_ids"].dtype == torch.int64
    cu = np.unique(np.concatenate([s.cu_seqlens + 16 * k for k, s in enumerate(samples)]))
    np.testing.assert_array_equal(ba["cu_seqlens"].numpy(), cu)
    for key in ("input_ids", "position_ids"):
        ref = np.concatenate([getattr(s, key) for s in samples])
        np.testing.assert_array_equal(ba[key].numpy(), ref)
    assert collate(samples)["cu_seqlens"].equal(ba["cu_seqlens"])


def test_loader_resume_gives_same_batches(packed):
    micro, accum, dp = 2, 2, 2
    straight = DataLoader(packed, micro, accum, dp, 1, seed=3)
    per_epoch = straight.steps_per_epoch * accum
    run = DataLoader(packed, micro, accum, dp, 1, seed=3)
    for stop in (3, per_epoch - 1, per_epoch + 2):  # mid-epoch, just before and after a wrap
        fresh = DataLoader(packed, micro, accum, dp, 1, seed=3)
        for _ in range(stop):
            next(run)
        fresh.load_state_dict(json.loads(json.dumps(run.state_dict())))
        ref = [next(run) for _ in range(per_epoch + 1)]
        got = [next(fresh) for _ in range(per_epoch + 1)]
        for x, y in zip(ref, got, strict=True):
            assert all(x[k].equal(y[k]) for k in x)
        run = DataLoader(packed, micro, accum, dp, 1, seed=3)
    # the straight run differs from a shifted one (the comparison above can fail)
    shifted = DataLoader(packed, micro, accum, dp, 1, seed=3)
    next(shifted)
    assert not next(straight)["input_ids"].equal(next(shifted)["input_ids"])


def test_loader_state_errors(packed):
    ld = DataLoader(packed, 2, 1, 1, 0, seed=3)
    with pytest.raises(ValueError, match="seed=4"):
        ld.load_state_dict({**ld.state_dict(), "seed": 4})
    with pytest.raises(ValueError, match="not a multiple"):
        ld.load_state_dict({**ld.state_dict(), "consumed": 3})
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DataLoader(packed, len(packed), 1, 2, 0, seed=0)
    with pytest.raises(ValueError, match="dp_rank 2"):
        DataLoader(packed, 1, 1, 2, 2, seed=0)


# ---- tokenizer and text sources -----------------------------------------------------------


def test_tokenizer_train_deterministic_and_round_trip(tmp_path):
    docs = corpus_docs(300)
    a = train_tokenizer(iter(docs), tmp_path / "a.model", 400)
    b = train_tokenizer(iter(docs), tmp_path / "b.model", 400)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert a.vocab_size == 400 and (a.bos_id, a.eos_id) == (1, 2)
    text = "def f(x):\n    return x  # caf\u00e9 \u4e2d\n\n\tend"
    ids = a.encode(text)
    assert ids == b.encode(text) == Tokenizer(tmp_path / "b.model").encode(text)
    assert max(ids) < 400
    assert a.decode(ids) == text
    assert a.encode_batch(docs[:3]) == [a.encode(d) for d in docs[:3]]


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match=r"tok\.model does not exist.*prepare_data\.py"):
        Tokenizer(tmp_path / "tok.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="junk.model is not a SentencePiece model"):
        Tokenizer(tmp_path / "junk.model")
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(["abc"], tmp_path / "t.model", 100)


def test_iter_documents(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n\n\nthree\n  \nfour")
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n\n{"body": ""}\n{"body": "y\\nz"}\n')
    got = list(iter_documents([tmp_path / "a.txt", tmp_path / "b.jsonl"], text_key="body"))
    assert got == ["one\ntwo", "three", "four", "x", "y\nz"]
    with pytest.raises(ValueError, match=r"b\.jsonl:1: expected a JSON object with a 'text'"):
        list(iter_documents([tmp_path / "b.jsonl"]))
    with pytest.raises(ValueError, match="nope.txt does not exist"):
        list(iter_documents([tmp_path / "nope.txt"]))


# ---- default corpus and CLI ---------------------------------------------------------------


def test_prepare_default_works_and_is_cached(tmp_path, monkeypatch):
    model, prefix = prepare_default(tmp_path, vocab_size=512)
    tok, ds = Tokenizer(model), IndexedDataset(prefix)
    first = next(iter_documents([CORPUS]))
    assert tok.vocab_size == 512 and ds.vocab_size == 512 and ds.dtype == np.uint16
    assert len(ds) == sum(1 for _ in iter_documents([CORPUS]))
    assert tok.decode(ds[0]) == first
    stamp = (tmp_path / "default_v512.fingerprint").read_text()
    model_bytes = model.read_bytes()

    def boom(*args, **kwargs):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(corpus_mod, "train_tokenizer", boom)
    assert prepare_default(tmp_path, vocab_size=512) == (model, prefix)
    monkeypatch.undo()
    (tmp_path / "default_v512.fingerprint").write_text("stale")
    assert prepare_default(tmp_path, vocab_size=512) == (model, prefix)  # rebuilt, same bytes
    assert model.read_bytes() == model_bytes
    assert (tmp_path / "default_v512.fingerprint").read_text() == stamp


def test_preparing_the_default_corpus_says_so_once_with_its_time(tmp_path, capsys):
    prepare_default(tmp_path, vocab_size=512)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1, said
    want = (rf"prepared the default corpus in {re.escape(str(tmp_path))} \(first use\): "
            rf"tokenizer default_v512.model and \d+ documents in \d+\.\d s; later runs reuse it")
    assert re.fullmatch(want, said[0]), said[0]
    prepare_default(tmp_path, vocab_size=512)
    assert capsys.readouterr().out == ""  # the cache: nothing to say
    (tmp_path / "default_v512.fingerprint").write_text("stale")
    prepare_default(tmp_path, vocab_size=512)
    assert "(its cache there did not match, rebuilt)" in capsys.readouterr().out


def test_prepare_data_cli(tmp_path, capsys):
    docs = corpus_docs(200)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:150]))
    (tmp_path / "b.txt").write_text("\n\n".join(docs[150:]))
    inputs = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")]
    rc = prepare_data.main(
        ["--input", *inputs, "--output-prefix", str(tmp_path / "out"),
         "--train-tokenizer", str(tmp_path / "t.model"), "--vocab-size", "400"]
    )  # fmt: skip
    assert rc == 0
    ds, tok = IndexedDataset(tmp_path / "out"), Tokenizer(tmp_path / "t.model")
    expected = list(iter_documents(inputs))
    assert len(ds) == len(expected) >= 200
    assert all(tok.decode(ds[d]) == expected[d] for d in (0, 149, len(ds) - 1))
    rc = prepare_data.main(
        ["--input", inputs[0], "--output-prefix", str(tmp_path / "out2"),
         "--tokenizer", str(tmp_path / "t.model")]
    )  # fmt: skip
    assert rc == 0 and np.array_equal(IndexedDataset(tmp_path / "out2")[3], ds[3])
    rc = prepare_data.main(
        ["--input", inputs[0], "--output-prefix", str(tmp_path / "o3"),
         "--tokenizer", str(tmp_path / "missing.model")]
    )  # fmt: skip
    assert rc == 2 and "missing.model does not exist" in capsys.readouterr().err
    assert not list(tmp_path.glob("o3*"))


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=2, max_size=25),
       seq_len=st.integers(1, 9), seed=st.integers(0, 2**16), cut=st.floats(0.05, 0.95))
def test_packing_a_document_range_holds_only_those_documents(lengths, seq_len, seed, cut):
    """The training split (docs[:k]) and the held-out split (docs[k:]) of data.valid_fraction
    pack exactly their own documents, so no held-out token is trained on."""
    rng = np.random.default_rng(seed)
    vocab, eos = 50, 2
    docs = [rng.integers(3, vocab, n) for n in lengths]
    k = max(1, min(len(docs) - 1, int(cut * len(docs))))
    with tempfile.TemporaryDirectory() as tmp:
        ds = write(Path(tmp) / "p", docs, vocab)
        for part, (lo, hi) in ((docs[:k], (0, k)), (docs[k:], (k, len(docs)))):
            ref = reference_packing(part, seq_len, eos)
            if not ref:
                with pytest.raises(ValueError, match=f"documents {lo} to {hi - 1}"):
                    PackedDataset(ds, seq_len, eos, docs=(lo, hi))
                continue
            packed = PackedDataset(ds, seq_len, eos, docs=(lo, hi))
            assert (packed.num_docs, packed.num_tokens) == (hi - lo, sum(map(len, part)))
            assert len(packed) == len(ref)
            for i, (ids, cu, pos) in enumerate(ref):
                np.testing.assert_array_equal(packed[i].input_ids, ids)
                np.testing.assert_array_equal(packed[i].cu_seqlens, cu)
                np.testing.assert_array_equal(packed[i].position_ids, pos)


def test_tokenizer_on_an_empty_corpus_names_the_input(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n\n')
    # The documents' reader names the input first; a plain iterable, the trainer itself.
    with pytest.raises(ValueError, match=r"no documents in .*empty\.jsonl: empty"):
        train_tokenizer(iter_documents([empty]), tmp_path / "tok.model", 512,
                        source=f"the input {empty}")
    with pytest.raises(ValueError, match=r"no text to train the tokenizer .*tok\.model on: "
                                         r"the input .*empty\.jsonl hold no non-empty document"):
        train_tokenizer(iter([]), tmp_path / "tok.model", 512, source=f"the input {empty}")
    assert prepare_data.main(["--input", str(empty), "--output-prefix", str(tmp_path / "out"),
                 "--train-tokenizer", str(tmp_path / "tok.model"), "--vocab-size", "512"]) == 2
    assert not (tmp_path / "tok.model").exists()


def test_progress_bar_lines(tmp_path):
    stream = io.StringIO()
    bar = ProgressBar("tokenizing x", 4e6, "MB", stream=stream)
    for _ in range(8):
        bar.advance(0.5e6)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[##.......") and "12%  tokenizing x  0.5/4.0 MB" in lines[0]
    assert lines[-1].startswith("[####################] 100%") and lines[-1].endswith("done")
    assert len(lines) <= 11  # not a terminal: one line per tenth at most


def test_an_input_without_documents_or_not_utf8_is_refused_by_file_and_line(tmp_path):
    """Issue 39: an empty .txt / .jsonl was prepared as "0 documents" (rc 0, the failure came
    at training), and a file that is not UTF-8 stopped with the codec's message, no file or
    line. Now both are errors before anything is committed."""
    (tmp_path / "empty.txt").write_text("\n  \n\n")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match=r"no documents in .*empty\.txt, .*empty\.jsonl"):
        list(iter_documents([tmp_path / "empty.txt", tmp_path / "empty.jsonl"]))
    (tmp_path / "latin1.txt").write_bytes("first line\ncaf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt:2: not UTF-8 text \(byte 0xe9 at "
                                         r"column 4\); convert the file to UTF-8"):
        list(iter_documents([tmp_path / "latin1.txt"]))
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "ok"}\n{"text": "caf\u00e9"}\n'
                                            .encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8"):
        list(iter_documents([tmp_path / "latin1.jsonl"]))
    release = make_release(tmp_path / "release")
    for name in ("empty.txt", "latin1.txt"):
        code = prepare_data.main(["--input", str(tmp_path / name), "--output-prefix",
                                  str(tmp_path / "out"), "--tokenizer", str(release)])
        assert code == 2
    assert not list(tmp_path.glob("out*")), "a dataset was committed"
