"""GLM-4V's resize rule (``models.glm4v.processor.resize_size``) vs transformers: its
``smart_resize`` on random sizes (tiny, huge, thin ones included) and its image processor's grids
on the images shipped in launch/data/images; and where it differs from Qwen2-VL's rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

from models.glm4v.processor import resize_size
from mpcore.data.images import smart_resize as qwen_resize

IMAGES = Path(__file__).resolve().parents[2] / "launch" / "data" / "images"


def test_matches_transformers_smart_resize():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.cat([torch.randint(1, 60, (300, 2), generator=gen),
                       torch.randint(1, 9000, (700, 2), generator=gen)]).tolist()
    sizes += [[28, 28], [27, 5000], [5000, 27], [112, 112], [6000, 6000], [14, 2000]]
    checked = 0
    for h, w in sizes:
        try:
            want = smart_resize(num_frames=2, height=h, width=w, temporal_factor=2, factor=28,
                                min_pixels=112 * 112, max_pixels=28 * 28 * 15000)
        except ValueError:
            with pytest.raises(ValueError, match="aspect ratio"):
                resize_size(h, w)
            continue
        assert resize_size(h, w) == want, (h, w)
        checked += 1
    assert checked > 900


def test_shipped_images_match_the_glm4v_processor():
    from PIL import Image
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    processor = Glm4vImageProcessorPil()  # torchvision is not installed; same resize rule
    paths = sorted(p for p in IMAGES.iterdir() if p.suffix in (".png", ".jpg"))
    assert paths
    differs = 0
    for path in paths:
        image = Image.open(path).convert("RGB")
        grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
        h, w = resize_size(image.height, image.width)
        assert grid == [1, h // 14, w // 14], path.name
        differs += (h, w) != qwen_resize(image.height, image.width)
    # mpcore's image path (Qwen2-VL's rule, its default bounds) agrees on the shipped images,
    # so glm4v_tiny.yaml trains on GLM-4V's sizes; larger and tiny images differ:
    assert differs == 0
    assert resize_size(2000, 3000) == (1960, 2968) != qwen_resize(2000, 3000) == (812, 1204)
    assert resize_size(10, 300) != qwen_resize(10, 300)
