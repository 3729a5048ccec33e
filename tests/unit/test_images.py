"""mpcore.data.images against transformers' Qwen2-VL image processor, on the shipped images.

The reference is ``Qwen2VLImageProcessorPil`` (transformers 5.x,
``transformers.models.qwen2_vl.image_processing_pil_qwen2_vl``): the PIL + NumPy backend, which
needs no torchvision (``AutoImageProcessor`` and ``Qwen2VLImageProcessor`` pick the torchvision
backend, not installed here). Both sides resize with PIL bicubic on the same uint8 image, rescale
in float64 and normalise in float32, so the rows should agree bit for bit; the tolerance is
1e-6 (a few float32 ulps of values of size ~2) so that an equivalent reordering of the float
arithmetic would still pass while any wrong resize, channel or patch order (differences ~0.1
and up) fails. grid_thw must be equal exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mpcore.data.images import (
    check_image_size,
    load_image,
    num_placeholders,
    process_image,
    smart_resize,
)

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

IMAGES = Path(__file__).resolve().parents[2] / "launch" / "data" / "images"
TOL = 1e-6


def hf_processor(**kwargs):
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    return pil.Qwen2VLImageProcessorPil(**kwargs)


def hf_process(image, **kwargs):
    out = hf_processor(**kwargs)(images=[image], return_tensors="np")
    return torch.from_numpy(out["pixel_values"]), tuple(out["image_grid_thw"][0].tolist())


def ours(path, **kwargs):
    return process_image(load_image(path), **kwargs)


def assert_same(path, hf_kwargs=None, **kwargs):
    """Our rows and grid equal transformers' for the file at ``path``; returns our grid."""
    rows, grid = ours(path, **kwargs)
    with Image.open(path) as raw:  # transformers converts to RGB itself
        want_rows, want_grid = hf_process(raw, **(hf_kwargs or kwargs))
    assert grid == want_grid, path.name
    assert rows.dtype == torch.float32 and rows.shape == want_rows.shape, path.name
    assert float((rows - want_rows).abs().max()) <= TOL, path.name
    return grid


def test_every_shipped_image_matches_transformers_at_default_sizes():
    files = sorted(p for p in IMAGES.iterdir() if p.suffix in (".jpg", ".png"))
    assert len(files) >= 10
    grids = {assert_same(p) for p in files}
    assert len(grids) >= 5  # the set covers several grids


@pytest.mark.parametrize("name, kwargs, change", [
    ("microaneurysms.png", dict(min_pixels=224 * 224), "up"),  # 102x102 -> 224x224
    ("astronaut.jpg", dict(max_pixels=28 * 28 * 20), "down"),  # 256x256 -> 112x112
    ("rocket.jpg", dict(min_pixels=28 * 28, max_pixels=28 * 28 * 12), "down"),
    ("text.png", dict(min_pixels=320 * 320, max_pixels=28 * 28 * 400), "up"),
    # min = max: rounding up overshoots max_pixels (37632 > 31360), in transformers too
    ("chelsea.jpg", dict(min_pixels=28 * 28 * 40, max_pixels=28 * 28 * 40), "up"),
])
def test_resized_variants_match_transformers(name, kwargs, change):
    path = IMAGES / name
    with Image.open(path) as raw:
        before = raw.width * raw.height
    t, h, w = assert_same(path, **kwargs)
    after = h * w * 14 * 14
    if change == "up":
        assert before < after and kwargs["min_pixels"] <= after
    else:
        assert after < before and after <= kwargs["max_pixels"]


def test_other_patch_and_merge_sizes_match_transformers():
    kwargs = dict(patch_size=16, temporal_patch_size=3, merge_size=1)
    t, h, w = assert_same(IMAGES / "coffee.jpg", **kwargs)
    rows, _ = ours(IMAGES / "coffee.jpg", **kwargs)
    assert rows.shape == (h * w, 3 * 3 * 16 * 16) and t == 1


def test_rows_repeat_the_frame_and_follow_merge_windows():
    rows, (t, h, w) = ours(IMAGES / "camera.png", max_pixels=28 * 28 * 16)
    frames = rows.view(t * h * w, 3, 2, 14, 14)
    assert torch.equal(frames[:, :, 0], frames[:, :, 1])  # temporal padding by repetition
    # row 1 is the second patch of the first 2x2 window: image columns 14..27 of rows 0..13
    image = load_image(IMAGES / "camera.png").resize((w * 14, h * 14), Image.Resampling.BICUBIC)
    red = torch.from_numpy(np.asarray(image)[:14, 14:28, 0].astype(np.float64) / 255).float()
    assert torch.allclose(frames[1, 0, 0], (red - 0.48145466) / 0.26862954, atol=1e-5)
    assert num_placeholders((t, h, w), 2) == rows.shape[0] // 4


def test_transparency_is_composited_onto_white(tmp_path):
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (70, 90, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    assert_same(tmp_path / "a.png")


def test_smart_resize_equals_transformers_over_many_sizes():
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    rng = np.random.default_rng(1)
    for _ in range(2000):
        height, width = (int(v) for v in rng.integers(1, 4000, 2))
        if max(height, width) / min(height, width) > 200:
            continue
        lo = int(rng.integers(1, 200)) * 28
        hi = lo * int(rng.integers(1, 50))
        want = pil.smart_resize(height, width, factor=28, min_pixels=lo, max_pixels=hi)
        assert smart_resize(height, width, min_pixels=lo, max_pixels=hi) == want


def test_smart_resize_rejects_thin_images_and_bad_ranges():
    with pytest.raises(ValueError, match="aspect ratio 201.0, over the 200"):
        smart_resize(10, 2010)
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        smart_resize(100, 100, min_pixels=1000, max_pixels=10)
    assert smart_resize(10, 2000) == (28, 812)  # ratio 200 is accepted (and scaled up)
    h, w = smart_resize(1000, 3000, max_pixels=28 * 28 * 30)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 30 and math.isclose(w / h, 3, rel_tol=0.3)


def test_no_resize_needs_a_fitting_image(tmp_path):
    Image.new("RGB", (112, 56), (10, 20, 30)).save(tmp_path / "fits.png")
    rows, grid = process_image(load_image(tmp_path / "fits.png"), resize=False)
    assert grid == (1, 4, 8) and rows.shape == (32, 1176)
    with pytest.raises(ValueError, match=r"big.png: 56x112 = 6272 pixels is over max_pixels=3136"):
        process_image(load_image(tmp_path / "fits.png"), resize=False, max_pixels=3136,
                      name=str(tmp_path / "big.png"))
    with pytest.raises(ValueError, match="multiples of patch_size \\* merge_size = 28"):
        check_image_size(100, 56)


def test_load_image_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"nope.png: no such image file"):
        load_image(tmp_path / "nope.png")
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match=r"junk.png: cannot read the image"):
        load_image(tmp_path / "junk.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "pic.bmp")
    with pytest.raises(ValueError, match=r"pic.bmp: image format BMP, expected PNG or JPEG"):
        load_image(tmp_path / "pic.bmp")
    image = load_image(IMAGES / "camera.png")  # grey levels -> three equal channels
    assert image.mode == "RGB"
    array = np.asarray(image)
    assert (array[..., 0] == array[..., 2]).all()
