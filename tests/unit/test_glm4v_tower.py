"""GLM-4V vision tower vs transformers' ``Glm4vVisionModel``, one process, fp32 on the CPU.

A tiny random transformers tower (fresh weights for every parameter, norms and biases included;
``attention_bias`` on so the qkv bias is covered), loaded into ours through
``vision_shard_map``. One call holds images of different grids, one larger than the learned
4x4 position grid and one smaller (so the bicubic resampling both up- and down-samples, and the
border padding is used), and a 3-frame video. transformers runs a video frame by frame
(``get_video_features`` flattens its grid to t=1 rows), so it gets the flattened grid; ours takes
the video's ``[t, h, w]`` row as it is.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4vVisionConfig as HFVisionConfig
from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

from mpcore.models.glm4v import Glm4vVisionTower, vision_from_hf, vision_shard_map
from mpcore.models.glm4v.tower import resample_positions
from mpcore.models.qwen2_vl.vision_hf import shard_from_full

VISION = dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=40, out_hidden_size=24,
              image_size=8, patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
              attention_bias=True, rms_norm_eps=1e-5)
GRID = [[1, 6, 10], [3, 4, 4], [1, 2, 2], [1, 10, 6]]  # the 3-frame video second


def _hf_tower(seed: int = 1) -> Glm4vVisionModel:
    torch.manual_seed(seed)
    model = Glm4vVisionModel(HFVisionConfig(**VISION)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape)
            is_norm = "norm" in name and name.endswith("weight")
            p.copy_(1.0 + 0.2 * noise if is_norm else 0.15 * noise)
    return model


def _ours(hf: Glm4vVisionModel) -> Glm4vVisionTower:
    cfg = vision_from_hf(hf.config.to_dict())
    tower = Glm4vVisionTower(cfg)
    full = {k: v.detach() for k, v in hf.state_dict().items()}
    params = dict(tower.named_parameters())
    table = vision_shard_map(cfg, 1, 0, prefix="")
    assert set(table) == set(params)
    with torch.no_grad():
        for name, pieces in table.items():
            params[name].copy_(shard_from_full(full, pieces))
    return tower


def _flat(grid):
    return [[1, h, w] for t, h, w in grid for _ in range(t)]


def test_tower_matches_transformers():
    hf = _hf_tower()
    tower = _ours(hf)
    patches = sum(t * h * w for t, h, w in GRID)
    pixels = torch.randn(patches, tower.cfg.patch_dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(pixels, grid_thw=torch.tensor(_flat(GRID))).pooler_output
        got = tower(pixels, torch.tensor(GRID))
    assert got.shape == (patches // 4, 24)
    assert (got - want).abs().max().item() < 1e-4
    assert want.abs().max().item() > 0.1  # not trivially small


def test_resampling_is_bicubic_and_used():
    """The resampled grid differs from bilinear (so a bilinear one would fail the test above),
    and dropping it changes the tower's output."""
    hf = _hf_tower()
    tower = _ours(hf)
    positions = torch.tensor([[0, 0], [2, 3], [5, 9]])
    sizes = torch.tensor([[6, 10]] * 3)
    bicubic = resample_positions(tower.pos_embed.detach(), positions, sizes)
    side = tower.cfg.grid_side
    grid = tower.pos_embed.detach().view(side, side, -1).permute(2, 0, 1)[None]
    norm = ((positions.float() + 0.5) / sizes * 2 - 1).flip(-1).view(1, -1, 1, 2)
    bilinear = torch.nn.functional.grid_sample(grid, norm, mode="bilinear",
                                               align_corners=False, padding_mode="border")
    assert (bicubic - bilinear[0, :, :, 0].t()).abs().max().item() > 1e-3
    pixels = torch.randn(60, tower.cfg.patch_dim)
    with torch.no_grad():
        base = tower(pixels, [[1, 6, 10]])
        tower.pos_embed.zero_()
        assert (tower(pixels, [[1, 6, 10]]) - base).abs().max().item() > 1e-3


@pytest.mark.parametrize("bad, message", [
    (dict(image_size=[8, 6]), "must be square"),
    (dict(num_heads=3), "head dim"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(window_size=4), "does not implement"),
])
def test_bad_vision_config(bad, message):
    with pytest.raises(ValueError, match=message):
        vision_from_hf({**VISION, **bad})


def test_pixel_rows_must_match_grid():
    tower = _ours(_hf_tower())
    with pytest.raises(ValueError, match="implies sum"):
        tower(torch.randn(10, tower.cfg.patch_dim), [[1, 2, 4]])
    with pytest.raises(ValueError, match="multiples of the spatial merge size"):
        tower(torch.randn(6, tower.cfg.patch_dim), [[1, 2, 3]])
