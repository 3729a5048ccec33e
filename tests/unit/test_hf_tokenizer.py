"""The Hugging Face tokenizer files: transformers' AutoTokenizer gives our SentencePiece ids."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpcore.data import prepare_default
from mpcore.data.corpus import DEFAULT_CORPUS
from mpcore.data.hf_tokenizer import read_sp_model, unsupported_reason
from mpcore.data.tokenizer import Tokenizer, iter_documents, train_tokenizer
from mpcore.data.vl_tokenizer import VLTokenizer

transformers = pytest.importorskip("transformers", reason="the dev extra brings transformers")

TRICKY = [
    "", " ", "  ", "hello", " hello", "   hello", "\nhello", "\n", "\n\n", "a\nb", "a\n\nb",
    "x \n y", "trailing ", "tab\there", "\r\n", "12345 678", "3.14159", "0x1F 2e-5",
    "caf\u00e9 na\u00efve", "\u65e5\u672c\u8a9e\u306e\u6587", "emoji \U0001F600!",
    "\u00a0nbsp", "</s> <s> <unk>", "<0x41>", "def f(x):\n    return x  # c\n", "x" * 80,
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return prepare_default(tmp_path_factory.mktemp("data"), 512)[0]


def _load(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_auto_tokenizer_matches_on_the_corpus_and_tricky_text(model, tmp_path):
    tok = Tokenizer(model)
    written = tok.write_hf_tokenizer(tmp_path)
    assert sorted(p.name for p in written) == sorted(
        ["tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    hf = _load(tmp_path)
    docs = list(iter_documents([DEFAULT_CORPUS]))
    assert len(docs) > 1000
    assert hf(docs)["input_ids"] == tok.encode_batch(docs)
    for text in TRICKY:
        ids = tok.encode(text)
        assert hf(text)["input_ids"] == ids, repr(text)
        assert hf.decode(ids) == tok.decode(ids), repr(text)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id,
                                                                   tok.eos_id)
    assert len(hf) == tok.vocab_size


def test_the_shipped_default_vocabulary_matches_on_the_corpus(tmp_path):
    """data.default_vocab_size's default (2048): the tokenizer a first run trains."""
    tok = Tokenizer(prepare_default(tmp_path / "data", 2048)[0])
    tok.write_hf_tokenizer(tmp_path / "hf")
    hf = _load(tmp_path / "hf")
    docs = list(iter_documents([DEFAULT_CORPUS]))
    assert hf(docs)["input_ids"] == tok.encode_batch(docs)
    assert all(hf(t)["input_ids"] == tok.encode(t) for t in TRICKY)


def test_a_retrained_model_with_other_merges_matches_too(tmp_path):
    """Another corpus and vocabulary: the merges are derived, not fixed to the default model."""
    docs = [f"Line {i}: the {i % 7} quick brown foxes jump over {i * 31} lazy dogs.\n  indent"
            for i in range(300)]
    tok = train_tokenizer(docs, tmp_path / "m.model", 300)
    tok.write_hf_tokenizer(tmp_path / "hf")
    hf = _load(tmp_path / "hf")
    for text in [*docs[:50], *TRICKY]:
        assert hf(text)["input_ids"] == tok.encode(text), repr(text)


def test_vl_tokens_are_added_tokens_with_our_ids(model, tmp_path):
    tok = VLTokenizer(model)
    tok.write_hf_tokenizer(tmp_path)
    hf = _load(tmp_path)
    assert len(hf) == tok.vocab_size
    names = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    assert hf.convert_tokens_to_ids(names) == list(tok.token_ids().values())
    # Text around the placeholders is encoded piece by piece, as mpcore.data.vl_dataset does
    # (each piece with its own dummy prefix).
    text = "a picture <|vision_start|><|image_pad|><|image_pad|><|vision_end|> of a cat"
    run = [tok.vision_start_id, tok.image_pad_id, tok.image_pad_id, tok.vision_end_id]
    assert hf(text)["input_ids"] == tok.encode("a picture ") + run + tok.encode(" of a cat")
    for t in TRICKY[:10]:
        assert hf(t)["input_ids"] == tok.encode(t)


def test_a_model_that_cannot_be_mirrored_is_refused_by_name(model, tmp_path):
    import sentencepiece as spm

    with open(tmp_path / "u.model", "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(["some words to learn from"] * 50), model_writer=f,
            vocab_size=16, model_type="unigram", minloglevel=2)
    assert unsupported_reason(tmp_path / "u.model") == "it is not a BPE model"
    with pytest.raises(ValueError, match=r"u\.model: cannot write an exact tokenizer.json"):
        Tokenizer(tmp_path / "u.model").write_hf_tokenizer(tmp_path / "out")
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert unsupported_reason(model) is None
    pieces, _, _ = read_sp_model(model)
    assert [p for p, _, _ in pieces] == [Tokenizer(model)._sp.id_to_piece(i) for i in range(512)]


def test_config_names_the_generic_class(model, tmp_path):
    Tokenizer(model).write_hf_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["add_bos_token"] is False and config["split_special_tokens"] is True


@pytest.fixture(scope="module")
def pair(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(model)
    tok.write_hf_tokenizer(folder)
    return tok, _load(folder)


# Any text, weighted towards what breaks tokenizers: spaces, newlines, digits, accents, CJK,
# emoji, control characters, and the specials' spellings.
PIECES = st.sampled_from([" ", "  ", "\n", "\t", "\r", "0", "42", "\u00e9", "\u65e5", "\U0001F600",
                          "\x00", "</s>", "<s>", "\u2581", "the", "ing", "def", "_", "."])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(PIECES, st.text(max_size=6)), max_size=12).map("".join))
def test_random_text_gives_the_same_ids(pair, text):
    tok, hf = pair
    assert hf(text)["input_ids"] == tok.encode(text)
