"""Qwen3-VL config: both config.json forms, the 5.x writer, meta.json round trip, interleaved
M-RoPE vs transformers' rotary embedding, and bad input (ValueError before any compute)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.rope import RotaryEmbedding
from mpcore.models.qwen3_vl import config_from_dict, config_from_hf, hf_config_dict

TEXT = dict(vocab_size=160, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-5,
            max_position_embeddings=4096)
VISION = dict(depth=3, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=32,
              patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[2, 0])
TOKENS = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152,
              vision_end_token_id=153)
ROPE = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}


def _v5(tie=False, text=None, vision=None) -> dict:
    """config.json as transformers 5.x writes it (``rope_parameters``)."""
    text = {**TEXT, "rope_parameters": {**ROPE, "rope_theta": 5e6}, **(text or {})}
    config = transformers.Qwen3VLConfig(text_config=text, vision_config={**VISION,
                                                                           **(vision or {})},
                                        tie_word_embeddings=tie, **TOKENS)
    return {**config.to_dict(), "architectures": ["Qwen3VLForConditionalGeneration"]}


def _v4(tie=False) -> dict:
    """config.json of a released (4.57-era) checkpoint: ``rope_scaling`` and ``rope_theta``."""
    text = {**TEXT, "model_type": "qwen3_vl_text", "rope_theta": 5000000, "attention_bias": False,
            "hidden_act": "silu", "rope_scaling": dict(ROPE), "tie_word_embeddings": tie,
            "dtype": "bfloat16", "use_cache": True}
    vision = {**VISION, "model_type": "qwen3_vl", "hidden_act": "gelu_pytorch_tanh",
              "in_channels": 3, "initializer_range": 0.02, "spatial_merge_size": 2,
              "temporal_patch_size": 2}
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "text_config": text, "vision_config": vision, "tie_word_embeddings": tie, **TOKENS}


@pytest.mark.parametrize("tie", [False, True])
def test_both_forms_read_the_same_and_5x_is_written(tie):
    cfg = config_from_hf(_v5(tie))
    assert cfg == config_from_hf(_v4(tie))
    assert cfg.text.mrope_section == (4, 2, 2) and cfg.text.mrope_interleaved
    assert cfg.text.qk_norm and not cfg.text.qkv_bias and cfg.text.head_dim == 16
    assert cfg.text.rope_theta == 5e6 and cfg.text.tie_embeddings == tie
    assert cfg.vision.deepstack_visual_indexes == (2, 0) and cfg.vision.patch_size == 2
    written = hf_config_dict(cfg)
    assert written["text_config"]["rope_parameters"]["mrope_section"] == [4, 2, 2]
    assert "rope_scaling" not in written["text_config"]
    assert config_from_hf(written) == cfg
    # transformers reads what we write as the same model.
    again = transformers.Qwen3VLConfig(**written)
    assert config_from_hf({**again.to_dict(), "architectures": written["architectures"]}) == cfg


def test_meta_json_round_trip():
    cfg = config_from_hf(_v4())
    assert config_from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg


def test_interleaved_mrope_matches_transformers():
    hf_text = transformers.Qwen3VLTextConfig(**{**TEXT, "head_dim": 32},
                                             rope_parameters={**ROPE, "rope_theta": 1e4,
                                                              "mrope_section": [6, 5, 5]})
    theirs = Qwen3VLTextRotaryEmbedding(hf_text)
    ours = RotaryEmbedding(32, 1e4, None, (6, 5, 5), mrope_interleaved=True)
    ours.reset_parameters()
    positions = torch.randint(0, 500, (3, 40))
    cos, sin = ours(positions, torch.float32)
    ref_cos, ref_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    contiguous = RotaryEmbedding(32, 1e4, None, (6, 5, 5))
    contiguous.reset_parameters()
    assert not torch.equal(contiguous(positions, torch.float32)[0], cos)  # the flag matters


@pytest.mark.parametrize(("config", "message"), [
    (_v5(vision=dict(deepstack_visual_indexes=[1, 3])), "not a vision block index"),
    (_v5(vision=dict(num_position_embeddings=20)), "not a perfect square"),
    (_v5(text={"rope_parameters": {**ROPE, "mrope_section": [2, 3, 3]}}), "does not fit"),
    (_v5(text={"rope_parameters": {**ROPE, "mrope_section": [4, 2, 1]}}), "sums to 7"),
    (_v5(text={"rope_parameters": {**ROPE, "mrope_interleaved": False}}), "interleaved"),
    (_v5(text={"num_hidden_layers": 1}), "DeepStack features"),
    ({**_v5(), "architectures": ["Qwen2VLForConditionalGeneration"]}, "is not Qwen3-VL"),
])
def test_bad_config_json(config, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(config)


def test_model_config_interleaved_needs_sections():
    with pytest.raises(ValueError, match="needs mrope_section"):
        ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    intermediate_size=8, mrope_interleaved=True)
