"""Images -> vision-tower input rows, the Qwen2-VL way (what its Hugging Face processor returns).

    load_image(path)                 -> PIL RGB image (PNG or JPEG only), as transformers
                                        converts it (EXIF orientation, alpha, palette, CMYK)
    smart_resize(h, w, ...)          -> (h', w'): multiples of patch*merge, pixel count in range
                                        (the rule itself: ``mpcore.models.common.resize``)
    process_image(image, ...)        -> (pixel_values [N, C*T*P*P] float32, (t, h, w))
    num_placeholders(grid_thw, m)    -> how many placeholder tokens the image takes in the text

Steps of ``process_image``: RGB (transparency composited onto white), bicubic resize (PIL) to
``smart_resize``'s size, rescale by 1/255, normalise with the OpenAI CLIP mean/std, repeat the
single frame ``temporal_patch_size`` times (an image is a video of one temporal patch), cut into
``P x P`` patches. Layout of the rows: grid ``(t, h, w) = (1, H/P, W/P)``; rows go window by
window (``merge x merge`` patches that the vision tower's merger fuses into one token; windows in
row-major order, patches row-major inside a window), so row ``r`` belongs to placeholder token
``r // merge**2``. Columns of a row are ordered ``(C, T, P, P)``. This is the order the
transformers Qwen2-VL processor (PIL backend) produces; tests/unit/test_images.py checks it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from mpcore.models.common.resize import (
    CLIP_MEAN,
    CLIP_STD,
    MAX_PIXELS,
    MIN_PIXELS,
    smart_resize,
)

FORMATS = ("PNG", "JPEG")
logger = logging.getLogger(__name__)


def resize_to(height: int, width: int, *, patch_size: int = 14, merge_size: int = 2,
              temporal_patch_size: int = 2, min_pixels: int = MIN_PIXELS,
              max_pixels: int = MAX_PIXELS, size_rule=None) -> tuple[int, int]:
    """The ``(height, width)`` an image is resized to: by ``size_rule`` (a family's own rule,
    ``(height, width, *, patch_size, merge_size, temporal_patch_size, min_pixels, max_pixels)
    -> (height, width)``, e.g. GLM-4V's, which counts the temporal frames against the bounds),
    or when None by Qwen2-VL's :func:`smart_resize` with ``factor = patch_size * merge_size``."""
    if size_rule is not None:
        return size_rule(height, width, patch_size=patch_size, merge_size=merge_size,
                         temporal_patch_size=temporal_patch_size, min_pixels=min_pixels,
                         max_pixels=max_pixels)
    return smart_resize(height, width, factor=patch_size * merge_size, min_pixels=min_pixels,
                        max_pixels=max_pixels)


def check_image_size(height: int, width: int, *, factor: int = 28,
                     max_pixels: int = MAX_PIXELS, name: str = "image") -> None:
    """For an image used at its own size (no resize): ``ValueError`` unless both sides are
    multiples of ``factor`` and ``height * width <= max_pixels``. ``name`` (a path, say) goes
    into the message."""
    if height % factor or width % factor:
        raise ValueError(f"{name}: {height}x{width} is used without resizing, so both sides must "
                         f"be multiples of patch_size * merge_size = {factor}; resize it (pass "
                         f"resize=True) or crop it to {height // factor * factor}x"
                         f"{width // factor * factor}")
    if height * width > max_pixels:
        raise ValueError(f"{name}: {height}x{width} = {height * width} pixels is over "
                         f"max_pixels={max_pixels} and resizing is off; pass resize=True to "
                         f"shrink it, or raise max_pixels")


def load_image(path: str | Path):
    """The PNG or JPEG file at ``path`` as a PIL RGB image, decoded now, converted as
    transformers converts it: the EXIF orientation applied (``transformers.image_utils.
    load_image`` does), transparency composited onto white and palettes, grey levels and CMYK
    turned into RGB (its processors do). 16-bit grey levels are scaled to 8 bits (module
    ``to_8bit``). ``ValueError`` naming the path when the file is missing, unreadable,
    truncated, too large to decode safely, or of another format."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such image file; image paths are relative to the input "
                         f"file's folder unless absolute")
    try:
        with Image.open(path) as image:
            if image.format not in FORMATS:
                raise ValueError(f"{path}: image format {image.format}, expected PNG or JPEG; "
                                 f"convert it (e.g. PIL: Image.open(p).save('x.png'))")
            image.load()
            return to_rgb(ImageOps.exif_transpose(image), path)
    except Image.DecompressionBombError as e:
        raise ValueError(f"{path}: {e}; shrink the image before using it") from None
    except (OSError, UnidentifiedImageError, SyntaxError) as e:
        # SyntaxError: what Pillow raises for some malformed PNG chunks
        raise ValueError(f"{path}: cannot read the image ({e}); is it a valid PNG or JPEG "
                         f"(a truncated or damaged file fails here)?") from e


_warned_16bit = False


def to_8bit(image, path: str | Path = "image"):
    """``image`` with 16-bit grey levels (Pillow modes ``I;16*`` / ``I``) scaled to 8 bits (the
    high byte, as Pillow itself reads 16-bit RGB PNGs); other images unchanged.

    Pillow's own ``convert("RGB")`` clips such values at 255, so nearly every pixel of a
    16-bit PNG turns white; transformers' loader and processors convert that way, so the first
    such file gets a warning that it will look different there."""
    global _warned_16bit
    from PIL import Image

    if image.mode not in ("I;16", "I;16L", "I;16B", "I"):
        return image
    values = np.asarray(image).astype(np.int64)  # (H, W)
    grey = Image.fromarray((values.clip(0, 65535) >> 8).astype(np.uint8), "L")
    transparent = image.info.get("transparency")
    if transparent is not None:  # a tRNS grey value: those pixels become transparent
        alpha = Image.fromarray(np.where(values == transparent, 0, 255).astype(np.uint8), "L")
        grey = Image.merge("LA", (grey, alpha))
    if not _warned_16bit:
        _warned_16bit = True
        logger.warning("%s: a 16-bit greyscale image, scaled to 8 bits here; transformers' "
                       "image loading clips it at 255 instead (nearly all white), so a model "
                       "fed by transformers sees it differently: save it as 8-bit to agree "
                       "(warned once)", path)
    return grey


def to_rgb(image, name: str | Path = "image"):
    """A PIL image in mode RGB, as transformers' processors convert one: an alpha channel (or
    a palette's transparency) composited onto white rather than dropped, 16-bit grey levels
    scaled first (``to_8bit``; ``name`` goes into its warning)."""
    from PIL import Image

    image = to_8bit(image, name)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def process_image(image, *, patch_size: int = 14, temporal_patch_size: int = 2,
                  merge_size: int = 2, min_pixels: int = MIN_PIXELS,
                  max_pixels: int = MAX_PIXELS, mean: tuple[float, ...] = CLIP_MEAN,
                  std: tuple[float, ...] = CLIP_STD, resize: bool = True, name: str = "image",
                  size_rule=None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``(pixel_values [t*h*w, 3*T*P*P] float32, (t, h, w))`` of one image for the vision tower.

    ``image``: a PIL image (any mode) or a uint8 array ``[H, W, 3]``. ``T`` is
    ``temporal_patch_size``, ``P`` is ``patch_size``; ``t = 1``, ``h = H'/P``, ``w = W'/P``
    where ``H' x W'`` is ``smart_resize``'s size (or the image's own size when ``resize`` is
    False: then it must pass ``check_image_size``). ``size_rule``: a family's own resize rule
    instead of ``smart_resize`` (``(height, width, *, patch_size, merge_size,
    temporal_patch_size, min_pixels, max_pixels) -> (height, width)``, e.g. GLM-4V's, which
    counts the temporal frames against the bounds). Row order: see the module docstring.
    """
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"{name}: an array image must be uint8 [H, W, 3], got "
                             f"{image.dtype} {list(image.shape)}")
        image = Image.fromarray(image)
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"{name}: mean and std need one value per RGB channel, got "
                         f"{len(mean)} and {len(std)}")
    image = to_rgb(image, name)
    factor = patch_size * merge_size
    width, height = image.size  # PIL sizes are (width, height)
    if resize:
        height, width = resize_to(height, width, patch_size=patch_size, merge_size=merge_size,
                                  temporal_patch_size=temporal_patch_size,
                                  min_pixels=min_pixels, max_pixels=max_pixels,
                                  size_rule=size_rule)
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    else:
        check_image_size(height, width, factor=factor, max_pixels=max_pixels, name=name)
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # (C, H, W) uint8
    # rescale in float64 then round once to float32, as transformers does (bit-identical rows)
    pixels = (pixels.double() * (1 / 255)).float()
    mean_t = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    pixels = (pixels - mean_t) / std_t
    return patchify(pixels, patch_size, temporal_patch_size, merge_size)


def patchify(pixels: torch.Tensor, patch_size: int, temporal_patch_size: int, merge_size: int
             ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``pixels [C, H, W]`` (H, W multiples of ``patch_size * merge_size``) -> rows
    ``[h*w, C*T*P*P]`` in merge-window order, and the grid ``(1, h, w)``."""
    channels, height, width = pixels.shape
    m, p = merge_size, patch_size
    grid_h, grid_w = height // p, width // p
    windows = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    windows = windows.permute(1, 4, 2, 5, 0, 3, 6)  # (h/m, w/m, m, m, C, P, P)
    # one frame repeated T times: the same patch at every temporal offset
    frames = windows.unsqueeze(5).expand(*windows.shape[:5], temporal_patch_size, p, p)
    rows = frames.reshape(grid_h * grid_w, channels * temporal_patch_size * p * p)
    return rows.contiguous(), (1, grid_h, grid_w)


def num_placeholders(grid_thw: tuple[int, int, int] | list[int], merge_size: int = 2) -> int:
    """Placeholder tokens an image of grid ``(t, h, w)`` takes in the text: ``t*h*w /
    merge_size**2`` (the vision tower's merger fuses each ``merge x merge`` window)."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)
