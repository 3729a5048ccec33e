"""Tiny random transformers Qwen3-VL-MoE models: ``hf_qwen3_vl_tiny``'s decoder and tower with
MoE MLPs (4 experts, top-2; layer 1 dense through ``mlp_only_layers``). The streams and the
per-document references are ``hf_qwen3_vl_tiny``'s (transformers' auto class loads either).
transformers is imported inside the functions: spawned test ranks import this module."""

from __future__ import annotations

from tests.dist.hf_moe_tiny import randomise_moe
from tests.dist.hf_qwen3_vl_tiny import TEXT, TOKENS, VISION

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.5)


def make_hf_model(seed: int, tie: bool = False):
    """A float32 transformers Qwen3-VL-MoE model with fresh random weights (eval mode)."""
    import transformers

    config = transformers.Qwen3VLMoeConfig(text_config=dict(TEXT, **MOE),
                                           vision_config=dict(VISION),
                                           tie_word_embeddings=tie, **TOKENS)
    return randomise_moe(transformers.Qwen3VLMoeForConditionalGeneration(config).eval(), seed)


def save_hf_model(seed: int, folder, tie: bool = False) -> None:
    make_hf_model(seed, tie).save_pretrained(folder)


EAGER = {"experts_implementation": "eager"}  # transformers' grouped GEMM takes no float64
