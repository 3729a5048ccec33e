"""The Qwen2-VL / Qwen2.5-VL family: a vision tower feeding the shared M-RoPE decoder."""

from __future__ import annotations

import torch

from mpcore.models.common import counts
from mpcore.models.common.config import ModelConfig
from mpcore.models.common.family import Family, ImageProcessing, VideoProcessing
from mpcore.models.common.resize import CLIP_MEAN, CLIP_STD, MAX_PIXELS, MIN_PIXELS
from mpcore.models.common.section import given
from mpcore.models.common.stage import build_vl_stages
from mpcore.models.qwen2_vl.config import (
    VL_ARCHS,
    Qwen2VLSection,
    VLConfig,
    hf_vl_config_dict,
    vl_config_from_dict,
)
from mpcore.models.qwen2_vl.config import vl_config_from_hf as _from_hf
from mpcore.models.qwen2_vl.hf import export_hf_vl, load_hf_vl_model, vl_shard_map
from mpcore.models.qwen2_vl.inputs import local_vl_inputs
from mpcore.models.qwen2_vl.model import build_vl_model
from mpcore.models.qwen2_vl.tower import VisionTower
from mpcore.models.qwen2_vl.vision_config import VisionConfig


def video_layout(grid, merge: int, frame_times, ids: dict) -> list[int]:
    """A video in the text, as Qwen2VLProcessor writes it: ONE run of ``t*h*w / merge^2``
    video placeholders between vision start/end (no timestamps: ``frame_times`` unused)."""
    del frame_times
    t, h, w = grid
    return [ids["vision_start_token_id"], *[ids["video_token_id"]] * (t * h * w // merge ** 2),
            ids["vision_end_token_id"]]


# transformers' Qwen2VLVideoProcessor defaults (its size: 128 to 768 merged tokens a frame)
VIDEO_PROCESSING = VideoProcessing("Qwen2VLVideoProcessor", min_pixels=128 * 28 * 28,
                                   max_pixels=28 * 28 * 768, mean=CLIP_MEAN, std=CLIP_STD,
                                   layout=video_layout)
# transformers' Qwen2VLImageProcessor defaults (Qwen2-VL and Qwen2.5-VL checkpoints ship them)
IMAGE_PROCESSING = ImageProcessing("Qwen2VLImageProcessor", patch_size=14, min_pixels=MIN_PIXELS,
                                   max_pixels=MAX_PIXELS, mean=CLIP_MEAN, std=CLIP_STD,
                                   video=VIDEO_PROCESSING)


def config_from_section(section, token_ids: dict | None) -> VLConfig:
    """The ``VLConfig`` of our YAML model section: the decoder's shape fields, ``vision`` (the
    tower's ``VisionConfig`` fields; ``out_hidden_size`` defaults to ``hidden_size``) and the
    data tokenizer's four special ids."""
    if token_ids is None:
        raise ValueError("a VL model from scratch takes its token ids from the data's tokenizer")
    if section.vocab_size < max(token_ids.values()) + 1:
        raise ValueError(f"model.vocab_size = {section.vocab_size} is smaller than the VL "
                         f"tokenizer's {max(token_ids.values()) + 1} ids (text vocab + 4 vision "
                         f"ids); raise it")
    vision = given(section.vision)
    vision.setdefault("out_hidden_size", section.hidden_size)
    try:
        vision_cfg = VisionConfig(**vision)
    except TypeError as e:
        raise ValueError(f"model.vision: {e}; its keys are mpcore.models.qwen2_vl.VisionConfig's "
                         f"fields") from None
    return VLConfig(text=ModelConfig(**section.shape_fields()), vision=vision_cfg, **token_ids)


def num_params(cfg: VLConfig) -> dict[str, int]:
    """The decoder's counts plus ``vision`` (the tower, included in ``total``)."""
    with torch.device("meta"):
        vision = sum(p.numel() for p in VisionTower(cfg.vision).parameters())
    text = counts.num_params(cfg.text)
    return {**text, "total": text["total"] + vision, "vision": vision}


def flops_per_token(cfg: VLConfig, seq_len: int) -> float:
    """The decoder's only: the tower's work depends on each batch's share of image tokens, so
    TFLOP/s and MFU of VL runs leave it out (they are lower bounds)."""
    return counts.flops_per_token(cfg.text, seq_len)


FAMILY = Family(
    name="qwen2_vl", config_type=VLConfig, hf_architectures=tuple(VL_ARCHS),
    hf_model_types=tuple(VL_ARCHS.values()),
    config_from_hf=_from_hf, hf_config_dict=hf_vl_config_dict,
    config_from_dict=vl_config_from_dict, config_from_section=config_from_section,
    build=build_vl_model, load_hf=load_hf_vl_model, export_hf=export_hf_vl, shard_map=vl_shard_map,
    local_inputs=local_vl_inputs, num_params=num_params, flops_per_token=flops_per_token,
    decoder=lambda model: model.text, vision=lambda model: model.visual,
    placeholder_ids=lambda cfg: cfg.placeholder_ids, modality="image-text",
    options=("vision_cp",), host_inputs=("grid_thw",),
    section=Qwen2VLSection, image_processing=IMAGE_PROCESSING, pipeline_stages=build_vl_stages)
