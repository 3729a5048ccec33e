"""The Qwen3-VL family: interleaved M-RoPE Qwen3 decoder, a tower with DeepStack features."""

from __future__ import annotations

from mpcore.models.common.family import Family, ImageProcessing, VideoProcessing
from mpcore.models.common.resize import smart_resize_video
from mpcore.models.common.section import given
from mpcore.models.qwen3_vl.config import (
    ARCH,
    MODEL_TYPE,
    Qwen3VLConfig,
    Qwen3VLSection,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
)
from mpcore.models.qwen3_vl.hf import export_hf, load_hf_model, shard_map
from mpcore.models.qwen3_vl.inputs import local_inputs
from mpcore.models.qwen3_vl.model import build_model, flops_per_token, num_params
from mpcore.models.qwen3_vl.presets import config_from_section as _from_fields


def video_layout(grid, merge: int, frame_times, ids: dict) -> list[int | str]:
    """A video in the text, as Qwen3VLProcessor writes it: per temporal patch its timestamp
    ``<S.s seconds>`` (the mean of its first and last frame's time) as text, then a run of
    ``h*w / merge^2`` video placeholders between vision start/end."""
    t, h, w = grid
    step = len(frame_times) // t  # temporal_patch_size
    out: list[int | str] = []
    for k in range(t):
        seconds = (frame_times[k * step] + frame_times[k * step + step - 1]) / 2
        out += [f"<{seconds:.1f} seconds>", ids["vision_start_token_id"],
                *[ids["video_token_id"]] * (h * w // merge ** 2), ids["vision_end_token_id"]]
    return out


# transformers' Qwen3VLVideoProcessor defaults: patch 16, mean = std = 0.5, 128 to 768 merged
# tokens, its smart_resize counting the frames
VIDEO_PROCESSING = VideoProcessing("Qwen3VLVideoProcessor", min_pixels=128 * 32 * 32,
                                   max_pixels=32 * 32 * 768, mean=(0.5, 0.5, 0.5),
                                   std=(0.5, 0.5, 0.5), layout=video_layout,
                                   size_rule=smart_resize_video)
# Qwen3-VL's processor: transformers' Qwen2VLImageProcessor (Qwen2-VL's resize rule) with the
# released checkpoints' preprocessor_config.json: patch 16, mean = std = 0.5, and pixel bounds
# 256^2 to 4096^2
IMAGE_PROCESSING = ImageProcessing("Qwen2VLImageProcessor", patch_size=16, min_pixels=65536,
                                   max_pixels=16777216, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                                   video=VIDEO_PROCESSING)


def config_from_section(section, token_ids: dict | None) -> Qwen3VLConfig:
    """The ``Qwen3VLConfig`` of our YAML model section: the decoder's shape fields (with
    ``qk_norm`` and ``mrope_interleaved`` true, as the family needs) and ``vision`` (the
    ``Qwen3VisionConfig`` fields), with the data tokenizer's four special ids."""
    if token_ids is None:
        raise ValueError("a VL model from scratch takes its token ids from the data's tokenizer")
    return _from_fields({**section.shape_fields(), "vision": given(section.vision)}, token_ids)


FAMILY = Family(
    name="qwen3_vl", config_type=Qwen3VLConfig, hf_architectures=(ARCH,),
    hf_model_types=(MODEL_TYPE,), config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build_model, load_hf=load_hf_model, export_hf=export_hf, shard_map=shard_map,
    local_inputs=local_inputs, num_params=num_params, flops_per_token=flops_per_token,
    decoder=lambda model: model.text, vision=lambda model: model.visual,
    placeholder_ids=lambda cfg: cfg.placeholder_ids, modality="image-text",
    options=("vision_cp",), host_inputs=("grid_thw",),
    section=Qwen3VLSection, image_processing=IMAGE_PROCESSING)
