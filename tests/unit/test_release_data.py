"""Data prepared with a released tokenizer folder: ids equal transformers' AutoTokenizer /
apply_chat_template, masks equal the assistant spans, bad input is refused by file and line
with nothing written, and --show prints what trains."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from mpcore.data.chat import ChatRenderer
from mpcore.data.hf_encode import HFTokenizer
from mpcore.data.hf_folder import TokenizerFolder
from mpcore.data.indexed import IndexedDataset
from mpcore.data.loader import collate
from mpcore.data.sft_packing import SFTPackedDataset
from mpcore.launch import prepare_data
from mpcore.parallel.labels import IGNORE_INDEX, LabelShifter
from tests.unit.release_tokenizers import (
    CHAT,
    CHATML_TEMPLATE,
    make_chatml,
    make_llama,
    write_jsonl,
)


@pytest.fixture(scope="module", params=["chatml", "llama"])
def folder(request, tmp_path_factory):
    make = make_chatml if request.param == "chatml" else make_llama
    return make(tmp_path_factory.mktemp(request.param) / "release")


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = [*"ab cd\n\t  xyz.", "caf\u00e9", "\u4f60\u597d", "<|im_end|>", "</s>", "<s>",
                "\U0001F600", "123", " [INST]", "  def f():\n"]
    return [" leading", "a  b\n\n c"] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def test_text_ids_equal_autotokenizer(folder, tmp_path):
    texts = random_texts(200, seed=1)
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    assert prepare_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"),
                              "--tokenizer", str(folder / "tokenizer.json")]) == 0
    ds, hf = IndexedDataset(tmp_path / "out"), AutoTokenizer.from_pretrained(folder)
    assert len(ds) == len(texts)
    for d, text in enumerate(texts):
        assert ds[d].tolist() == hf(text)["input_ids"], text
    info = TokenizerFolder(folder)
    assert ds.meta["tokenizer"]["special_ids"] == {
        "bos": hf.bos_token_id, "eos": hf.eos_token_id, "pad": hf.pad_token_id}
    assert ds.meta["tokenizer"]["vocab_sha256"] == info.fingerprint["vocab_sha256"]
    assert ds.loss_mask is None


def assistant_texts(messages: list[dict], hf) -> list[str]:
    """What each assistant turn must train on, written independently of the renderer."""
    if "<|im_end|>" in hf.chat_template:
        return [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    # " content </s>"; decoding a run alone drops its leading space (the Strip decoder)
    return [m["content"] + " </s>" for m in messages if m["role"] == "assistant"]


def llama_rows():
    """The llama template has no tool role and takes the system turn first."""
    first = CHAT[0]["messages"]
    return [{"messages": first[:3] + [first[5], first[6]]}, CHAT[1], CHAT[2]]


def test_chat_ids_equal_apply_chat_template_and_masks_are_assistant_spans(folder, tmp_path):
    hf = AutoTokenizer.from_pretrained(folder)
    rows = CHAT if "<|im_end|>" in hf.chat_template else llama_rows()
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix",
                              str(tmp_path / "sft"), "--tokenizer", str(folder)]) == 0
    ds = IndexedDataset(tmp_path / "sft")
    assert ds.meta["kind"] == "chat" and ds.meta["doc_sources"] == [[0, 1], [0, 2], [0, 3]]
    for d, row in enumerate(rows):
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": row["completion"]}]
        ids, mask = ds[d].tolist(), ds.mask(d)
        assert ids == hf.apply_chat_template(messages, tokenize=True)["input_ids"]
        runs, k = [], 0
        while k < len(ids):
            j = k
            while j < len(ids) and mask[j] == mask[k]:
                j += 1
            if mask[k]:
                runs.append(hf.decode(ids[k:j]))
            k = j
        assert runs == assistant_texts(messages, hf)


def test_show_prints_score_schema_and_marked_text(folder, tmp_path):
    hf = AutoTokenizer.from_pretrained(folder)
    rows = CHAT[1:]
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    prefix = tmp_path / "sft"
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix", str(prefix),
                              "--tokenizer", str(folder)]) == 0
    out = io.StringIO()
    assert prepare_data.show(prefix, 1, False, out) == 1
    line = json.loads(out.getvalue())
    assert line["input_ids"] == IndexedDataset(prefix)[0].tolist()
    assert line["loss_mask"] == IndexedDataset(prefix).mask(0).tolist()
    out = io.StringIO()
    assert prepare_data.show(prefix, 10, True, out) == 2
    texts = [json.loads(x)["text"] for x in out.getvalue().splitlines()]
    marked = assistant_texts([{"role": "assistant", "content": rows[0]["completion"]}], hf)[0]
    assert f"[[{marked}]]" in texts[0] and texts[0].count("[[") == 1


def test_sft_packing_masks_travel_to_labels(tmp_path):
    folder = make_chatml(tmp_path / "release")
    rows = [CHAT[1], CHAT[2], CHAT[0], CHAT[2]]
    prefix = tmp_path / "sft"
    assert prepare_data.main(["--chat", "--input", str(write_jsonl(tmp_path / "c.jsonl", rows)),
                              "--output-prefix", str(prefix), "--tokenizer", str(folder)]) == 0
    ds, info = IndexedDataset(prefix), TokenizerFolder(folder)
    seq_len = int(ds.doc_lengths.max()) + 5
    packed = SFTPackedDataset(ds, seq_len, info.pad_fill_id)
    docs = [d for i in range(len(packed)) for d in
            range(int(packed.bounds[i]), int(packed.bounds[i + 1]))]
    assert docs == list(range(len(ds)))  # every conversation once, whole, in order
    batch = collate([packed[i] for i in range(len(packed))])
    labels = LabelShifter()(batch["input_ids"], batch["cu_seqlens"],
                            loss_mask=batch["loss_mask"])
    want = [int(ds.mask(d).sum()) - (1 if ds.mask(d)[0] else 0) for d in range(len(ds))]
    assert int((labels != IGNORE_INDEX).sum()) == sum(want)
    targets = batch["input_ids"][1:][labels[:-1] != IGNORE_INDEX]
    assert torch.equal(targets, labels[labels != IGNORE_INDEX])
    with pytest.raises(ValueError, match=r"c\.jsonl:3: the conversation has \d+ tokens.*"
                                         r"data\.sft_truncate"):
        SFTPackedDataset(ds, int(ds.doc_lengths[2]) - 1, info.pad_fill_id)
    cut = SFTPackedDataset(ds, int(ds.doc_lengths[2]) - 1, info.pad_fill_id, truncate=True)
    assert cut.num_truncated >= 1 and all(len(cut[i].input_ids) == cut.seq_len
                                          for i in range(len(cut)))


BAD_LINES = [
    ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
     r"bad\.jsonl:2: message 0 has role 'robot'"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "y"}]},
     r"bad\.jsonl:2: message 0 \(user\) has empty content"),
    ({"messages": [{"role": "user", "content": "only a question"}]},
     r"bad\.jsonl:2: no assistant turn"),
    ({"text": "plain"}, r"bad\.jsonl:2: expected a messages list"),
]


@pytest.mark.parametrize("row,error", BAD_LINES)
def test_bad_chat_lines_name_the_line_and_write_nothing(tmp_path, capsys, row, error):
    folder = make_chatml(tmp_path / "release")
    source = write_jsonl(tmp_path / "bad.jsonl", [CHAT[1], row])
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix",
                              str(tmp_path / "out"), "--tokenizer", str(folder)]) == 2
    assert __import__("re").search(error, capsys.readouterr().err)
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".out*"))


# Qwen3-style: earlier assistant turns lose their reasoning once a later turn follows.
DROPS_THINK = (
    "{%- for message in messages %}"
    "{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and not loop.last %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
NO_END = (
    "{%- for message in messages %}{{- message.role + ': ' + message.content + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")


@pytest.mark.parametrize("template,error", [
    (DROPS_THINK, r"c\.jsonl:1: .*renders assistant turn 1 differently"),
    (NO_END, r"c\.jsonl:1: assistant turn 0 ends without a special token"),
])
def test_templates_that_cannot_be_masked_are_refused(tmp_path, capsys, template, error):
    folder = make_chatml(tmp_path / "release", template=template)
    row = {"messages": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                        {"role": "user", "content": "and 3+3?"},
                        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n6"}]}
    source = write_jsonl(tmp_path / "c.jsonl", [row])
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix",
                              str(tmp_path / "out"), "--tokenizer", str(folder)]) == 2
    assert __import__("re").search(error, capsys.readouterr().err)
    assert not list(tmp_path.glob("out*"))


def test_folder_without_tokenizer_json_is_refused(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    assert prepare_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"),
                              "--tokenizer", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "ckpt has no tokenizer.json" in err and "--train-tokenizer" in err
    assert not list(tmp_path.glob("out*"))


def test_chat_longer_than_seq_len_is_refused_at_prepare(tmp_path, capsys):
    folder = make_chatml(tmp_path / "release")
    source = write_jsonl(tmp_path / "c.jsonl", [CHAT[1], CHAT[0]])
    assert prepare_data.main(["--chat", "--seq-len", "40", "--input", str(source),
                              "--output-prefix", str(tmp_path / "out"), "--tokenizer",
                              str(folder)]) == 2
    assert "c.jsonl:2: the conversation has" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))


def test_renderer_agrees_with_transformers_on_generation_prompt(tmp_path):
    tok = HFTokenizer(make_chatml(tmp_path / "release"))
    messages = CHAT[0]["messages"]
    text, spans = ChatRenderer(tok).spans(messages, "x:1")
    assert text == tok.hf.apply_chat_template(messages, tokenize=False)
    assert [text[a:b] for a, b in spans] == [
        m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
    assert np.all(np.diff([a for a, _ in spans]) > 0)


def test_split_rewritten_gives_one_document_per_assistant_turn(tmp_path):
    folder = make_chatml(tmp_path / "release", template=DROPS_THINK)
    hf = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                {"role": "user", "content": "and 3+3?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n6"}]
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])
    assert prepare_data.main(["--chat", "--chat-split-rewritten", "--input", str(source),
                              "--output-prefix", str(tmp_path / "out"), "--tokenizer",
                              str(folder)]) == 0
    ds = IndexedDataset(tmp_path / "out")
    assert len(ds) == 2 and ds.meta["doc_sources"] == [[0, 1], [0, 1]]
    for d, upto in enumerate((2, 4)):
        ids = ds[d].tolist()
        assert ids == hf.apply_chat_template(messages[:upto], tokenize=True)["input_ids"]
        trained = hf.decode([i for i, m in zip(ids, ds.mask(d), strict=True) if m])
        assert trained == messages[upto - 1]["content"] + "<|im_end|>"
    assert "<think>" not in hf.decode(ds[1].tolist()).split("and 3+3?")[0]  # as generated


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_any_text_encodes_as_autotokenizer(folder, text):
    tok, hf = hf_pair(folder)
    assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.encode_batch([text, text + " x"]) == [hf(text)["input_ids"],
                                                     hf(text + " x")["input_ids"]]


_LOADED: dict = {}


def hf_pair(folder):
    """``(HFTokenizer, AutoTokenizer)`` of ``folder``, loaded once per folder."""
    if folder not in _LOADED:
        _LOADED[folder] = (HFTokenizer(folder), AutoTokenizer.from_pretrained(folder))
    return _LOADED[folder]


def test_tools_and_tool_calls_render_as_apply_chat_template(tmp_path):
    folder = make_chatml(tmp_path / "release")
    hf = AutoTokenizer.from_pretrained(folder)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Checking.",
                 "tool_calls": [{"type": "function", "function": {
                     "name": "weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "21 C"},
                {"role": "assistant", "content": "It is 21 C."}]
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages, "tools": tools}])
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix",
                              str(tmp_path / "out"), "--tokenizer", str(folder)]) == 0
    ds = IndexedDataset(tmp_path / "out")
    want = hf.apply_chat_template(messages, tools=tools, tokenize=True)["input_ids"]
    assert ds[0].tolist() == want and "# Tools" in hf.decode(want)
    trained = hf.decode([i for i, m in zip(ds[0].tolist(), ds.mask(0), strict=True) if m])
    assert trained == "Checking.<|im_end|>It is 21 C.<|im_end|>"
    bad = write_jsonl(tmp_path / "b.jsonl", [{"messages": messages, "tools": "weather"}])
    assert prepare_data.main(["--chat", "--input", str(bad), "--output-prefix",
                              str(tmp_path / "bad"), "--tokenizer", str(folder)]) == 2
    assert not list(tmp_path.glob("bad*"))


def test_a_default_system_prompt_is_never_trained(tmp_path, capsys):
    """A template that adds a system prompt (Qwen2.5's): only the assistant turns train, not
    the prompt the template wrote; a conversation opening with the assistant is refused
    (transformers renders no empty conversation, so its head cannot be found)."""
    default = ("{%- if not messages or messages[0].role != 'system' %}"
               "{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}")
    folder = make_chatml(tmp_path / "release", template=default + CHATML_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix",
                              str(tmp_path / "out"), "--tokenizer", str(folder)]) == 0
    ds = IndexedDataset(tmp_path / "out")
    assert ds[0].tolist() == hf.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert "You are Qwen." in hf.decode(ds[0].tolist())
    trained = hf.decode([i for i, m in zip(ds[0].tolist(), ds.mask(0), strict=True) if m])
    assert trained == "Hi!<|im_end|>"
    opening = write_jsonl(tmp_path / "o.jsonl", [{"messages": messages[1:] + messages}])
    assert prepare_data.main(["--chat", "--input", str(opening), "--output-prefix",
                              str(tmp_path / "o"), "--tokenizer", str(folder)]) == 2
    assert "o.jsonl:1: the conversation opens with an assistant turn" in capsys.readouterr().err
