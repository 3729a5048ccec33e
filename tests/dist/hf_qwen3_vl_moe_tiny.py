"""Tiny random transformers Qwen3-VL-MoE models: ``hf_qwen3_vl_tiny``'s decoder and tower with
MoE MLPs (4 experts, top-2; layer 1 dense through ``mlp_only_layers``). The streams and the
per-document references are ``hf_qwen3_vl_tiny``'s (transformers' auto class loads either).
transformers is imported inside the functions: spawned test ranks import this module."""

from __future__ import annotations

import torch
from hf_qwen3_vl_tiny import TEXT, TOKENS, VISION

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.5)


def make_hf_model(seed: int, tie: bool = False):
    """A float32 transformers Qwen3-VL-MoE model with fresh random weights (eval mode)."""
    import transformers

    config = transformers.Qwen3VLMoeConfig(text_config=dict(TEXT, **MOE),
                                           vision_config=dict(VISION),
                                           tie_word_embeddings=tie, **TOKENS)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            # A sharp router (0.5) so the top-k choice is far from ties.
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.15
            p.copy_(1.0 + 0.2 * noise if "norm" in name else scale * noise)
    return model


def save_hf_model(seed: int, folder, tie: bool = False) -> None:
    make_hf_model(seed, tie).save_pretrained(folder)


EAGER = {"experts_implementation": "eager"}  # transformers' grouped GEMM takes no float64
