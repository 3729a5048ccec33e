"""An export after model.init_from + chat SFT keeps the release: its tokenizer files and
generation_config.json byte for byte, its special ids in config.json, the same chat rendering
from AutoTokenizer, and AutoModelForCausalLM loads it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from mpcore.config import load_config
from mpcore.launch import prepare_data
from mpcore.launch.export_hf import export
from mpcore.train import train
from tests.unit.release_tokenizers import CHAT, ROWS, make_release, write_jsonl

GENERATION = {"bos_token_id": None, "eos_token_id": [2, 0], "pad_token_id": 0,
              "do_sample": True, "temperature": 0.7, "top_p": 0.8}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    release = make_release(tmp / "release")
    (release / "generation_config.json").write_text(json.dumps(GENERATION, indent=3) + "\n")
    config = json.loads((release / "config.json").read_text())
    config.update(bos_token_id=None, eos_token_id=2, pad_token_id=0)
    (release / "config.json").write_text(json.dumps(config, indent=2))
    source = write_jsonl(tmp / "chat.jsonl", ROWS)
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix",
                              str(tmp / "sft"), "--tokenizer", str(release)]) == 0
    cfg = load_config(None, [
        f"model.init_from={release}", f"data.paths=[{tmp}/sft]", "data.seq_len=192",
        "data.micro_batch=1", "training.max_steps=1", "training.device=cpu",
        f"logging.run_dir={tmp}/run", "checkpoint.every=1"])
    train(cfg)
    export(cfg.checkpoint_dir, tmp / "hf")
    return release, tmp / "hf"


def test_release_files_are_byte_equal(exported):
    release, out = exported
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (release / name).read_bytes(), name
    assert not (out / "tokenizer.model").exists()  # no tokenizer of ours beside the release's
    theirs, ours = (json.loads((f / "config.json").read_text()) for f in (release, out))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours.get(key) == theirs.get(key), key


def test_chat_rendering_and_model_load_from_the_export(exported):
    release, out = exported
    a, b = AutoTokenizer.from_pretrained(release), AutoTokenizer.from_pretrained(out)
    for row in CHAT[:1] + [{"messages": [{"role": "user", "content": "hi"}]}]:
        for prompt in (False, True):
            assert (a.apply_chat_template(row["messages"], tokenize=True,
                                          add_generation_prompt=prompt)
                    == b.apply_chat_template(row["messages"], tokenize=True,
                                             add_generation_prompt=prompt))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(b)
    assert model.generation_config.eos_token_id == GENERATION["eos_token_id"]
