"""Qwen3-VL per-token inputs on the GLOBAL stream: M-RoPE positions vs transformers'
``get_rope_index`` per document (images of different grids, a 3-frame video with timestamps
between frames, text-only documents), vision rows, labels, one ContextPlan split, bad input
(single process, CPU)."""

from __future__ import annotations

import pytest
import torch

from mpcore.models.qwen3_vl import config_from_hf, global_inputs, local_inputs, position_ids
from mpcore.parallel.state import ParallelState
from tests.dist.hf_qwen3_vl_tiny import END, IMAGE, START, VIDEO, doc_inputs, make_hf_model, stream


@pytest.fixture(scope="module")
def hf_and_cfg():
    hf = make_hf_model(seed=0)
    return hf, config_from_hf({**hf.config.to_dict(),
                               "architectures": ["Qwen3VLForConditionalGeneration"]})


def test_positions_match_transformers_per_document(hf_and_cfg):
    hf, cfg = hf_and_cfg
    s = stream(seed=1)
    positions, rows = position_ids(s["input_ids"], s["cu_seqlens"], cfg, s["image_grid_thw"],
                                   s["video_grid_thw"])
    for d in range(len(s["per_doc"])):
        kwargs, a, b = doc_inputs(s, d)
        if "mm_token_type_ids" in kwargs:
            expected, _ = hf.model.get_rope_index(
                kwargs["input_ids"], kwargs["mm_token_type_ids"],
                image_grid_thw=kwargs.get("image_grid_thw"),
                video_grid_thw=kwargs.get("video_grid_thw"))
            expected = expected[:, 0]
        else:  # text only: transformers' default positions
            expected = torch.arange(b - a).expand(3, -1)
        assert torch.equal(positions[:, a:b], expected), (d, positions[:, a:b], expected)
    ids = s["input_ids"]
    num_image_rows = int(s["image_grid_thw"].prod(-1).sum()) // 4
    assert rows[ids == IMAGE].tolist() == list(range(num_image_rows))
    assert rows[ids == VIDEO].tolist() == list(range(num_image_rows, num_image_rows + 12))
    assert bool((rows[(ids != IMAGE) & (ids != VIDEO)] == -1).all())


def test_video_frames_get_their_own_positions(hf_and_cfg):
    """Each frame restarts the temporal row at the current position (not p + frame index)."""
    _, cfg = hf_and_cfg
    s = stream(seed=2, docs=[[1, ("video", 2, 2, 2), 1]])
    positions, _ = position_ids(s["input_ids"], s["cu_seqlens"], cfg,
                                video_grid_thw=s["video_grid_thw"])
    # text 0; timestamp 1 2; start 3; frame at 4; end 5; timestamp 6 7; start 8; frame at 9
    frames = positions[:, s["input_ids"] == VIDEO]
    assert frames.tolist() == [[4, 9]] * 3


def test_labels_and_one_plan_split(hf_and_cfg):
    _, cfg = hf_and_cfg
    s = stream(seed=3)
    ids, cu = s["input_ids"], s["cu_seqlens"]
    batch = global_inputs(ids, cu, cfg, image_grid_thw=s["image_grid_thw"],
                          video_grid_thw=s["video_grid_thw"])
    labels = batch["labels"]
    assert not bool(torch.isin(labels, torch.tensor([IMAGE, VIDEO])).any())
    assert bool((labels[cu[1:] - 1] == -100).all())  # no target across documents
    assert int((labels == START).sum()) > 0 and int((labels == END).sum()) > 0
    for tp, cp, sp in ((1, 2, False), (2, 4, True)):
        seen = torch.zeros(ids.numel(), dtype=torch.int64)
        for rank in range(cp):
            state = ParallelState(tp=tp, cp=cp, cp_rank=rank)  # only degrees and rank are read
            plan, local = local_inputs(state, ids, cu, cfg, pixel_values=s["pixel_values"],
                                       image_grid_thw=s["image_grid_thw"],
                                       pixel_values_videos=s["pixel_values_videos"],
                                       video_grid_thw=s["video_grid_thw"],
                                       sequence_parallel=sp)
            index = plan.rank_layout(rank).global_index
            real = index >= 0
            assert local["input_ids"].shape[0] % (tp if sp else 1) == 0
            for key in ("input_ids", "labels", "vision_rows"):
                assert torch.equal(local[key][real], batch[key][index[real]]), key
            assert torch.equal(local["position_ids"][:, real],
                               batch["position_ids"][:, index[real]])
            assert bool((local["vision_rows"][~real] == -1).all())
            assert local["grid_thw"].shape == (5, 3)  # 4 images then the video, on every rank
            seen[index[real]] += 1
        assert bool((seen == 1).all())


def _one_image(extra_run: int = 0):
    ids = torch.tensor([1, START, *[IMAGE] * (6 + extra_run), END, 2])
    return ids, torch.tensor([0, ids.numel()])


@pytest.mark.parametrize(("case", "message"), [
    ("short_run", "needs 6 placeholder tokens but its run at token 2 has 7"),
    ("missing_grid", "more image placeholder runs"),
    ("extra_grid", "the grids give 2 images"),
    ("frames_in_one_run", "video 0 frame 0 .* needs 4 placeholder tokens .* has 8"),
    ("type_ids", "mm_token_type_ids disagrees"),
])
def test_bad_placeholder_counts_raise_before_compute(hf_and_cfg, case, message):
    _, cfg = hf_and_cfg
    grid = torch.tensor([[1, 4, 6]])
    kwargs = {}
    if case == "short_run":
        ids, cu = _one_image(extra_run=1)
    elif case == "missing_grid":
        ids, cu = _one_image()
        grid = None
    elif case == "extra_grid":
        ids, cu = _one_image()
        grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    elif case == "frames_in_one_run":  # two frames without the timestamp between them
        ids = torch.tensor([START, *[VIDEO] * 8, END])
        cu, grid = torch.tensor([0, 10]), None
        kwargs["video_grid_thw"] = torch.tensor([[2, 4, 4]])
    else:
        ids, cu = _one_image()
        kwargs["mm_token_type_ids"] = (ids == IMAGE).long() * 2
    with pytest.raises(ValueError, match=message):
        position_ids(ids, cu, cfg, grid, **kwargs)
