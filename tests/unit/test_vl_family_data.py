"""Prepared VL data follows the run's model family: each image's rows and grid are those of the
family's transformers image processor (Qwen2VLImageProcessor for qwen2_vl, the same class with
Qwen3-VL's patch 16 and mean = std = 0.5 for qwen3_vl, Glm4vImageProcessor for glm4v; the PIL
backends, built with explicit arguments, no download), on images of odd sizes (thin, tiny,
non-multiples of any patch). The folder records the family, the fingerprint covers it, and a run
of another family refuses it naming the prepare command, unless that family processes images and
videos identically (compared by content: Qwen3.5-VL takes Qwen3-VL's data); the shipped set is
prepared per family.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpcore.config import load_config
from mpcore.data import VLDataset, VLTokenizer, prepare_default
from mpcore.data.vl_dataset import dataset_fingerprint
from mpcore.data.vl_default import default_settings
from mpcore.data.vl_manifest import ImageSettings
from mpcore.launch import prepare_vl_data
from mpcore.models import family_named
from mpcore.parallel.state import ParallelState
from mpcore.vl_data import build_vl_loaders, vl_sources

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"qwen2_vl": "vl_tiny.yaml", "qwen3_vl": "qwen3_vl_tiny.yaml",
           "glm4v": "glm4v_tiny.yaml"}
# (height, width): thin, smaller than one merge block on a side, odd, large enough to shrink
SIZES = [(37, 91), (123, 45), (20, 300), (301, 199), (640, 1001)]


def hf_processor(family: str):
    """transformers' image processor of ``family``, as its checkpoints configure it."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if family == "qwen2_vl":
        return Qwen2VLImageProcessorPil()
    if family == "qwen3_vl":  # Qwen3-VL's preprocessor_config.json
        return Qwen2VLImageProcessorPil(
            patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
            image_std=[0.5] * 3, size={"shortest_edge": 65536, "longest_edge": 16777216})
    return Glm4vImageProcessorPil()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vl_family")
    prepare_default(path)
    return path


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("odd_images")
    rng = np.random.default_rng(3)
    lines = []
    for k, (h, w) in enumerate(SIZES):
        name = f"img{k}.png" if k % 2 else f"img{k}.jpg"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
        lines.append({"image": name, "caption": f"Picture {k}."})
    path = folder / "m.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def prepare(family: str, manifest: Path, data_dir: Path, out: Path) -> VLDataset:
    tokenizer = prepare_default(data_dir)[0]
    assert prepare_vl_data.main(["--family", family, "--manifest", str(manifest), "--tokenizer",
                                 str(tokenizer), "--out", str(out)]) == 0
    return VLDataset(out)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_rows_and_grids_equal_the_family_processor(family, manifest, data_dir, tmp_path):
    ds = prepare(family, manifest, data_dir, tmp_path / family)
    assert ds.settings.family == family and ds.meta["image_settings"]["family"] == family
    processor = hf_processor(family)
    folder = manifest.parent
    for k in range(len(ds)):
        image = Image.open(folder / (f"img{k}.png" if k % 2 else f"img{k}.jpg")).convert("RGB")
        want = processor(images=[image], return_tensors="pt")
        sample = ds[k]
        assert sample.grid_thw.tolist() == want["image_grid_thw"].tolist(), (family, k)
        assert sample.pixel_values.shape == tuple(want["pixel_values"].shape), (family, k)
        torch.testing.assert_close(torch.tensor(sample.pixel_values),
                                   want["pixel_values"].float(), atol=1e-5, rtol=0)
        merge = processor.merge_size
        runs = int(np.prod(sample.grid_thw[0])) // merge ** 2
        assert int((sample.input_ids == ds.tokenizer.image_pad_id).sum()) == runs


def test_the_families_differ_on_these_images(manifest, data_dir, tmp_path):
    """The test above would not catch a path that ignores the family: here the three grids
    differ on some image (Qwen3-VL's patch 16; GLM-4V's rule on the thin one)."""
    grids = {}
    for family in CONFIGS:
        ds = prepare(family, manifest, data_dir, tmp_path / family)
        grids[family] = [ds[k].grid_thw.tolist() for k in range(len(ds))]
    assert grids["qwen2_vl"] != grids["qwen3_vl"] and grids["qwen2_vl"] != grids["glm4v"]


