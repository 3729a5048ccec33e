"""VL conversations prepared with a released VL checkpoint's folder (tiny releases made here,
``vl_releases``), for each VL family: the prepared ids, pixel rows and grids equal what
transformers' processor of the release + ``apply_chat_template`` give on the same messages, the
vision ids are the release's own (inside its vocabulary), the mask covers exactly the assistant
tokens, meta.json records the tokenizer by content; bad input is refused by file and line with
nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpcore.data import VLDataset
from mpcore.data.hf_folder import TokenizerFolder
from mpcore.launch import prepare_vl_data
from tests.unit.release_tokenizers import make_release as make_text_release
from tests.unit.vl_releases import ARCHES, FAMILY, hf_processor, make_release


def write_images(folder: Path) -> None:
    rng = np.random.default_rng(7)
    for name, (h, w) in {"a.png": (37, 53), "b.jpg": (20, 31), "c.png": (48, 48)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)


def image(name: str) -> dict:
    return {"type": "image", "image": name}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


CONVERSATIONS = [
    [{"role": "user", "content": [image("a.png"), text("What is this?")]},
     {"role": "assistant", "content": "A fox on a mat."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": [text("Compare"), image("b.jpg"), text("and"), image("c.png")]},
     {"role": "assistant", "content": "The first is darker."},
     {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Less light, 12345."}],
    [{"role": "user", "content": "No picture here."},
     {"role": "assistant", "content": "Then just text."}],
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module", params=ARCHES)
def prepared(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    release = make_release(arch, tmp / "release")
    write_images(tmp)
    source = write_jsonl(tmp / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp / "data")]) == 0
    return arch, tmp, release, VLDataset(tmp / "data")


def absolute(messages, folder: Path):
    """``messages`` with image paths made absolute (transformers loads them as given)."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{**p, "image": str(folder / p["image"])} if p["type"] == "image" else p
                       for p in content]
        out.append({**m, "content": content})
    return out


def assistant_mask(ids: list[int], tok, arch: str) -> list[int]:
    """The assistant tokens found independently, by the template's markers in the decoded
    text: for ChatML each span after ``<|im_start|>assistant\\n`` through its ``<|im_end|>``;
    for GLM after ``<|assistant|>\\n`` up to the next role token (included) or the end."""
    header = "<|assistant|>\n" if arch == "glm4v" else "<|im_start|>assistant\n"
    ends = ("<|user|>", "<|system|>", "<|assistant|>") if arch == "glm4v" else ("<|im_end|>",)
    mask, inside, seen = [0] * len(ids), False, ""
    for k, i in enumerate(ids):
        piece = tok.decode([i], skip_special_tokens=False)
        if inside:
            mask[k] = 1
            inside = piece not in ends
        seen += piece
        inside = inside or seen.endswith(header)
    return mask


def test_ids_rows_and_mask_equal_the_release_processor(prepared):
    arch, tmp, release, ds = prepared
    processor = hf_processor(arch, release)
    tok = TokenizerFolder(release).rust
    config = json.loads((release / "config.json").read_text())
    assert ds.settings.family == FAMILY[arch]
    assert ds.tokenizer.token_ids()["image_token_id"] == config["image_token_id"] < 416
    for i, messages in enumerate(CONVERSATIONS):
        want = processor.apply_chat_template(absolute(messages, tmp), tokenize=True,
                                             return_dict=True, return_tensors="pt")
        sample = ds[i]
        ids = want["input_ids"][0].tolist()
        if arch == "glm4v":  # GLM's template ends the last turn with no token: eos appended
            ids = ids + [TokenizerFolder(release).eos_id]
        assert sample.input_ids.tolist() == ids, (arch, i)
        assert sample.loss_mask.astype(int).tolist() == assistant_mask(ids, tok, arch), (arch, i)
        assert sample.loss_mask.sum() > 0
        if "pixel_values" in want:
            assert sample.grid_thw.tolist() == want["image_grid_thw"].tolist()
            torch.testing.assert_close(torch.from_numpy(sample.pixel_values.copy()),
                                       want["pixel_values"].float(), atol=1e-5, rtol=0)
        else:
            assert len(sample.grid_thw) == 0
    meta = ds.meta["tokenizer"]
    assert meta["vocab_sha256"] == TokenizerFolder(release).fingerprint["vocab_sha256"]
    assert meta["folder"] == str(release)


