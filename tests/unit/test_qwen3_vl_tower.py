"""Qwen3-VL vision tower vs transformers' ``Qwen3VLVisionModel`` (one process, CPU, fp32).

A tiny random transformers tower (every parameter drawn, norms and biases included) is written
as safetensors under ``model.visual.`` and loaded through our shard map, so the table is tested
too. One call holds images of different grids (one larger and one smaller than the 4 x 4
position table, a non-square one) and a 3-frame video: the merged rows and every DeepStack
feature agree within 1e-4, and so do the gradients of every parameter.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import save_file

from mpcore.models.common.hf_io import Checkpoint, _scatter_back, fill_from_table
from mpcore.models.common.qwen3_vl.config import Qwen3VisionConfig, vision_config_from_hf
from mpcore.models.common.qwen3_vl.hf import vision_shard_map
from mpcore.models.common.qwen3_vl.vision import Qwen3VisionTower

VISION = dict(depth=3, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=32,
              patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
              num_position_embeddings=16, deepstack_visual_indexes=[2, 0])
GRID = [[1, 8, 12], [3, 4, 6], [1, 2, 2], [1, 6, 10]]


def _hf_tower(seed: int):
    config = transformers.Qwen3VLVisionConfig(**VISION)
    model = transformers.Qwen3VLVisionModel(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model


def _ours(hf_model, folder) -> Qwen3VisionTower:
    save_file({f"model.visual.{k}": v.contiguous() for k, v in hf_model.state_dict().items()},
              folder / "model.safetensors")
    cfg = vision_config_from_hf(hf_model.config.to_dict())
    with torch.device("meta"):
        tower = Qwen3VisionTower(cfg)
    tower.to_empty(device="cpu")
    fill_from_table(tower, Checkpoint(folder), vision_shard_map(cfg, 1, 0))
    return tower


def test_config_reads_the_transformers_vision_config():
    cfg = vision_config_from_hf(transformers.Qwen3VLVisionConfig(**VISION).to_dict())
    assert cfg == Qwen3VisionConfig(**{**VISION, "deepstack_visual_indexes": (2, 0)})
    assert cfg.grid_side == 4 and cfg.patch_dim == 24


def test_tower_and_deepstack_match_transformers(tmp_path):
    hf_model = _hf_tower(seed=0)
    tower = _ours(hf_model, tmp_path)
    grid = torch.tensor(GRID)
    num = int(grid.prod(-1).sum())
    pixels = torch.randn(num, 24, generator=torch.Generator().manual_seed(1))
    ref = hf_model(pixels, grid_thw=grid)
    merged, features = tower(pixels, grid)
    assert merged.shape == ref.pooler_output.shape == (num // 4, 32)
    assert float((merged - ref.pooler_output).detach().abs().max()) <= 1e-4
    assert len(features) == len(ref.deepstack_features) == 2
    for ours, theirs in zip(features, ref.deepstack_features, strict=True):
        assert float((ours - theirs).detach().abs().max()) <= 1e-4
    # Gradients of a loss that reads every output, on both sides.
    weights = [torch.randn(merged.shape, generator=torch.Generator().manual_seed(k))
               for k in range(3)]

    def loss(outs):
        return sum((o * w).sum() for o, w in zip(outs, weights, strict=True))

    loss([ref.pooler_output, *ref.deepstack_features]).backward()
    loss([merged, *features]).backward()
    ours: dict[str, torch.Tensor] = {}
    for name, pieces in vision_shard_map(tower.cfg, 1, 0).items():
        _scatter_back(dict(tower.named_parameters())[name].grad, pieces, ours)
    for name, p in hf_model.named_parameters():
        mine = ours[f"model.visual.{name}"]
        assert float((mine - p.grad).norm() / p.grad.norm()) <= 1e-4, name


def test_features_in_block_order_each_through_its_own_merger(tmp_path):
    """Swapping the two DeepStack mergers' weights must change the features (the k-th feature
    comes from block ``sorted order``, through merger ``index(block)``)."""
    hf_model = _hf_tower(seed=2)
    tower = _ours(hf_model, tmp_path)
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_model(pixels, grid_thw=grid).deepstack_features
    with torch.no_grad():
        _, before = tower(pixels, grid)
        a, b = tower.deepstack_mergers
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            tmp = pa.clone()
            pa.copy_(pb)
            pb.copy_(tmp)
        _, after = tower(pixels, grid)
    assert float((before[0] - ref[0]).abs().max()) <= 1e-4
    assert float((after[0] - ref[0]).abs().max()) > 1e-2


@pytest.mark.parametrize(("change", "message"), [
    (dict(deepstack_visual_indexes=(1, 3)), "not a vision block index"),
    (dict(num_position_embeddings=15), "not a perfect square"),
    (dict(hidden_act="gelu"), "not implemented"),
    (dict(num_heads=8), "multiple of 4"),
])
def test_bad_vision_config(change, message):
    with pytest.raises(ValueError, match=message):
        Qwen3VisionConfig(**{**VISION, **change})
