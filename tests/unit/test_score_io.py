"""launch/score_io.py: the three input forms, mixed in one file, and every input error (each
message names the file and line and is matched here). No model: specs are built by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mpcore.data.images import load_image, process_image
from mpcore.launch.score_io import InputSpec, read_input, vl_spec

IMAGES = Path(__file__).resolve().parents[2] / "launch" / "data" / "images"
TEXT = InputSpec(vocab_size=100, checkpoint="ckpt (Qwen3ForCausalLM)")
IMG, VID = 90, 91
VL = InputSpec(vocab_size=100, checkpoint="vlckpt", vl=True, image_token_id=IMG,
               video_token_id=VID, max_pixels=28 * 28 * 8)
WIDTH = 3 * 2 * 14 * 14


def write(tmp_path, rows, name="in.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def fails(tmp_path, rows, match, spec=VL, line=None):
    """read_input raises a ValueError naming the file and (last) line and matching ``match``."""
    path = write(tmp_path, rows)
    line = len(rows) if line is None else line
    with pytest.raises(ValueError, match=rf"in\.jsonl:{line}: {match}"):
        read_input(path, spec)


def pixels(grid):
    rows = sum(math.prod(g) for g in grid)
    return torch.randn(rows, WIDTH).tolist()


def test_text_lines_parse_with_loss_masks(tmp_path):
    path = write(tmp_path, [{"input_ids": [1, 2, 3], "loss_mask": [1, 0, True]},
                            {"input_ids": [], "extra": "kept out"}])
    items = read_input(path, TEXT)
    assert [i.input_ids for i in items] == [[1, 2, 3], []]
    assert items[0].loss_mask == [1, 0, 1] and items[1].loss_mask is None
    assert items[0].pixel_values is None and not items[0].echo_ids


def test_mixed_file_text_pixel_values_and_paths(tmp_path):
    grid = [[1, 4, 4], [1, 2, 6]]
    px = pixels(grid)
    (tmp_path / "pics").mkdir()
    load_image(IMAGES / "coffee.jpg").save(tmp_path / "pics" / "c.png")
    ids_px = [5, 88, *[IMG] * 4, 89, 7, 88, *[IMG] * 3, 89, 6]
    rows = [{"input_ids": [1, 2, 3]},
            {"input_ids": ids_px, "pixel_values": px, "image_grid_thw": grid},
            {"input_ids": [4, 88, IMG, 89, 9, 88, IMG, 89], "loss_mask": [1] * 8,
             "images": ["pics/c.png", str(IMAGES / "camera.png")]}]
    items = read_input(write(tmp_path, rows), VL)
    assert items[0].num_images == 0 and items[0].pixel_values is None
    assert items[1].image_grid_thw == [(1, 4, 4), (1, 2, 6)] and not items[1].echo_ids
    assert torch.equal(items[1].pixel_values, torch.tensor(px))
    # paths: processed as mpcore.data.images does, each single id expanded to its run
    want = [process_image(load_image(p), max_pixels=VL.max_pixels)
            for p in (tmp_path / "pics" / "c.png", IMAGES / "camera.png")]
    third = items[2]
    assert third.echo_ids and third.image_grid_thw == [w[1] for w in want]
    assert torch.equal(third.pixel_values, torch.cat([w[0] for w in want]))
    runs = [math.prod(g) // 4 for g in third.image_grid_thw]
    assert third.input_ids == [4, 88, *[IMG] * runs[0], 89, 9, 88, *[IMG] * runs[1], 89]
    assert third.loss_mask == [1] * len(third.input_ids)


def test_same_image_twice_is_processed_once(tmp_path):
    rows = [{"input_ids": [88, IMG, 89], "images": ["camera.png"]}] * 2
    path = write(tmp_path, rows)
    load_image(IMAGES / "camera.png").save(tmp_path / "camera.png")
    a, b = read_input(path, VL)
    assert a.pixel_values is b.pixel_values  # the cache: one decode per distinct path


def test_blank_lines_are_errors(tmp_path):
    """Output line i belongs to input line i: a skipped blank line would shift the rest."""
    fails(tmp_path, [{"input_ids": [1]}, "", {"input_ids": [2]}], "a blank line; output line "
          "i belongs to input line i", spec=TEXT, line=2)
    fails(tmp_path, [{"input_ids": [1]}, "  \t"], "a blank line", spec=TEXT, line=2)


def test_missing_input_file(tmp_path):
    with pytest.raises(ValueError, match=r"--input .*nope.jsonl: no such file"):
        read_input(tmp_path / "nope.jsonl", TEXT)


@pytest.mark.parametrize("line, match", [
    ('{"input_ids": [1, 2', r"not JSON \(Expecting"),
    ('[1, 2, 3]', "a line must be a JSON object with input_ids, got list"),
    ('{"ids": [1]}', "input_ids must be a list of token ids, got nothing"),
    ('{"input_ids": [1, true, 3]}', r"input_ids\[1\] = true is a JSON boolean, not a token id"),
    ('{"input_ids": [1, 2.0]}', r"input_ids\[1\] = 2.0 is a float, not a token id"),
    ('{"input_ids": [1, "7"]}', r"input_ids\[1\] = \"7\" is str, not a token id"),
    ('{"input_ids": [1, -3]}', r"input_ids\[1\] = -3 is outside the model's vocab \[0, 100\)"),
    ('{"input_ids": [100]}', r"input_ids\[0\] = 100 is outside the model's vocab \[0, 100\)"),
    ('{"input_ids": [1, 2], "loss_mask": [1]}', r"loss_mask must be a list as long as input_ids "
                                                r"\(2\), got 1 entries"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 0.5]}', "loss_mask entries must be 0 or 1"),
])
def test_bad_text_lines(tmp_path, line, match):
    fails(tmp_path, [{"input_ids": [1]}, line], match, spec=TEXT)


@pytest.mark.parametrize("key", ["pixel_values", "images"])
def test_images_on_a_text_only_checkpoint(tmp_path, key):
    fails(tmp_path, [{"input_ids": [1], key: []}],
          r"the line has \['" + key + r"'\], but ckpt \(Qwen3ForCausalLM\) is a text-only decoder",
          spec=TEXT)


def test_placeholder_run_must_match_the_grid(tmp_path):
    grid = [[1, 4, 4], [1, 4, 4]]
    ids = [88, *[IMG] * 4, 89, 88, *[IMG] * 5, 89]
    fails(tmp_path, [{"input_ids": ids, "pixel_values": pixels(grid), "image_grid_thw": grid}],
          r"image 1 \(grid \[1, 4, 4\]\) needs 4 placeholder ids \(t\*h\*w / 2\^2\), but its "
          r"run at input_ids\[7\] has 5")


def test_run_count_must_match_the_grid(tmp_path):
    grid = [[1, 4, 4]]
    ids = [88, *[IMG] * 4, 89, 88, *[IMG] * 4, 89]
    fails(tmp_path, [{"input_ids": ids, "pixel_values": pixels(grid), "image_grid_thw": grid}],
          r"input_ids have 2 runs of image placeholder ids \(90\) but image_grid_thw has 1 rows")


def test_placeholders_without_any_image(tmp_path):
    fails(tmp_path, [{"input_ids": [1, IMG, IMG, 2]}],
          r"input_ids hold 2 image placeholder ids \(90, first at input_ids\[1\]\) but the "
          r"line gives no image")


def test_video_placeholders_are_refused(tmp_path):
    fails(tmp_path, [{"input_ids": [1, VID]}], r"input_ids\[1\] is the video placeholder id 91")


def test_pixel_values_width_and_rows(tmp_path):
    grid = [[1, 2, 2]]
    ids = [88, IMG, 89]
    narrow = torch.randn(4, 588).tolist()
    fails(tmp_path, [{"input_ids": ids, "pixel_values": narrow, "image_grid_thw": grid}],
          r"pixel_values\[0\] has 588 values; this checkpoint's vision tower takes rows of "
          r"in_channels \* temporal_patch_size \* patch_size\^2 = 3 \* 2 \* 14\^2 = 1176")
    fails(tmp_path, [{"input_ids": ids, "pixel_values": pixels([[1, 2, 3]]),
                      "image_grid_thw": grid}],
          r"pixel_values has 6 rows but image_grid_thw needs sum\(t\*h\*w\) = 4")
    bad = pixels(grid)
    bad[2][5] = "x"
    fails(tmp_path, [{"input_ids": ids, "pixel_values": bad, "image_grid_thw": grid}],
          "pixel_values must hold numbers only")


def test_pixel_values_and_grid_come_together(tmp_path):
    fails(tmp_path, [{"input_ids": [88, IMG, 89], "pixel_values": pixels([[1, 2, 2]])}],
          "image_grid_thw is missing; pixel_values and image_grid_thw come together")
    fails(tmp_path, [{"input_ids": [88, IMG, 89], "image_grid_thw": [[1, 2, 2]]}],
          "pixel_values is missing")
    fails(tmp_path, [{"input_ids": [88, IMG, 89], "image_grid_thw": [[1, 2, 2]],
                      "pixel_values": pixels([[1, 2, 2]]), "images": ["a.png"]}],
          "give either images .* or pixel_values with image_grid_thw, not both")


@pytest.mark.parametrize("grid, match", [
    ([[1, 2, True]], r"image_grid_thw\[0\] = \[1, 2, true\] must be three positive integers"),
    ([[1, 2]], r"image_grid_thw\[0\] = \[1, 2\] must be three positive integers"),
    ([[1, 3, 2]], r"image_grid_thw\[0\] = \[1, 3, 2\]: h and w must be multiples of the spatial "
                  r"merge size 2"),
])
def test_bad_grids(tmp_path, grid, match):
    fails(tmp_path, [{"input_ids": [88, IMG, 89], "image_grid_thw": grid,
                      "pixel_values": [[0.0] * WIDTH]}], match)


def test_image_paths_errors(tmp_path):
    fails(tmp_path, [{"input_ids": [88, IMG, 89], "images": ["gone.png"]}],
          r".*gone.png: no such image file")
    (tmp_path / "a.gif").write_bytes(b"GIF89a" + bytes(40))
    fails(tmp_path, [{"input_ids": [88, IMG, 89], "images": ["a.gif"]}], r".*a.gif: ")
    fails(tmp_path, [{"input_ids": [88, IMG, IMG, 89], "images": ["a.png"]}],
          r"1 image path\(s\) but 2 image placeholder ids \(90\) in input_ids; in the images "
          r"form each image is ONE placeholder id")
    fails(tmp_path, [{"input_ids": [88, IMG, IMG, 89], "images": ["a.png", "b.png"]}],
          r"images 0 and 1 are adjacent placeholder ids \(input_ids\[1\] and \[2\]\)")
    fails(tmp_path, [{"input_ids": [88, IMG, 89], "images": "a.png"}],
          "images must be a list of file paths")


def test_vl_spec_reads_the_processor_config(tmp_path):
    from types import SimpleNamespace

    vision = SimpleNamespace(patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                             in_channels=3)
    cfg = SimpleNamespace(text=SimpleNamespace(vocab_size=100), vision=vision,
                          image_token_id=IMG, video_token_id=VID)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 1000, "max_pixels": 20000, "image_mean": [0.5] * 3, "patch_size": 14}))
    spec = vl_spec(cfg, tmp_path)
    assert (spec.min_pixels, spec.max_pixels, spec.image_mean) == (1000, 20000, (0.5,) * 3)
    assert spec.patch_dim == WIDTH and spec.vl
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 500, "longest_edge": 9000}, "max_pixels": 7000}))
    assert (vl_spec(cfg, tmp_path).min_pixels, vl_spec(cfg, tmp_path).max_pixels) == (500, 7000)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"merge_size": 1}))
    with pytest.raises(ValueError, match="merge_size = 1 but the model's vision config has 2"):
        vl_spec(cfg, tmp_path)


def test_line_that_is_not_utf8_names_its_line(tmp_path):
    from mpcore.data.jsonl import json_lines

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"input_ids": [1]}\n\n{"input_ids": [2, \xff]}\n')
    lines = list(json_lines(path))
    assert [(x.number, x.value) for x in lines] == [(1, {"input_ids": [1]}), (3, None)]
    assert lines[1].where == f"{path}:3" and lines[1].problem.startswith("not UTF-8")
