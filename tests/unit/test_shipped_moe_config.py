"""launch/configs/qwen3_30b_a3b.yaml is Qwen3-30B-A3B: the model it builds has transformers'
parameter count for the released config (both counted on meta), and its layout passes the
expert-parallel checks a launch makes (ep divides the experts). Every shipped MoE config
refuses settings a MoE model cannot train with (negative router weights, no sparse layer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mpcore.build import resolve_model_config
from mpcore.config import load_config
from mpcore.models.registry import family_named, family_of

CONFIG = Path(__file__).resolve().parents[2] / "launch" / "configs" / "qwen3_30b_a3b.yaml"
# The released config.json's shape fields (Qwen/Qwen3-30B-A3B).
RELEASED = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                head_dim=128, num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)


def test_qwen3_30b_a3b_yaml_has_transformers_parameter_count():
    cfg, model_cfg = resolve_model_config(load_config(CONFIG))
    family = family_of(model_cfg)
    assert family.name == "qwen3_moe"
    assert family.config_from_hf({"architectures": ["Qwen3MoeForCausalLM"], **RELEASED}) \
        == model_cfg
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**RELEASED))
    counts = family.num_params(model_cfg)
    assert counts["total"] == sum(p.numel() for p in hf.parameters())  # 30.5 B
    assert 3.2e9 < counts["active"] < 3.4e9  # the "A3B"
    assert model_cfg.num_experts % cfg.parallel.ep == 0


MOE_CONFIGS = sorted(CONFIG.parent.glob("*moe_tiny.yaml"))
VL_IDS = dict(image_token_id=2044, video_token_id=2045, vision_start_token_id=2046,
              vision_end_token_id=2047)


@pytest.mark.parametrize("path", MOE_CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize(("override", "message"), [
    ("model.moe.router_aux_loss_coef=-1", r"model.moe.router_aux_loss_coef must be a finite "
                                          r"weight >= 0 .*got -1.0"),
    ("model.moe.router_z_loss_coef=-0.5", r"model.moe.router_z_loss_coef must be a finite"),
    ("model.moe.router_aux_loss_coef=.nan", r"router_aux_loss_coef must be a finite"),
    ("model.moe.mlp_only_layers=[0,1,2,3]", r"no layer of this 4-layer MoE model is sparse "
                                            r"\(mlp_only_layers \[0, 1, 2, 3\]"),
    ("model.moe.decoder_sparse_step=5", r"no layer of this 4-layer MoE model is sparse"),
])
def test_moe_settings_that_cannot_train_are_refused_when_the_config_is_built(path, override,
                                                                            message):
    """Issue 39: a negative load-balancing weight trained silently, and a MoE model with no
    sparse layer failed at the first step (``AssertionError: no MoE layer ran``). Both are
    the family's config (every MoE family's, YAML or a checkpoint's config.json): refused as
    the model config is built, before anything runs. The Qwen3.5 MoE families take no
    mlp_only_layers / decoder_sparse_step (every layer is sparse): refused for that reason."""
    cfg = load_config(path, ["model.num_layers=4", override])
    family = family_named(cfg.model.resolved_family)
    ids = VL_IDS if family.modality == "image-text" else None
    with pytest.raises(ValueError, match=message if "qwen35" not in path.stem or "coef" in
                       override else "mlp_only_layers|decoder_sparse_step"):
        resolve_model_config(cfg, family, ids)


def test_a_checkpoint_config_with_a_negative_router_weight_is_refused():
    hf = {"architectures": ["Qwen3MoeForCausalLM"], **RELEASED, "router_aux_loss_coef": -0.01}
    with pytest.raises(ValueError, match="router_aux_loss_coef must be a finite weight"):
        family_named("qwen3_moe").config_from_hf(hf)
