"""VL per-token inputs on the global stream: M-RoPE positions vs transformers' get_rope_index
(images and videos, both architectures), vision rows, labels that never target a placeholder,
the config read from config.json, and bad inputs (single process, CPU)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from mpcore.models.common.config import ModelConfig
from mpcore.models.qwen2_vl.config import hf_vl_config_dict, is_vl_config, vl_config_from_hf
from mpcore.models.qwen2_vl.inputs import vl_inputs, vl_position_ids
from tests.dist.hf_vl_tiny import END, IMAGE, START, VIDEO, make_hf_vl_model, vl_stream

ARCHS = ["qwen2_vl", "qwen2_5_vl"]


def _video_stream(seed: int):
    """Documents with images and a video (t=4: the rule that differs between 4.x and 5.x)."""
    gen = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, IMAGE, (n,), generator=gen).tolist()  # noqa: E731
    docs = [text(3) + [START] + [IMAGE] * 6 + [END] + text(2),
            text(2) + [START] + [VIDEO] * 16 + [END] + text(3) + [START] + [IMAGE] * 1 + [END],
            text(5)]
    ids = torch.tensor([t for d in docs for t in d])
    cu = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()])
    images = torch.tensor([[1, 4, 6], [1, 2, 2]])
    videos = torch.tensor([[4, 4, 4]])
    return ids, cu, images, videos, [(0, 1, 0, 0), (1, 1, 0, 1), (2, 0, 1, 0)]


def _hf_positions(model, ids, images, videos, seconds):
    kwargs = dict(image_grid_thw=images if images.numel() else None,
                  video_grid_thw=videos if videos.numel() else None)
    params = inspect.signature(model.model.get_rope_index).parameters
    if "mm_token_type_ids" in params:
        kwargs["mm_token_type_ids"] = ((ids == IMAGE).long() + 2 * (ids == VIDEO).long())[None]
    if "second_per_grid_ts" in params and videos.numel():
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    positions, _ = model.model.get_rope_index(ids[None], **kwargs)
    return positions[:, 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_positions_match_transformers_per_document(arch):
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the pinned rule is transformers 5.x's (4.x advances differently after "
                    "videos); this environment has transformers " + transformers.__version__)
    hf = make_hf_vl_model(arch, seed=0)
    cfg = vl_config_from_hf(hf.config.to_dict())
    ids, cu, images, videos, layout = _video_stream(1)
    seconds = [1.5]
    positions, rows = vl_position_ids(ids, cu, cfg, images, videos, seconds)
    image_at = video_at = 0
    for d, (_, num_images, _, num_videos) in enumerate(layout):
        a, b = int(cu[d]), int(cu[d + 1])
        doc = ids[a:b]
        expected = _hf_positions(hf, doc, images[image_at:image_at + num_images],
                                 videos[video_at:video_at + num_videos],
                                 seconds[video_at:video_at + num_videos])
        assert torch.equal(positions[:, a:b], expected), (d, positions[:, a:b], expected)
        image_at += num_images
        video_at += num_videos
    # Rows: images first (6 + 1 merged rows), then the video's 16.
    image_rows = rows[ids == IMAGE]
    assert image_rows.tolist() == list(range(7))
    assert rows[ids == VIDEO].tolist() == list(range(7, 23))
    assert bool((rows[(ids != IMAGE) & (ids != VIDEO)] == -1).all())


def test_labels_never_target_a_placeholder():
    hf = make_hf_vl_model("qwen2_vl", seed=0)
    cfg = vl_config_from_hf(hf.config.to_dict())
    ids, cu, _, grid, _ = vl_stream(2)
    out = vl_inputs(ids, cu, cfg, image_grid_thw=grid)
    labels = out["labels"]
    assert not bool(torch.isin(labels, torch.tensor([IMAGE, VIDEO])).any())
    # Vision start/end tokens are text: the last placeholder of a run predicts END, and the
    # token before a run predicts START.
    ends = (ids[1:] == END).nonzero().view(-1)
    assert bool((labels[ends] == END).all())
    starts = (ids[1:] == START).nonzero().view(-1)
    assert bool((labels[starts] == START).all())
    last = cu[1:] - 1
    assert bool((labels[last] == -100).all())


@pytest.mark.parametrize("arch", ARCHS)
def test_config_round_trip(arch, tmp_path):
    hf = make_hf_vl_model(arch, seed=0, tie=arch == "qwen2_vl")
    cfg = vl_config_from_hf(hf.config.to_dict())
    assert is_vl_config(hf.config.to_dict())
    assert cfg.text.mrope_section == (2, 1, 1) and cfg.text.qkv_bias
    assert cfg.text.tie_embeddings == (arch == "qwen2_vl")
    again = vl_config_from_hf(hf_vl_config_dict(cfg))
    assert again == cfg
    import transformers

    loaded = transformers.AutoConfig.for_model(**hf_vl_config_dict(cfg))
    assert vl_config_from_hf(loaded.to_dict()) == cfg


def test_decoder_config_is_not_vl():
    with pytest.raises(ValueError, match="not a vision-language model"):
        vl_config_from_hf({"architectures": ["Qwen2ForCausalLM"]})


def test_mrope_section_must_sum_to_half_head_dim():
    with pytest.raises(ValueError, match="sums to 5 but head_dim 8"):
        ModelConfig(vocab_size=10, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                    intermediate_size=8, mrope_section=(2, 2, 1))


def test_bad_placeholder_counts_raise_before_compute():
    hf = make_hf_vl_model("qwen2_vl", seed=0)
    cfg = vl_config_from_hf(hf.config.to_dict())
    ids, cu, _, grid, _ = vl_stream(3)
    with pytest.raises(ValueError, match=r"image 0 \(grid \[1, 4, 8\]\) needs 8 placeholder tokens .* has 6"):
        bad = grid.clone()
        bad[0] = torch.tensor([1, 4, 8])
        vl_position_ids(ids, cu, cfg, bad)
    with pytest.raises(ValueError, match="more image placeholder runs than image_grid_thw"):
        vl_position_ids(ids, cu, cfg, grid[:2])
    with pytest.raises(ValueError, match="image_grid_thw has 5 rows but the stream has 4"):
        vl_position_ids(ids, cu, cfg, torch.cat([grid, grid[:1]]))
    with pytest.raises(ValueError, match="multiples of the spatial merge size 2"):
        vl_position_ids(ids, cu, cfg, torch.tensor([[1, 3, 8]] + grid[1:].tolist()))
    # A run cut by a document boundary: move the boundary into the first image's run.
    cut = cu.clone()
    cut[1] = int((ids == IMAGE).nonzero()[2])
    with pytest.raises(ValueError, match="cut by a document boundary"):
        vl_position_ids(ids, cut, cfg, grid)


def test_vl_config_rejects_mismatched_hidden():
    hf = make_hf_vl_model("qwen2_vl", seed=0)
    cfg = vl_config_from_hf(hf.config.to_dict())
    with pytest.raises(ValueError, match="out_hidden_size 32 must equal text.hidden_size 64"):
        dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, hidden_size=64))
