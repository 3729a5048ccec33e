"""VL chat SFT with videos from a released VL checkpoint (tiny releases, ``vl_releases``), for
each VL family: the first training step's loss on prepared conversations with videos (frame
lists) and images equals transformers' model's masked loss in float64 on the processor's
outputs for the same messages (``vl_video_reference``) and weights: the sum of the next-token
losses of every assistant token, divided by their count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText

from mpcore.data.hf_folder import TokenizerFolder
from mpcore.launch import prepare_vl_data
from mpcore.train import train
from tests.unit.test_vl_chat import assistant_mask, write_images, write_jsonl
from tests.unit.test_vl_chat_train import sft_config
from tests.unit.test_vl_chat_video import conversations, write_frames
from tests.unit.vl_releases import ARCHES, hf_processor, make_release
from tests.unit.vl_video_reference import processor_inputs, video_processor, write_video_config


def train_conversations(arch: str) -> list:
    """The test's conversations; for GLM-4V without the image beside a video:
    transformers' Glm4vModel takes no sample holding both (its image and video masks are the
    same placeholder tokens, so their counts never match), while ours does."""
    rows = conversations(arch)
    if arch != "glm4v":
        return rows
    return [[{**m, "content": [p for p in m["content"] if p["type"] != "image"]}
             if isinstance(m["content"], list) else m for m in messages] for messages in rows]


def reference_loss(arch: str, release, config: dict, tmp) -> float:
    """transformers in float64: each conversation alone through the processor and model,
    labels outside the assistant mask ignored, summed and divided by the total count."""
    model = AutoModelForImageTextToText.from_pretrained(release, dtype=torch.float64).eval()
    processor = hf_processor(arch, release, video_processor(arch, config))
    tok = TokenizerFolder(release)
    total, count = 0.0, 0
    for messages in train_conversations(arch):
        inputs = processor_inputs(processor, messages, tmp)
        ids = inputs["input_ids"]
        if arch == "glm4v":  # the eos our data appends after GLM's last turn
            ids = torch.cat([ids, torch.tensor([[tok.eos_id]])], 1)
            inputs["mm_token_type_ids"] = torch.cat(
                [inputs["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.long)], 1)
            inputs["attention_mask"] = torch.ones_like(ids)
        inputs["input_ids"] = ids
        for key in ("pixel_values", "pixel_values_videos"):
            if key in inputs:
                inputs[key] = inputs[key].double()
        mask = torch.tensor(assistant_mask(ids[0].tolist(), tok.rust, arch), dtype=torch.bool)
        labels = torch.where(mask, ids[0], -100)
        with torch.no_grad():
            logits = model(**inputs).logits[0]
        total += float(F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100,
                                       reduction="sum"))
        count += int((labels[1:] != -100).sum())
    return total / count


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_first_step_with_videos_equals_transformers_masked_loss(arch, tmp_path):
    release = make_release(arch, tmp_path / "release")
    config = write_video_config(arch, release)
    write_images(tmp_path)
    write_frames(tmp_path)
    source = write_jsonl(tmp_path / "chat.jsonl",
                         [{"messages": m} for m in train_conversations(arch)])
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp_path / "data")]) == 0
    result = train(sft_config(tmp_path, release, tmp_path / "data", "run"))
    want = reference_loss(arch, release, config, tmp_path)
    assert abs(result.losses[0] - want) < 1e-4, (arch, result.losses[0], want)
