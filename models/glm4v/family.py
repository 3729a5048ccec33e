"""The GLM-4V / GLM-4.1V family: its vision tower feeding the decoder with sandwich norms."""

from __future__ import annotations

import torch

from mpcore.models.common import counts
from mpcore.models.common.family import Family, ImageProcessing, VideoProcessing
from mpcore.models.common.resize import CLIP_MEAN, CLIP_STD, smart_resize_video
from mpcore.models.common.section import given
from mpcore.models.common.stage import build_vl_stages
from mpcore.models.glm4v.config import (
    ARCH,
    MODEL_TYPE,
    Glm4vConfig,
    Glm4vSection,
    Glm4vVisionConfig,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
    text_config,
)
from mpcore.models.glm4v.hf import export_hf, shard_map
from mpcore.models.glm4v.inputs import local_glm4v_inputs
from mpcore.models.glm4v.model import build_model, load_hf_model
from mpcore.models.glm4v.processor import MAX_PIXELS, MIN_PIXELS, resize_size
from mpcore.models.glm4v.tower import Glm4vVisionTower


def video_span_ids(token_ids: dict) -> tuple[int, int]:
    """GLM-4V's video start / end ids: a release's own (its config's ``video_start_token_id``
    / ``video_end_token_id``); a tokenizer made from scratch names none, so there the two ids
    after its own."""
    if "video_start_token_id" in token_ids:
        return token_ids["video_start_token_id"], token_ids["video_end_token_id"]
    top = max(token_ids.values())
    return top + 1, top + 2


def video_layout(grid, merge: int, frame_times, ids: dict) -> list[int | str]:
    """A video in the text, as Glm4vProcessor writes it: video start, then per temporal patch
    a run of ``h*w / merge^2`` image placeholders between image start/end (a release's
    ``image_start_token_id`` / ``image_end_token_id``; a from-scratch tokenizer's vision
    start/end) followed by its timestamp as text (``int`` seconds of every second frame,
    ``timestamps[::2]``), then video end."""
    t, h, w = grid
    start, end = video_span_ids(ids)
    begin = ids.get("image_start_token_id", ids.get("vision_start_token_id"))
    close = ids.get("image_end_token_id", ids.get("vision_end_token_id"))
    times = frame_times[::2][:t]
    out: list[int | str] = [start]
    for k in range(t):
        out += [begin, *[ids["image_token_id"]] * (h * w // merge ** 2), close,
                str(int(times[k]))]
    return [*out, end]


# transformers' Glm4vVideoProcessor defaults: its smart_resize counting the frames, CLIP mean/std
VIDEO_PROCESSING = VideoProcessing("Glm4vVideoProcessor", min_pixels=112 * 112,
                                   max_pixels=28 * 28 * 2 * 30000, mean=CLIP_MEAN, std=CLIP_STD,
                                   layout=video_layout, size_rule=smart_resize_video,
                                   extra_ids=2,
                                   wrap=("video_start_token_id", "video_end_token_id"))
# transformers' Glm4vImageProcessor defaults: GLM-4V's own resize rule, CLIP mean/std
IMAGE_PROCESSING = ImageProcessing("Glm4vImageProcessor", patch_size=14, min_pixels=MIN_PIXELS,
                                   max_pixels=MAX_PIXELS, mean=CLIP_MEAN, std=CLIP_STD,
                                   size_rule=resize_size, video=VIDEO_PROCESSING)


def config_from_section(section, token_ids: dict | None) -> Glm4vConfig:
    """The ``Glm4vConfig`` of our YAML model section: the decoder's shape fields (GLM's switches
    added: qkv biases, GPT-J rotation, ``rotary_dim`` half the head dim unless set), ``vision``
    (``Glm4vVisionConfig`` fields; ``out_hidden_size`` defaults to ``hidden_size``) and the data
    tokenizer's ids. Its image placeholder and vision start/end become GLM's image id and
    image start/end; it names no video start/end, so those take the two ids after its own
    (``vocab_size`` must hold them; image-only data never uses them)."""
    if token_ids is None:
        raise ValueError("a GLM-4V model from scratch takes its token ids from the data's "
                         "tokenizer")
    top = max(token_ids.values())
    video_start, video_end = video_span_ids(token_ids)
    if section.vocab_size < top + 3:
        raise ValueError(f"model.vocab_size = {section.vocab_size} is smaller than {top + 3}: "
                         f"the VL tokenizer's ids plus GLM-4V's video start/end; raise it")
    vision = given(section.vision)
    vision.setdefault("out_hidden_size", section.hidden_size)
    try:
        vision_cfg = Glm4vVisionConfig(**vision)
    except TypeError as e:
        raise ValueError(f"model.vision: {e}; its keys are mpcore.models.glm4v.Glm4vVisionConfig's "
                         f"fields") from None
    fields = {k: v for k, v in section.shape_fields().items()
              if k not in ("qkv_bias", "rope_style")}  # GLM's own: always on, always gptj
    return Glm4vConfig(
        text=text_config(**fields), vision=vision_cfg,
        image_token_id=token_ids["image_token_id"], video_token_id=token_ids["video_token_id"],
        image_start_token_id=token_ids["vision_start_token_id"],
        image_end_token_id=token_ids["vision_end_token_id"],
        video_start_token_id=video_start, video_end_token_id=video_end)


def num_params(cfg: Glm4vConfig) -> dict[str, int]:
    """The decoder's counts plus its two extra norms per layer, and ``vision`` (the tower,
    included in ``total``)."""
    with torch.device("meta"):
        vision = sum(p.numel() for p in Glm4vVisionTower(cfg.vision).parameters())
    text = counts.num_params(cfg.text)
    sandwich = 2 * cfg.text.hidden_size * cfg.text.num_layers
    return {**text, "total": text["total"] + sandwich + vision, "vision": vision}


def flops_per_token(cfg: Glm4vConfig, seq_len: int) -> float:
    """The decoder's only (the tower's work depends on each batch's share of image tokens, so
    TFLOP/s and MFU of VL runs are lower bounds); the extra norms are not matmuls."""
    return counts.flops_per_token(cfg.text, seq_len)


FAMILY = Family(
    name="glm4v", config_type=Glm4vConfig, hf_architectures=(ARCH,),
    hf_model_types=(MODEL_TYPE,), config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build_model, load_hf=load_hf_model, export_hf=export_hf, shard_map=shard_map,
    local_inputs=local_glm4v_inputs, num_params=num_params, flops_per_token=flops_per_token,
    decoder=lambda model: model.text, vision=lambda model: model.visual,
    placeholder_ids=lambda cfg: cfg.placeholder_ids, modality="image-text",
    options=("vision_cp",), host_inputs=("grid_thw",),
    section=Glm4vSection, image_processing=IMAGE_PROCESSING, pipeline_stages=build_vl_stages)