@pytest.fixture(scope="module")
def qwen_release(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    write_images(tmp)
    return tmp, make_release("qwen2_vl", tmp / "release")


GOOD = {"messages": CONVERSATIONS[0]}


@pytest.mark.parametrize("row, error", [
    ({"messages": [{"role": "user", "content": [image("missing.png"), text("hi")]},
                   {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: image .*missing.png does not exist"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: message 0 has role 'robot'; use one of system, user, assistant, tool"),
    ({"messages": [{"role": "user", "content": [image("a.png")]}]},
     r"chat.jsonl:2: no assistant turn"),
    ({"messages": [{"role": "user", "content": []}, {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: message 0 \(user\) has an empty content list"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]},
                   {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: message 0 part 0 is an image part without a path"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]},
                   {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: message 0 part 0 gives the video as one file \('clip.mp4'\); give its "
     r"frames instead"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                   {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: message 0 part 0 has type 'audio'; use text, image or video parts"),
    ({"messages": [{"role": "user", "content": [
        {"type": "video", "video": ["a.png", "gone.png"]}]},
        {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: frame 1 of a video \(.*gone.png\) does not exist"),
    ({"image": "a.png", "caption": "x"}, r"chat.jsonl:2: expected \{\"messages\": \[...\]\}"),
])
def test_bad_lines_name_file_and_line_and_write_nothing(qwen_release, row, error, capsys):
    tmp, release = qwen_release
    source = write_jsonl(tmp / "chat.jsonl", [GOOD, row, GOOD])
    out = tmp / "out"
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(out)]) == 2
    assert __import__("re").search(error, capsys.readouterr().err)
    assert not out.exists() and not list(tmp.glob(".out.tmp-*"))


def test_tokenizer_json_path_is_the_release_and_text_families_are_refused(qwen_release, tmp_path,
                                                                          capsys):
    tmp, release = qwen_release
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    for name in ("a.png",):
        (tmp_path / name).write_bytes((tmp / name).read_bytes())
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer",
                                 str(release / "tokenizer.json"), "--out",
                                 str(tmp_path / "ok")]) == 0
    assert VLDataset(tmp_path / "ok").tokenizer.token_ids()["image_token_id"] < 416
    # a text release (Qwen3, no vision tower) given VL conversations
    text_release = make_text_release(tmp_path / "qwen3")
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(text_release),
                                 "--out", str(tmp_path / "no")]) == 2
    assert "a text family without a vision tower" in capsys.readouterr().err
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--family", "llama", "--out", str(tmp_path / "no")]) == 2
    assert "a text family without a vision tower" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_vl_conversation_for_text_chat_is_refused_by_line(qwen_release, tmp_path, capsys):
    from mpcore.launch import prepare_data

    tmp, release = qwen_release
    source = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
        GOOD])
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix",
                              str(tmp_path / "sft"), "--tokenizer", str(release)]) != 0
    err = capsys.readouterr().err
    assert "chat.jsonl:2: message 0 has a list as content" in err
    assert "prepare image conversations for a VL family" in err
    assert not list(tmp_path.glob("sft*"))


def test_conversations_need_a_release_and_captions_need_sentencepiece(qwen_release, tmp_path,
                                                                     capsys):
    tmp, release = qwen_release
    (tmp_path / "a.png").write_bytes((tmp / "a.png").read_bytes())
    chat = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    sp = tmp_path / "any.model"  # refused before the model is read
    assert prepare_vl_data.main(["--manifest", str(chat), "--tokenizer", str(sp),
                                 "--out", str(tmp_path / "no")]) == 2
    assert "chat.jsonl:1: VL conversations need a released tokenizer folder" in (
        capsys.readouterr().err)
    captions = write_jsonl(tmp_path / "cap.jsonl", [{"image": "a.png", "caption": "x"}])
    assert prepare_vl_data.main(["--manifest", str(captions), "--tokenizer", str(release),
                                 "--out", str(tmp_path / "no")]) == 2
    assert "cap.jsonl:1: with a released tokenizer the manifest holds VL conversations" in (
        capsys.readouterr().err)
    assert not (tmp_path / "no").exists()
