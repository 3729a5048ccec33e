"""Qwen3-VL shapes: the 2B config's parameter count equals transformers' (both built on meta);
the tiny YAML section builds a model that runs a forward/backward on a packed stream with an
image; unknown section keys name the closest field."""

from __future__ import annotations

import pytest
import torch
import transformers

from mpcore.models.common.qwen3_vl.presets import QWEN3_VL_2B, TINY, config_from_section
from mpcore.models.qwen3_vl import build_model, config_from_hf, local_inputs, num_params
from mpcore.parallel.state import ParallelState

IDS = dict(image_token_id=2048, video_token_id=2049, vision_start_token_id=2050,
           vision_end_token_id=2051)


def test_2b_parameter_count_equals_transformers():
    cfg = config_from_hf(QWEN3_VL_2B)
    hf_config = transformers.Qwen3VLConfig(**QWEN3_VL_2B)
    with torch.device("meta"):
        hf = transformers.Qwen3VLForConditionalGeneration(hf_config)
    theirs = sum(p.numel() for p in hf.parameters())  # tied lm_head counted once
    counts = num_params(cfg)
    assert counts["total"] == theirs
    assert counts["vision"] == sum(p.numel() for p in hf.model.visual.parameters())
    assert 2.0e9 < counts["total"] < 2.3e9


def test_tiny_section_trains_a_step():
    cfg = config_from_section(TINY, IDS)
    assert cfg.text.qk_norm and cfg.text.mrope_interleaved and cfg.vision.out_hidden_size == 64
    model = build_model(cfg, ParallelState(), seed=0)
    grid = torch.tensor([[1, 4, 6]])
    ids = torch.tensor([5, 2050, *[2048] * 6, 2051, 7, 8, 9, 10])
    _, inputs = local_inputs(ParallelState(), ids, torch.tensor([0, ids.numel()]), cfg,
                             pixel_values=torch.randn(24, cfg.vision.patch_dim),
                             image_grid_thw=grid)
    loss = model(**inputs, output="loss").sum()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and float(p.grad.abs().max()) > 0
               for n, p in model.named_parameters() if "deepstack" in n and "weight" in n)


def test_section_unknown_key_names_the_closest_field():
    with pytest.raises(ValueError, match="did you mean 'num_heads'"):
        config_from_section({**TINY, "vision": {**TINY["vision"], "num_head": 4}}, IDS)
