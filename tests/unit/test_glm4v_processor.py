"""GLM-4V's resize rule (``mpcore.models.glm4v.processor.resize_size``) vs transformers: its
``smart_resize`` on random sizes (tiny, huge, thin ones included) and its image processor's grids
on the images shipped in launch/data/images; and where it differs from Qwen2-VL's rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

from mpcore.data.images import smart_resize as qwen_resize
from mpcore.models.glm4v.processor import resize_size

REPO = Path(__file__).resolve().parents[2]

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


def test_score_images_form_resizes_by_the_family_rule(tmp_path):
    """score.py's ``images`` form on a GLM-4V checkpoint resizes by GLM-4V's rule (through the
    family's ``image_size_rule``), so a small image gets transformers' grid and pixels; with
    Qwen2-VL's rule (what every family got before) its grid differs."""
    import json

    import numpy as np
    import torch
    from PIL import Image
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from mpcore.config import load_config
    from mpcore.launch.score import checkpoint_spec
    from mpcore.launch.score_io import read_input
    from mpcore.models.glm4v import FAMILY

    ids = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302,
               vision_end_token_id=303)
    cfg = FAMILY.config_from_section(
        load_config(REPO / "launch" / "configs" / "glm4v_tiny.yaml", ["model.vocab_size=518"])
        .model, ids)
    (tmp_path / "config.json").write_text(json.dumps(FAMILY.hf_config_dict(cfg)))
    processor = Glm4vImageProcessorPil()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": dict(processor.size), "image_mean": list(processor.image_mean),
         "image_std": list(processor.image_std), "patch_size": 14, "merge_size": 2,
         "temporal_patch_size": 2}))
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (10, 300, 3), dtype=np.uint8))
    image.save(tmp_path / "thin.png")
    (tmp_path / "in.jsonl").write_text(json.dumps(
        {"input_ids": [5, ids["vision_start_token_id"], ids["image_token_id"],
                       ids["vision_end_token_id"], 7], "images": ["thin.png"]}) + "\n")
    spec = checkpoint_spec(tmp_path)
    assert spec.size_rule is resize_size
    (item,) = read_input(tmp_path / "in.jsonl", spec)
    theirs = processor(images=[image], return_tensors="pt")
    assert [list(g) for g in item.image_grid_thw] == theirs["image_grid_thw"].tolist()
    assert torch.allclose(item.pixel_values, theirs["pixel_values"].float(), atol=1e-5)
    assert resize_size(10, 300) != qwen_resize(10, 300)  # the rule matters for this image
