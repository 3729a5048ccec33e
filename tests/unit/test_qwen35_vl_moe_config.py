"""The Qwen3.5-MoE VL family from our YAML: the shipped ``qwen35_vl_moe_tiny.yaml`` resolves
(``model.family`` names it; ``auto`` with vision and moe keeps qwen3_vl_moe,
tests/unit/test_families.py) to the Qwen3.5 VL
model whose every feed-forward is a MoE block, builds, and runs a forward/backward on a packed
stream with an image (every weight gets a gradient, the routing statistics count every token);
MoE keys it does not take and bad expert counts are refused naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpcore.build import run_family
from mpcore.config import load_config
from mpcore.models.qwen3_5_moe import Qwen35MoeConfig
from mpcore.models.qwen3_5_vl_moe import FAMILY, Qwen35VLMoeConfig
from mpcore.models.qwen3_5_vl_moe.model import build_model
from mpcore.parallel.state import ParallelState

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "launch" / "configs" / "qwen35_vl_moe_tiny.yaml"
IDS = dict(image_token_id=2048, video_token_id=2049, vision_start_token_id=2050,
           vision_end_token_id=2051)


def test_shipped_tiny_yaml_builds_and_trains_a_step():
    cfg = FAMILY.config_from_section(load_config(str(CONFIG)).model, IDS)
    assert isinstance(cfg, Qwen35VLMoeConfig) and isinstance(cfg.text, Qwen35MoeConfig)
    assert run_family(load_config(str(CONFIG))) is FAMILY
    text = cfg.text
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (4, 2, 64)
    assert text.moe_layers == (0, 1, 2, 3) and text.intermediate_size == 128
    assert (text.rotary_dim, text.mrope_section, text.mrope_interleaved) == (8, (2, 1, 1), True)
    assert cfg.vision.deepstack_visual_indexes == ()
    model = build_model(cfg, ParallelState(), seed=0)
    ids = torch.tensor([5, 2050, *[2048] * 6, 2051, 7, 8, 9, 10, 3, 4])
    _, inputs = FAMILY.local_inputs(ParallelState(), ids, torch.tensor([0, 13, ids.numel()]),
                                    cfg, pixel_values=torch.randn(24, cfg.vision.patch_dim),
                                    image_grid_thw=torch.tensor([[1, 4, 6]]))
    assert bool(inputs["moe_mask"].all())
    loss = model(**inputs, output="loss").sum()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and float(p.grad.abs().max()) > 0
               for n, p in model.named_parameters() if n.endswith(("weight", "w13", "w2"))), [
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().max()]
    assert int(model.router_stats().counts.sum()) == 4 * 2 * ids.numel()
    counts = FAMILY.num_params(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] - counts["active"] == 4 * (4 - 2) * 3 * 64 * 64


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.moe.norm_topk_prob=false"], "Qwen3.5-MoE has norm_topk_prob=True"),
    (["model.moe.mlp_only_layers=[1]"], "mlp_only_layers"),
    (["model.moe.num_experts_per_tok=5"], "num_experts_per_tok 5 is above num_experts 4"),
    (["model.vision=null", "model.mrope_section=null"],
     "model.family=qwen3_5_vl_moe from scratch needs model.vision"),
])
def test_sections_it_cannot_run_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        FAMILY.config_from_section(load_config(str(CONFIG), overrides).model, IDS)

