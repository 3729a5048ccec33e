"""An export after model.init_from of a released VL checkpoint + VL chat SFT keeps the release:
its tokenizer files and preprocessor_config.json byte for byte, and transformers' processor
built from the export gives the same ids and rows on a conversation with an image as the
release's; AutoModelForImageTextToText loads it with the release's vision token ids."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForImageTextToText

from mpcore.config import load_config
from mpcore.launch.export_hf import export
from mpcore.train import train
from tests.unit.test_vl_chat import CONVERSATIONS, absolute
from tests.unit.test_vl_chat_train import prepare
from tests.unit.vl_releases import hf_processor, make_release


def test_export_keeps_the_vl_release(tmp_path):
    release = make_release("qwen2_vl", tmp_path / "release")
    data = prepare("qwen2_vl", tmp_path, release)
    cfg = load_config(None, [
        f"model.init_from={release}", f"data.vl_paths=[{data}]", "data.seq_len=512",
        "data.micro_batch=1", "training.max_steps=1", "training.device=cpu",
        f"logging.run_dir={tmp_path}/run", "checkpoint.every=1"])
    train(cfg)
    out = tmp_path / "hf"
    export(cfg.checkpoint_dir, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert (out / name).read_bytes() == (release / name).read_bytes(), name
    theirs, ours = (json.loads((f / "config.json").read_text()) for f in (release, out))
    for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id"):
        assert ours[key] == theirs[key], key
    messages = absolute(CONVERSATIONS[1], tmp_path)
    a, b = (hf_processor("qwen2_vl", f).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt") for f in (release, out))
    assert a["input_ids"].tolist() == b["input_ids"].tolist()
    torch.testing.assert_close(a["pixel_values"], b["pixel_values"])
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert model.config.image_token_id == theirs["image_token_id"]
