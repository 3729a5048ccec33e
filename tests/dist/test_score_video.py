"""launch/score.py with videos on a Qwen2-VL checkpoint (one process, CPU).

The checkpoint is a tiny random ``Qwen2VLForConditionalGeneration`` (tests/dist/hf_vl_tiny.py).
The input file holds a sequence with one image AND one video of two temporal patches (t = 2, so
the video's temporal M-RoPE row steps), a video-only sequence of three temporal patches, and a
text-only one, packed into one stream. Reference: transformers in float64, one sequence at a
time, with ``pixel_values_videos`` / ``video_grid_thw`` and ``mm_token_type_ids`` (its
``get_rope_index`` then places the video). Per-token log-probs (0 where the target is a
placeholder) and entropy within 1e-4; on 2 gloo ranks (cp = 2 ring, zigzag split; tp = 2 with
sequence parallelism) the same as one process. Bad video lines fail before the model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mpcore.launch.score import checkpoint_spec, score_items
from mpcore.launch.score_io import read_input
from mpcore.models.qwen2_vl import load_hf_vl_model
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.hf_vl_tiny import END, IMAGE, PATCH_DIM, START, VIDEO, make_hf_vl_model


def text(gen, n: int) -> list[int]:
    return torch.randint(0, IMAGE, (n,), generator=gen).tolist()


def run(kind: int, grid) -> list[int]:
    t, h, w = grid
    return [START, *[kind] * (t * h * w // 4), END]


def make_lines(gen):
    """``[(line dict, image rows, image grid, video rows, video grid)]``."""
    image_grid, video_grid = [1, 4, 6], [2, 4, 4]
    both = [*text(gen, 3), *run(IMAGE, image_grid), *text(gen, 4), *run(VIDEO, video_grid),
            *text(gen, 2)]
    image_px = torch.randn(24, PATCH_DIM, generator=gen)
    video_px = torch.randn(32, PATCH_DIM, generator=gen)
    lines = [({"input_ids": both, "pixel_values": image_px.tolist(),
               "image_grid_thw": [image_grid], "pixel_values_videos": video_px.tolist(),
               "video_grid_thw": [video_grid]}, image_px, [image_grid], video_px, [video_grid])]
    only_grid = [3, 2, 4]
    only = [*text(gen, 2), *run(VIDEO, only_grid), *text(gen, 5)]
    only_px = torch.randn(24, PATCH_DIM, generator=gen)
    lines.append(({"input_ids": only, "pixel_values_videos": only_px.tolist(),
                   "video_grid_thw": [only_grid]}, None, [], only_px, [only_grid]))
    plain = text(gen, 7)
    lines.append(({"input_ids": plain}, None, [], None, []))
    return lines


def reference(hf, ids, image_px, image_grid, video_px, video_grid):
    """transformers float64 on one sequence: ``(logprobs [n-1], entropy [n-1])``."""
    ids = torch.tensor(ids)
    kwargs = {}
    if image_grid:
        kwargs.update(pixel_values=image_px.double(), image_grid_thw=torch.tensor(image_grid))
    if video_grid:
        kwargs.update(pixel_values_videos=video_px.double(),
                      video_grid_thw=torch.tensor(video_grid))
    if kwargs:
        types = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
        kwargs["mm_token_type_ids"] = types[None]
    with torch.no_grad():
        logp = F.log_softmax(hf(input_ids=ids[None], **kwargs).logits[0].double(), dim=-1)
    target = logp[:-1].gather(1, ids[1:, None])[:, 0]
    placeholder = (ids[1:] == IMAGE) | (ids[1:] == VIDEO)
    return torch.where(placeholder, 0.0, target), -(logp.exp() * logp).sum(-1)[:-1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_vl_video")
    make_hf_vl_model("qwen2_vl", 11).save_pretrained(folder)
    return folder


def test_video_and_image_logprobs_match_transformers(checkpoint, tmp_path):
    import transformers

    lines = make_lines(torch.Generator().manual_seed(5))
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line, *_ in lines))
    items = read_input(path, checkpoint_spec(checkpoint))
    assert [i.num_videos for i in items] == [1, 1, 0] and items[0].num_images == 1
    state = ParallelState()
    model, _ = load_hf_vl_model(checkpoint, state)
    results = score_items(model.eval(), state, items)
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float64).eval()
    for (line, *vision), result in zip(lines, results, strict=True):
        logprobs, entropy = reference(hf, line["input_ids"], *vision)
        ours = torch.tensor(result["logprobs"], dtype=torch.float64)
        assert ours.shape == logprobs.shape
        assert float((ours - logprobs).abs().max()) <= 1e-4
        assert float((torch.tensor(result["entropy"], dtype=torch.float64) - entropy
                      ).abs().max()) <= 1e-4
        assert bool((ours != 0).any())


def _score_layouts(rank, world, folder, path):
    """Every rank: the input scored at cp = 2 (ring) and at tp = 2 (SP on)."""
    del rank, world
    out = {}
    for name, tp, cp, options in (("cp2_ring", 1, 2, dict(cp_mode="ring")),
                                  ("tp2_sp", 2, 1, dict(sequence_parallel=True))):
        state = ParallelState.build(tp, cp)
        model, _ = load_hf_vl_model(folder, state, **options)
        items = read_input(path, checkpoint_spec(folder))
        out[name] = [r["logprobs"] for r in score_items(model.eval(), state, items)]
    return out


@pytest.mark.slow
def test_video_scores_agree_across_layouts(checkpoint, tmp_path):
    lines = make_lines(torch.Generator().manual_seed(5))
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line, *_ in lines))
    state = ParallelState()
    model, _ = load_hf_vl_model(checkpoint, state)
    base = [r["logprobs"] for r in score_items(model.eval(), state,
                                               read_input(path, checkpoint_spec(checkpoint)))]
    for rank_out in run_distributed(_score_layouts, 2, checkpoint, path, timeout=600):
        for name, scores in rank_out.items():
            for ours, want in zip(scores, base, strict=True):
                diff = float((torch.tensor(ours) - torch.tensor(want)).abs().max())
                assert diff <= 1e-5, (name, diff)


def test_the_video_positions_matter(checkpoint, tmp_path):
    """The same video scored as if it were an image of the same rows (its t rows placed as one
    frame) gives other log-probs than transformers' video: the test above sees the video rule."""
    import transformers

    gen = torch.Generator().manual_seed(5)
    line, image_px, image_grid, video_px, video_grid = make_lines(gen)[0]
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float64).eval()
    as_video, _ = reference(hf, line["input_ids"], image_px, image_grid, video_px, video_grid)
    t, h, w = video_grid[0]
    ids = [IMAGE if i == VIDEO else i for i in line["input_ids"]]
    as_image, _ = reference(hf, ids, torch.cat([image_px, video_px]),
                            [*image_grid, [1, t * h, w]], None, [])
    assert float((as_video - as_image).abs().max()) > 1e-3


