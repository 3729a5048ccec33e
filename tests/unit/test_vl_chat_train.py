"""VL chat SFT from a released VL checkpoint (tiny releases made here, ``vl_releases``), for
each VL family: the first training step's loss on prepared VL conversations equals transformers'
model's masked loss on the same conversations (processor outputs) and weights: the sum of the
next-token losses of every assistant token over the step, divided by their count. Data of
another release's tokenizer is refused before the model is built."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText

from mpcore.build import resolve_model_config
from mpcore.config import load_config
from mpcore.data.hf_folder import TokenizerFolder
from mpcore.data.indexed import IndexedDataset
from mpcore.data.sft_packing import SFTPackedDataset
from mpcore.data.vl_packing import TextAsVL
from mpcore.launch import prepare_data, prepare_vl_data
from mpcore.models import family_named
from mpcore.parallel.state import ParallelState
from mpcore.train import train
from mpcore.vl_data import build_vl_loaders
from tests.unit.test_vl_chat import (
    CONVERSATIONS,
    absolute,
    assistant_mask,
    write_images,
    write_jsonl,
)
from tests.unit.vl_releases import ARCHES, hf_processor, make_release

SEQ_LEN = 512  # every conversation in one budget: the step is the whole file


def prepare(arch: str, tmp, release):
    write_images(tmp)
    source = write_jsonl(tmp / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp / "data")]) == 0
    return tmp / "data"


def sft_config(tmp, release, data, run: str):
    return load_config(None, [
        f"model.init_from={release}", f"data.vl_paths=[{data}]", f"data.seq_len={SEQ_LEN}",
        "data.micro_batch=1", "data.grad_accum=1", "training.max_steps=1",
        "training.device=cpu", f"logging.run_dir={tmp}/{run}", "checkpoint.every=0",
        "optimizer.lr=1e-5", "schedule.warmup_steps=0"])


def reference_loss(arch: str, release, tmp) -> float:
    """transformers: each conversation alone through the release's processor and model,
    labels outside the assistant mask ignored, summed and divided by the total count."""
    model = AutoModelForImageTextToText.from_pretrained(
        release, dtype=torch.float64).eval()
    processor = hf_processor(arch, release)
    eos = TokenizerFolder(release).eos_id
    tok = TokenizerFolder(release).rust
    total, count = 0.0, 0
    for messages in CONVERSATIONS:
        inputs = processor.apply_chat_template(absolute(messages, tmp), tokenize=True,
                                               return_dict=True, return_tensors="pt")
        ids = inputs["input_ids"]
        if arch == "glm4v":
            ids = torch.cat([ids, torch.tensor([[eos]])], 1)
            inputs["mm_token_type_ids"] = torch.cat(
                [inputs["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.long)], 1)
            inputs["attention_mask"] = torch.ones_like(ids)
        inputs["input_ids"] = ids
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].double()
        mask = torch.tensor(assistant_mask(ids[0].tolist(), tok, arch), dtype=torch.bool)
        labels = torch.where(mask, ids[0], -100)
        with torch.no_grad():
            logits = model(**inputs).logits[0]
        total += float(F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100,
                                       reduction="sum"))
        count += int((labels[1:] != -100).sum())
    return total / count


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_first_step_equals_transformers_masked_loss(arch, tmp_path):
    release = make_release(arch, tmp_path / "release")
    data = prepare(arch, tmp_path, release)
    result = train(sft_config(tmp_path, release, data, "run"))
    want = reference_loss(arch, release, tmp_path)
    assert abs(result.losses[0] - want) < 1e-4, (arch, result.losses[0], want)


@pytest.mark.slow
def test_data_of_another_release_is_refused_before_the_model(tmp_path):
    ours = make_release("qwen2_vl", tmp_path / "ours")
    other = make_release("qwen2_vl", tmp_path / "other", pieces=390)
    data = prepare("qwen2_vl", tmp_path, other)
    with pytest.raises(ValueError, match=r"has 394 token ids, model.init_from .* 404; prepare "
                                         r"the data with the checkpoint's tokenizer"):
        train(sft_config(tmp_path, ours, data, "refused"))
    assert not (tmp_path / "refused" / "checkpoints").exists()


@pytest.mark.slow
def test_text_chat_of_the_release_blends_with_its_mask_other_text_is_refused(tmp_path):
    release = make_release("qwen2_vl", tmp_path / "release")
    data = prepare("qwen2_vl", tmp_path, release)
    rows = [{"messages": [{"role": "user", "content": f"Question {k}?"},
                          {"role": "assistant", "content": f"Answer {k}."}]} for k in range(6)]
    chat = write_jsonl(tmp_path / "text.jsonl", rows)
    assert prepare_data.main(["--chat", "--input", str(chat), "--output-prefix",
                              str(tmp_path / "sft"), "--tokenizer", str(release)]) == 0
    ds = IndexedDataset(tmp_path / "sft")
    packed = SFTPackedDataset(ds, SEQ_LEN, TokenizerFolder(release).pad_fill_id)
    sample = TextAsVL(packed, 24)[0]
    assert np.array_equal(sample.loss_mask, packed[0].loss_mask.astype(bool))
    assert 0 < sample.loss_mask.sum() < len(sample.loss_mask)  # user tokens are not targets
    cfg = load_config(None, [f"model.init_from={release}", f"data.vl_paths=[{data}]",
                             f"data.paths=[{tmp_path}/sft]", f"data.seq_len={SEQ_LEN}",
                             "data.weights=[1.0,1.0]", "data.micro_batch=1"])
    family = family_named("qwen2_vl")
    build_vl_loaders(cfg, ParallelState(), family)  # the same tokenizer: accepted
    other = make_release("qwen2_vl", tmp_path / "other", pieces=390)
    assert prepare_data.main(["--chat", "--input", str(chat), "--output-prefix",
                              str(tmp_path / "other_sft"), "--tokenizer", str(other)]) == 0
    cfg = load_config(None, [f"model.init_from={release}", f"data.vl_paths=[{data}]",
                             f"data.paths=[{tmp_path}/other_sft]", f"data.seq_len={SEQ_LEN}"])
    with pytest.raises(ValueError, match=r"other_sft.idx was written for a vocabulary of 394 "
                                         r"but the VL tokenizer's text vocabulary has 404"):
        build_vl_loaders(cfg, ParallelState(), family)


@pytest.mark.slow
def test_shipped_vl_sft_config_trains_from_a_release(tmp_path):
    release = make_release("qwen3_vl", tmp_path / "release")
    data = prepare("qwen3_vl", tmp_path, release)
    yaml = Path(__file__).resolve().parents[2] / "launch" / "configs" / "sft_qwen3_vl_2b.yaml"
    cfg = load_config(yaml, [
        f"model.init_from={release}", f"data.vl_paths=[{data}]", f"data.seq_len={SEQ_LEN}",
        "data.micro_batch=1", "data.grad_accum=1", "training.max_steps=2",
        "training.device=cpu", "training.dtype=float32", f"logging.run_dir={tmp_path}/run",
        "checkpoint.every=0"])
    assert (cfg.optimizer.lr, cfg.data.vl_paths) == (1e-5, [str(data)])
    result = train(cfg)
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)


def test_glm4v_release_data_without_init_from_is_refused_clearly(tmp_path):
    yaml = Path(__file__).resolve().parents[2] / "launch" / "configs" / "glm4v_tiny.yaml"
    cfg = load_config(yaml, ["model.vocab_size=512"])
    ids = {"image_token_id": 405, "video_token_id": 408, "image_start_token_id": 403,
           "image_end_token_id": 404, "video_start_token_id": 406, "video_end_token_id": 407}
    with pytest.raises(ValueError, match=r"a fresh glm4v model takes 'vision_start_token_id' "
                                         r"from its data; train from the release"):
        resolve_model_config(cfg, family_named("glm4v"), ids)
