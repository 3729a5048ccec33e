"""launch/configs/qwen3_30b_a3b.yaml is Qwen3-30B-A3B: the model it builds has transformers'
parameter count for the released config (both counted on meta), and its layout passes the
expert-parallel checks a launch makes (ep divides the experts)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from mpcore.build import resolve_model_config
from mpcore.config import load_config
from mpcore.models.registry import family_of

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