def fails(tmp_path: Path, checkpoint: Path, row: dict, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=match):
        read_input(path, checkpoint_spec(checkpoint))


def test_bad_video_lines_fail_before_the_model_loads(checkpoint, tmp_path):
    rows = [[0.0] * PATCH_DIM] * 32
    ids = [1, *run(VIDEO, [2, 4, 4]), 2]
    fails(tmp_path, checkpoint, {"input_ids": ids, "pixel_values_videos": rows},
          "video_grid_thw is missing")
    fails(tmp_path, checkpoint, {"input_ids": ids, "pixel_values_videos": rows[:30],
                                 "video_grid_thw": [[2, 4, 4]]},
          r"pixel_values_videos has 30 rows but video_grid_thw needs sum\(t\*h\*w\) = 32")
    short = [1, START, *[VIDEO] * 7, END, 2]
    fails(tmp_path, checkpoint, {"input_ids": short, "pixel_values_videos": rows,
                                 "video_grid_thw": [[2, 4, 4]]},
          r"bad\.jsonl:1: video 0 \(grid \[2, 4, 4\]\) needs 8 placeholder tokens")
    fails(tmp_path, checkpoint, {"input_ids": ids},
          "is the video placeholder id 151 but the line gives no video")
    fails(tmp_path, checkpoint, {"input_ids": ids, "pixel_values_videos": rows,
                                 "video_grid_thw": [[2, 3, 4]]},
          r"video_grid_thw\[0\] = \[2, 3, 4\]: h and w must be multiples")
