"""GLM-4V's image resize rule: the size its processor resizes an image to before patching.

It differs from Qwen2-VL's (``mpcore.models.common.resize.smart_resize``) in three ways: an image with a
side below ``factor = patch_size * merge_size`` is first scaled up (aspect kept, sides truncated
to ints) until its smaller side reaches it; the pixel bounds count the ``temporal_patch_size``
frames an image is repeated to (``2 * h * w`` is compared with them, and the shrink / grow
factor uses it too); and the bounds default to ``112 * 112`` and ``28 * 28 * 15000``
(transformers' ``Glm4vImageProcessor.size``). Patching itself (rows in merge-block order, CLIP
mean/std, bicubic resampling) is Qwen2-VL's. Pinned to transformers 5.x ``smart_resize`` of
``models/glm4v/image_processing_pil_glm4v.py``, float expressions in its order so that sizes agree
at rounding boundaries.
"""

from __future__ import annotations

from mpcore.models.common.resize import MAX_ASPECT_RATIO, fit_frames

MIN_PIXELS = 112 * 112
MAX_PIXELS = 28 * 28 * 15000


def resize_size(height: int, width: int, *, patch_size: int = 14, merge_size: int = 2,
                temporal_patch_size: int = 2, min_pixels: int = MIN_PIXELS,
                max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """``(height, width)`` GLM-4V resizes a ``height x width`` image to: multiples of
    ``patch_size * merge_size`` within the pixel bounds (module docstring). ``ValueError`` for
    a non-positive size or an aspect ratio over 200 (transformers refuses those too)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"glm4v resize: image size {height}x{width} must be positive")
    frames = temporal_patch_size  # an image is repeated to fill one temporal patch
    return fit_frames(height, width, patch_size * merge_size, bound_frames=frames,
                      scale_frames=frames, min_pixels=min_pixels, max_pixels=max_pixels,
                      what=f"glm4v resize: a {{size}} image has an aspect ratio over "
                           f"{MAX_ASPECT_RATIO}; crop it or pad it closer to square")
