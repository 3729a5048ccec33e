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


def _random(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


@pytest.mark.parametrize("mode", ["P", "P+transparency", "L", "LA", "1", "CMYK", "RGBA"])
def test_modes_convert_as_transformers_converts_them(tmp_path, mode):
    base = Image.fromarray(_random((61, 83, 3)))
    if mode == "P":
        image, suffix = base.quantize(64), "png"
    elif mode == "P+transparency":
        image, suffix = base.quantize(64), "png"
        image.info["transparency"] = 5  # palette entry 5 is see-through
    elif mode == "CMYK":
        image, suffix = Image.fromarray(_random((61, 83, 4)), "CMYK"), "jpg"
    elif mode == "RGBA":
        image, suffix = Image.fromarray(_random((61, 83, 4)), "RGBA"), "png"
    else:
        image, suffix = base.convert(mode), "png"
    path = tmp_path / f"x.{suffix}"
    image.save(path, **({"transparency": 5} if mode == "P+transparency" else {}))
    with Image.open(path) as raw:
        assert raw.mode == mode.split("+")[0]
    assert_same(path)


def test_exif_orientation_is_applied_as_transformers_load_image_does(tmp_path):
    image_utils = pytest.importorskip("transformers.image_utils")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": the camera was held upright
    Image.fromarray(_random((56, 112, 3))).save(tmp_path / "rot.jpg", exif=exif, quality=95)
    rows, grid = ours(tmp_path / "rot.jpg")
    want_rows, want_grid = hf_process(image_utils.load_image(str(tmp_path / "rot.jpg")))
    assert load_image(tmp_path / "rot.jpg").size == (56, 112)  # shown upright: taller than wide
    assert grid == want_grid and float((rows - want_rows).abs().max()) <= TOL


def test_16bit_grey_png_is_scaled_not_saturated_and_warns_once(tmp_path, caplog, monkeypatch):
    from mpcore.data import images

    monkeypatch.setattr(images, "_warned_16bit", False)
    values = np.random.default_rng(3).integers(0, 65536, (60, 80), dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "a.png")
    Image.fromarray(values[::-1].copy()).save(tmp_path / "b.png")
    with Image.open(tmp_path / "a.png") as raw:
        assert raw.mode == "I;16"
        # what transformers' conversion gives: nearly everything clipped to white
        assert (np.asarray(raw.convert("RGB")) == 255).mean() > 0.98
    with caplog.at_level("WARNING", logger="mpcore.data.images"):
        image = load_image(tmp_path / "a.png")
        load_image(tmp_path / "b.png")
    pixels = np.asarray(image)
    assert (pixels == (values >> 8).astype(np.uint8)[..., None]).all()
    assert 100 < pixels.mean() < 155  # the picture is there, not white
    warnings = [r.getMessage() for r in caplog.records if "16-bit" in r.getMessage()]
    assert len(warnings) == 1 and "a.png" in warnings[0] and "transformers" in warnings[0]


@pytest.mark.parametrize("kind", ["truncated png", "truncated jpeg", "flipped png"])
def test_damaged_files_name_the_file(tmp_path, kind):
    suffix = "jpg" if "jpeg" in kind else "png"
    good = tmp_path / f"good.{suffix}"
    Image.fromarray(_random((64, 64, 3))).save(good)
    data = bytearray(good.read_bytes())
    if kind.startswith("truncated"):
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    bad = tmp_path / f"bad.{suffix}"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"bad\.{suffix}: cannot read the image"):
        load_image(bad)


def test_an_image_too_large_to_decode_safely_names_the_file(tmp_path, monkeypatch):
    Image.new("RGB", (200, 100)).save(tmp_path / "huge.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow refuses over twice this
    with pytest.raises(ValueError, match=r"huge\.png: .*decompression bomb"):
        load_image(tmp_path / "huge.png")