def test_fingerprint_covers_the_family(manifest, data_dir):
    tokenizer = prepare_default(data_dir)[0]
    prints = {f: dataset_fingerprint(manifest, tokenizer,
                                     ImageSettings.for_family(family_named(f))) for f in CONFIGS}
    assert len(set(prints.values())) == 3
    # same numbers, another family's name: still another fingerprint
    q2 = ImageSettings.for_family(family_named("qwen2_vl"))
    relabelled = ImageSettings(**{**q2.to_json(), "family": "glm4v", "mean": q2.mean,
                                  "std": q2.std})
    assert dataset_fingerprint(manifest, tokenizer, relabelled) != prints["qwen2_vl"]


def test_training_another_family_refuses_the_data(manifest, data_dir, tmp_path):
    folder = prepare("qwen2_vl", manifest, data_dir, tmp_path / "q2")
    cfg = load_config(REPO / "launch" / "configs" / CONFIGS["glm4v"],
                      [f"data.vl_paths=[{folder.folder}]", f"data.cache_dir={data_dir}"])
    with pytest.raises(ValueError) as err:
        build_vl_loaders(cfg, ParallelState(), family_named("glm4v"))
    message = str(err.value)
    assert f"{folder.folder} was prepared for the qwen2_vl family's image processor" in message
    assert "trains the glm4v family" in message
    assert (f"python launch/prepare_vl_data.py --family glm4v --manifest {manifest.resolve()} "
            f"--tokenizer {folder.folder}/tokenizer.json --out NEW_DIR") in message
    # the family it was prepared for takes it
    cfg = load_config(REPO / "launch" / "configs" / CONFIGS["qwen2_vl"],
                      [f"data.vl_paths=[{folder.folder}]", f"data.cache_dir={data_dir}",
                       "data.seq_len=1024", "data.micro_batch=1"])
    loader, *_ = build_vl_loaders(cfg, ParallelState(), family_named("qwen2_vl"))
    assert loader.num_samples > 0


def test_old_data_reads_as_qwen2_vl(manifest, data_dir, tmp_path):
    """A folder prepared before settings named their family (all Qwen2-VL's then)."""
    ds = prepare("qwen2_vl", manifest, data_dir, tmp_path / "old")
    meta = json.loads((ds.folder / "meta.json").read_text())
    del meta["image_settings"]["family"]
    (ds.folder / "meta.json").write_text(json.dumps(meta))
    assert VLDataset(ds.folder).settings.family == "qwen2_vl"


def test_shipped_set_is_prepared_per_family(data_dir):
    folders = {}
    for name, config in CONFIGS.items():
        cfg = load_config(REPO / "launch" / "configs" / config,
                          [f"data.cache_dir={data_dir}", "data.default_vocab_size=2048"])
        family = family_named(name)
        (folder,), _, tok = vl_sources(cfg, family)
        ds = VLDataset(folder)
        assert ds.settings == default_settings(family) and ds.settings.family == name
        assert isinstance(tok, VLTokenizer)
        proc = family.image_processing
        assert ds.patch_dim == 3 * proc.temporal_patch_size * proc.patch_size ** 2
        folders[name] = folder
    assert len(set(folders.values())) == 3


def test_data_of_a_family_with_the_same_processing_is_taken(manifest, data_dir, tmp_path):
    """Issue 39: Qwen3.5-VL processes images and videos exactly as Qwen3-VL does (the same
    processor, patch, bounds, normalisation, resize rules and video layout), yet refused
    Qwen3-VL-prepared data by its family's name. The rule is now equal processing, by content:
    taken by qwen3_5_vl, still refused by glm4v (another processor)."""
    folder = prepare("qwen3_vl", manifest, data_dir, tmp_path / "q3")
    assert family_named("qwen3_5_vl").image_processing == family_named(
        "qwen3_vl").image_processing
    cfg = load_config(REPO / "launch" / "configs" / "qwen35_vl_tiny.yaml",
                      [f"data.vl_paths=[{folder.folder}]", f"data.cache_dir={data_dir}",
                       "data.seq_len=1024", "data.micro_batch=1"])
    loader, *_ = build_vl_loaders(cfg, ParallelState(), family_named("qwen3_5_vl"))
    assert loader.num_samples > 0
    cfg = load_config(REPO / "launch" / "configs" / CONFIGS["glm4v"],
                      [f"data.vl_paths=[{folder.folder}]", f"data.cache_dir={data_dir}"])
    with pytest.raises(ValueError, match="was prepared for the qwen3_vl family's image "
                                         "processor, but this run trains the glm4v family"):
        build_vl_loaders(cfg, ParallelState(), family_named("glm4v"))
