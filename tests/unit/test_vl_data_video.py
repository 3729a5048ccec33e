"""Videos in prepared VL data, and the start check of the tower's patch geometry.

A manifest with videos (frame files; a video caption line and an interleaved line with an image,
a video and text) is prepared for qwen2_vl, qwen3_vl and glm4v: each video's rows and grid are
what the family's transformers video processor gives (the sha256 recorded from it in
tests/unit/test_video_processing.py, same frames and bounds), its ids are the family's layout,
never targets, and the micro-batch goes through the family's input builder (the placement and
M-RoPE rule score.py uses) with the video rows after the images'. The fingerprint covers every
frame's bytes; folders of version 1 (no videos) still read, their patch geometry inferred from
the row width when meta.json predates it. A tower of another patch size is refused when the run
starts, naming both geometries and the fixes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpcore.batches import local_inputs
from mpcore.build import build, setup
from mpcore.config import load_config
from mpcore.data import VLDataset, VLPackedDataset, collate_vl, prepare_default
from mpcore.data.videos import VideoSettings, process_video
from mpcore.data.vl_dataset import dataset_fingerprint, folder_fingerprint, prepare_vl_dataset
from mpcore.data.vl_manifest import ImageSettings
from mpcore.launch import prepare_vl_data
from mpcore.models import family_named
from mpcore.parallel.state import ParallelState
from mpcore.vl_data import build_vl_loaders
from tests.unit.test_video_processing import CASES, RECORDED, case_id, digest, frames_of

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"qwen2_vl": "vl_tiny.yaml", "qwen3_vl": "qwen3_vl_tiny.yaml",
           "glm4v": "glm4v_tiny.yaml"}
# per family: (video case of test_video_processing, a second video case)
VIDEOS = {"qwen2_vl": (CASES[0], CASES[1]), "qwen3_vl": (CASES[3], CASES[3]),
          "glm4v": (CASES[5], CASES[5])}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return prepare_default(tmp_path_factory.mktemp("vl_video_tok"))[0]


def write_frames(folder: Path, name: str, case) -> list[str]:
    names = []
    for k, frame in enumerate(frames_of(case)):
        Image.fromarray(frame).save(folder / f"{name}_{k}.png")
        names.append(f"{name}_{k}.png")
    return names


def make_manifest(folder: Path, family: str) -> Path:
    first, second = VIDEOS[family]
    picture = np.full((40, 60, 3), 90, np.uint8)
    picture[::3] = 200
    Image.fromarray(picture).save(folder / "still.png")
    lines = [
        {"video": write_frames(folder, "a", first), "caption": "A pattern shifts."},
        {"content": [{"text": "Look at this:", "target": False}, {"image": "still.png"},
                     {"text": "then"}, {"video": write_frames(folder, "b", second), "fps": 2},
                     {"text": "it moves."}]},
        {"text": "Only words here."},
    ]
    path = folder / "m.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def prepare(family: str, manifest: Path, tokenizer: Path, out: Path) -> VLDataset:
    low, high = VIDEOS[family][0][4:]
    assert prepare_vl_data.main(["--family", family, "--manifest", str(manifest), "--tokenizer",
                                 str(tokenizer), "--out", str(out), "--video-min-pixels",
                                 str(low), "--video-max-pixels", str(high)]) == 0
    return VLDataset(out)


def tiny_config(family: str, tmp: Path, *overrides: str):
    return load_config(str(REPO / "launch" / "configs" / CONFIGS[family]), [
        f"data.cache_dir={tmp}/data", "model.vocab_size=2060", "data.seq_len=256",
        "data.micro_batch=3", "data.grad_accum=1", "training.device=cpu",
        f"logging.run_dir={tmp}/run", *overrides])


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_video_rows_grids_and_ids(family, tokenizer, tmp_path):
    ds = prepare(family, make_manifest(tmp_path, family), tokenizer, tmp_path / "vl")
    assert ds.meta["num_videos"] == 2 and ds.meta["num_images"] == 1
    assert ds.video_settings.family == family
    tok = ds.tokenizer
    for k, case in enumerate(VIDEOS[family]):
        sample = ds[k]
        want_grid, want_digest = RECORDED[case_id(case)]
        assert sample.video_grid_thw.tolist() == [want_grid]
        assert digest(torch.tensor(sample.pixel_values_videos)) == want_digest
        ids = sample.input_ids
        t, h, w = want_grid
        placeholder = tok.image_pad_id if family == "glm4v" else tok.video_pad_id
        video_runs = t if family != "qwen2_vl" else 1
        shared = int(sample.grid_thw.prod(-1).sum()) // 4 if family == "glm4v" else 0
        assert int((ids == placeholder).sum()) == t * h * w // 4 + shared
        assert int((ids == tok.vision_start_id).sum()) == video_runs + len(sample.grid_thw)
        if family == "glm4v":  # its video span: the two ids after the tokenizer's
            assert (ids == tok.vocab_size).sum() == 1 and (ids == tok.vocab_size + 1).sum() == 1
        start = int(np.flatnonzero(ids == placeholder)[-1])
        assert not sample.loss_mask[start] and sample.loss_mask[-1]
    assert len(ds[2].video_grid_thw) == 0


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_batch_goes_through_the_family_input_builder(family, tokenizer, tmp_path):
    ds = prepare(family, make_manifest(tmp_path, family), tokenizer, tmp_path / "vl")
    cfg = tiny_config(family, tmp_path, f"data.vl_paths=[{ds.folder}]")
    f = family_named(family)
    model_cfg = f.config_from_section(cfg.model, ds.tokenizer.token_ids())
    packed = VLPackedDataset(ds, 256, 0, ds.tokenizer.eos_id)
    batch = collate_vl([packed[b] for b in range(len(packed))])
    assert batch["video_grid_thw"].shape == (2, 3)
    inputs = local_inputs(batch, ParallelState(), cfg, torch.device("cpu"), f, model_cfg)
    want = torch.cat([batch["pixel_values"], batch["pixel_values_videos"]])
    assert torch.equal(inputs["pixel_values"], want)
    assert torch.equal(inputs["grid_thw"], torch.cat([batch["image_grid_thw"],
                                                      batch["video_grid_thw"]]))
    rows, positions = inputs["vision_rows"], inputs["position_ids"]
    assert int((rows >= 0).sum()) == want.shape[0] // 4
    # video 0 takes the rows after every image's; its temporal M-RoPE row steps once per
    # temporal patch (Qwen2-VL inside one run; Qwen3-VL and GLM-4V across the frames' runs)
    first = int(batch["image_grid_thw"].prod(-1).sum()) // 4
    t, h, w = batch["video_grid_thw"][0].tolist()
    video = (rows >= first) & (rows < first + t * h * w // 4)
    assert int(video.sum()) == t * h * w // 4
    assert len(set(positions[0][video].tolist())) == t >= 2


def test_frames_are_covered_by_the_fingerprint(tokenizer, tmp_path):
    manifest = make_manifest(tmp_path, "qwen2_vl")
    family = family_named("qwen2_vl")
    image = ImageSettings.for_family(family)
    video = VideoSettings.for_family(family, min_pixels=56 * 56, max_pixels=28 * 28 * 8)
    base = dataset_fingerprint(manifest, tokenizer, image, video)
    frame = tmp_path / "b_1.png"
    pixels = np.asarray(Image.open(frame)).copy()
    pixels[0, 0] ^= 1
    Image.fromarray(pixels).save(frame)
    changed = dataset_fingerprint(manifest, tokenizer, image, video)
    assert changed != base
    other = VideoSettings.for_family(family, min_pixels=56 * 56, max_pixels=28 * 28 * 9)
    assert dataset_fingerprint(manifest, tokenizer, image, other) != changed
    out = prepare_vl_dataset(manifest, tmp_path / "vl", tokenizer, image, progress=False,
                             video=video)
    assert VLDataset(out).meta["fingerprint"] == changed
    seen = []
    folder_fingerprint(out, lambda p: seen.append(p.name) or "x")
    assert {"video_pixels.bin", "video_grids.bin", "video_row_offsets.i64"} <= set(seen)


def test_bad_videos_fail_with_the_line(tokenizer, tmp_path):
    frames = write_frames(tmp_path, "v", CASES[0])
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(tmp_path / "small.png")
    lines = [{"video": [frames[0], "small.png"], "caption": "sizes differ"},
             {"video": frames, "caption": "bad fps", "fps": 0},
             {"video": [], "caption": "no frames"},
             {"content": [{"video": frames, "max_pixels": 5}, {"text": "a key too many"}]}]
    manifest = tmp_path / "bad.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    family = family_named("qwen2_vl")
    video = VideoSettings.for_family(family)
    with pytest.raises(ValueError) as err:
        prepare_vl_dataset(manifest, tmp_path / "out", tokenizer,
                           ImageSettings.for_family(family), progress=False, video=video)
    message = str(err.value)
    assert "4 problem(s)" in message and not (tmp_path / "out").exists()
    assert "bad.jsonl:1: frame 1" in message and "all frames of a video must have one size" \
        in message
    assert "bad.jsonl:2: fps must be a positive number" in message
    assert "bad.jsonl:3: a video must be a non-empty list" in message
    assert "bad.jsonl:4: content[0] has keys ['max_pixels', 'video']" in message
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"video": frames, "caption": "fine"}) + "\n")
    with pytest.raises(ValueError, match="good.jsonl:1: a video, but no video settings"):
        prepare_vl_dataset(good, tmp_path / "out", tokenizer, ImageSettings.for_family(family),
                           progress=False)


def test_version_1_folders_still_read(tokenizer, tmp_path):
    """A folder from before videos (version 1: no video files or keys), and one whose image
    settings predate the patch fields: the geometry then comes from the row width."""
    manifest = tmp_path / "m.jsonl"
    Image.fromarray(np.full((40, 60, 3), 7, np.uint8)).save(tmp_path / "p.png")
    manifest.write_text(json.dumps({"image": "p.png", "caption": "grey"}) + "\n")
    for family, patch in (("qwen2_vl", 14), ("qwen3_vl", 16)):
        settings = ImageSettings.for_family(family_named(family))
        out = prepare_vl_dataset(manifest, tmp_path / family, tokenizer, settings,
                                 progress=False)
        meta = json.loads((out / "meta.json").read_text())
        meta["version"] = 1
        for key in ("num_videos", "num_video_tokens", "num_video_rows", "video_settings"):
            del meta[key]
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            del meta["image_settings"][key]
        (out / "meta.json").write_text(json.dumps(meta))
        for name in ("video_grids.bin", "video_grids.idx", "video_pixels.bin",
                     "video_row_offsets.i64"):
            (out / name).unlink()
        ds = VLDataset(out)
        assert ds.videos is None and ds[0].video_grid_thw.shape == (0, 3)
        assert ds.geometry == {"patch_size": patch, "temporal_patch_size": 2, "merge_size": 2,
                               "patch_dim": 6 * patch * patch}
        assert "video_pixels.bin" not in folder_fingerprint(out, lambda p: p.name)
        packed = VLPackedDataset(ds, 4096, 0, ds.tokenizer.eos_id)
        assert "video_grid_thw" not in collate_vl([packed[0]])


def test_a_tower_of_another_patch_size_is_refused_at_the_start(tokenizer, tmp_path):
    ds = prepare("qwen2_vl", make_manifest(tmp_path, "qwen2_vl"), tokenizer, tmp_path / "vl")
    small = [f"data.vl_paths=[{ds.folder}]", "data.micro_batch=1", "data.seq_len=64"]
    cfg = tiny_config("qwen2_vl", tmp_path, *small, "model.vision.patch_size=16")
    _, _, summary, _ = build_vl_loaders(cfg, ParallelState(), family_named("qwen2_vl"))
    assert summary.pixel_geometry == {"patch_size": 14, "temporal_patch_size": 2,
                                      "merge_size": 2, "patch_dim": 1176,
                                      "source": str(ds.folder)}
    with pytest.raises(ValueError) as err:
        build(cfg, setup(cfg), torch.device("cpu"))
    message = str(err.value)
    assert ("the vision tower takes patch 16 x temporal patch 2, merge 2 (rows of 1536 values) "
            f"but {ds.folder} was prepared with patch 14 x temporal patch 2, merge 2 (rows of "
            "1176 values)") in message
    assert "python launch/prepare_vl_data.py --family qwen2_vl --patch-size 16" in message
    assert "set model.vision.patch_size=14" in message
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    run = build(tiny_config("qwen2_vl", tmp_path, *small), setup(cfg), torch.device("cpu"))
    assert run.model_cfg.vision.patch_size == 14


def test_process_video_is_what_was_prepared(tokenizer, tmp_path):
    """The digests above bind the prepared rows to transformers; this binds them to
    process_video on the same frames read back from the PNG files (lossless)."""
    ds = prepare("glm4v", make_manifest(tmp_path, "glm4v"), tokenizer, tmp_path / "vl")
    image = ImageSettings.for_family(family_named("glm4v"))
    video = VideoSettings.for_family(family_named("glm4v"), min_pixels=VIDEOS["glm4v"][0][4],
                                     max_pixels=VIDEOS["glm4v"][0][5])
    frames = [Image.open(tmp_path / f"a_{k}.png") for k in range(VIDEOS["glm4v"][0][1])]
    rows, grid = process_video(frames, image, video)
    assert torch.equal(torch.tensor(ds[0].pixel_values_videos), rows)
    assert ds[0].video_grid_thw.tolist() == [list(grid)]
