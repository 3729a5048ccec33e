"""The Qwen3.5 VL family from our YAML: the shipped ``qwen35_vl_tiny.yaml`` resolves to a
hybrid decoder with interleaved M-RoPE over the rotated dims and a tower without DeepStack,
builds, and runs a forward/backward on a packed stream with an image (every parameter gets a
gradient); sections it cannot run are refused naming the fix; the registry and mpcore's
family list agree on the new name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mpcore.build import run_family
from mpcore.config import load_config
from mpcore.models.qwen3_5_vl import FAMILY, Qwen35VLConfig, build_model
from mpcore.parallel.state import ParallelState

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "launch" / "configs" / "qwen35_vl_tiny.yaml"
IDS = dict(image_token_id=2048, video_token_id=2049, vision_start_token_id=2050,
           vision_end_token_id=2051)


def test_shipped_tiny_yaml_builds_and_trains_a_step():
    cfg = FAMILY.config_from_section(load_config(str(CONFIG)).model, IDS)
    assert isinstance(cfg, Qwen35VLConfig) and run_family(load_config(str(CONFIG))) is FAMILY
    text = cfg.text
    assert text.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (text.rotary_dim, text.mrope_section, text.mrope_interleaved) == (8, (2, 1, 1), True)
    assert cfg.vision.deepstack_visual_indexes == () and cfg.vision.out_hidden_size == 64
    model = build_model(cfg, ParallelState(), seed=0)
    ids = torch.tensor([5, 2050, *[2048] * 6, 2051, 7, 8, 9, 10, 3, 4])
    _, inputs = FAMILY.local_inputs(ParallelState(), ids, torch.tensor([0, 13, ids.numel()]),
                                    cfg, pixel_values=torch.randn(24, cfg.vision.patch_dim),
                                    image_grid_thw=torch.tensor([[1, 4, 6]]))
    loss = model(**inputs, output="loss").sum()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and float(p.grad.abs().max()) > 0
               for n, p in model.named_parameters() if n.endswith("weight")), [
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().max()]


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.mrope_section=[2,2,1]"], r"mrope_section \[2, 2, 1\] sums to 5 but rotary_dim 8"),
    (["model.vision.deepstack_visual_indexes=[0]"], "the Qwen3.5 tower has no DeepStack"),
    (["model.vision=null", "model.mrope_section=null"], "needs model.vision"),
    (["model.qkv_bias=true"], "model.qkv_bias is set but the qwen3_5_vl family"),
])
def test_sections_it_cannot_run_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        FAMILY.config_from_section(load_config(str(CONFIG), overrides).model, IDS)


def test_a_qwen35_vl_checkpoint_given_to_another_family_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    for family in ("qwen3_vl", "qwen3_5"):
        with pytest.raises(ValueError, match=f"model.family={family} but model.init_from=.* is "
                                             f"a qwen3_5_vl checkpoint"):
            run_family(load_config(None, [f"model.family={family}",
                                          f"model.init_from={tmp_path}"]))


def test_auto_vision_attention_is_the_familys_measured_kernel():
    # qwen3_5_vl's host-bound step runs its tower on flash under auto; the MoE variant and the
    # other families keep cuDNN; a kernel named explicitly is what every block runs.
    from mpcore.models.common.vl_model import VisionLanguageModel
    from mpcore.models.qwen3_5_vl_moe.model import Qwen35VLMoeModel
    cfg = FAMILY.config_from_section(load_config(str(CONFIG)).model, IDS)
    for asked, ran in (("auto", "flash"), ("cudnn", "cudnn"), ("flash", "flash")):
        model = build_model(cfg, ParallelState(), seed=0, vision_attention=asked)
        assert {layer.attention.kernel for layer in model.visual.layers} == {ran}
    assert VisionLanguageModel.vision_kernel("auto") == "cudnn"
    assert Qwen35VLMoeModel.vision_kernel("auto") == "cudnn"
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        build_model(cfg, ParallelState(), seed=0, vision_attention="ring")
