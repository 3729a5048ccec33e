"""The resize rules of the VL families' image and video processors, and their defaults.

    smart_resize(h, w, ...)             Qwen2-VL's image rule: (h', w') multiples of
                                        patch*merge, pixel count within the bounds
    fit_frames(h, w, factor, ...)       the rule GLM-4V's images and the Qwen3-VL / GLM-4V
                                        videos share (frames counted against the bounds)
    smart_resize_video(n, h, w, ...)    that rule for ``n`` frames (Qwen3-VL, GLM-4V videos)

They live here, below the families, because a family's record names its processor's rule
(``ImageProcessing.size_rule`` / ``VideoProcessing.size_rule``) and ``models`` never imports the
runtime; ``mpcore.data.images`` / ``videos`` apply them. Pure integer and float arithmetic
pinned to transformers 5.x (float expressions in its order, so that sizes agree at rounding
boundaries); tests/unit/test_images.py, test_glm4v_processor.py and test_video_processing.py
check them against transformers.
"""

from __future__ import annotations

import math

# OpenAI CLIP statistics (the Qwen2-VL vision tower was trained with them).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200  # the Qwen2-VL processor refuses thinner images


def fit_frames(height: int, width: int, factor: int, *, bound_frames: int, scale_frames: int,
               min_pixels: int, max_pixels: int, what: str) -> tuple[int, int]:
    """The resize rule GLM-4V's image processor and the Qwen3-VL / GLM-4V video processors share
    (transformers 5.x, float expressions in its order): a side below ``factor`` first scaled
    up (aspect kept, truncated), sides rounded to multiples of ``factor``, the pixel bounds
    compared with ``bound_frames * h * w`` and the shrink / grow factor taken from
    ``scale_frames * height * width`` (an image: both its ``temporal_patch_size`` copies; a
    video: its frame count rounded to temporal patches, and as given). ``ValueError`` naming
    ``what`` (e.g. "a 10x3000 image") for an aspect ratio over ``MAX_ASPECT_RATIO``."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(what.format(size=f"{height}x{width}"))
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if bound_frames * h * w > max_pixels:
        beta = math.sqrt((scale_frames * height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif bound_frames * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (scale_frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def smart_resize(height: int, width: int, *, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The size Qwen2-VL resizes a ``height x width`` image to: both sides multiples of
    ``factor`` (``patch_size * merge_size``), ``min_pixels <= h * w <= max_pixels`` where
    the rounding allows, aspect ratio kept as far as the rounding allows.

    Each side is first rounded to the nearest multiple (Python's ``round``: halves go to even,
    as in transformers). Too many pixels: scale both sides by ``sqrt(max_pixels / (h*w))`` and
    round DOWN to multiples (at least ``factor``). Too few: scale by ``sqrt(min_pixels /
    (h*w))`` and round UP. The float expressions follow transformers' order of operations so
    that sizes agree exactly, including at rounding boundaries.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"images.smart_resize: image size {height}x{width} must be positive")
    if factor <= 0 or not 0 < min_pixels <= max_pixels:
        raise ValueError(f"images.smart_resize: need factor > 0 and 0 < min_pixels <= "
                         f"max_pixels, got factor={factor}, min_pixels={min_pixels}, "
                         f"max_pixels={max_pixels}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"images.smart_resize: a {height}x{width} image has aspect ratio "
                         f"{ratio:.1f}, over the {MAX_ASPECT_RATIO} Qwen2-VL accepts; crop it "
                         f"or pad it closer to square")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def smart_resize_video(num_frames: int, height: int, width: int, *, patch_size: int = 14,
                       merge_size: int = 2, temporal_patch_size: int = 2,
                       min_pixels: int = 112 * 112, max_pixels: int = 28 * 28 * 2 * 30000
                       ) -> tuple[int, int]:
    """The size GLM-4V's and Qwen3-VL's video processors resize ``num_frames`` frames of
    ``height x width`` to (the same function in both, transformers 5.x): a side below
    ``factor = patch_size * merge_size`` first scaled up (aspect kept, truncated), sides
    rounded to multiples of ``factor``, and the bounds compared with ``t_bar * h * w`` (the
    frame count rounded to a multiple of ``temporal_patch_size``), the shrink / grow factor
    from ``num_frames * height * width``. Float expressions in transformers' order.
    ``ValueError`` for fewer than ``temporal_patch_size`` frames (the processors refuse them)
    or an aspect ratio over 200."""
    if num_frames < temporal_patch_size:
        raise ValueError(f"a video of {num_frames} frame(s) is shorter than one temporal patch "
                         f"({temporal_patch_size} frames), which this family's video processor "
                         f"refuses; give at least {temporal_patch_size} frames (or repeat it)")
    t = round(num_frames / temporal_patch_size) * temporal_patch_size
    return fit_frames(height, width, patch_size * merge_size, bound_frames=t,
                      scale_frames=num_frames, min_pixels=min_pixels, max_pixels=max_pixels,
                      what=f"frames of {{size}} have an aspect ratio over {MAX_ASPECT_RATIO}; "
                           f"crop them closer to square")
