"""The Qwen3-VL processors' defaults (transformers' Qwen3VLVideoProcessor and the released
checkpoints' Qwen2VLImageProcessor settings) and how a video is written into the text; the
qwen3_vl and qwen3_5_vl families (and their MoE variants) use them."""

from __future__ import annotations

from mpcore.models.common.family import ImageProcessing, VideoProcessing
from mpcore.models.common.resize import smart_resize_video


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
