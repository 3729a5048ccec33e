"""A tiny random transformers ``Qwen3_5MoeForConditionalGeneration`` (Qwen3.5-MoE VL).

``hf_qwen35_vl_tiny``'s model (the hybrid decoder with interleaved M-RoPE ``[2, 2, 2]``, the
tower without DeepStack) with every MLP ``qwen35_moe_tiny``'s MoE block: 8 experts, top-2
(always renormalised), experts of 24, a shared expert of 40 with its sigmoid gate, a sharp
router and a large ``router_aux_loss_coef`` so the aux loss shows in the loss. The streams and
float64 references are ``hf_qwen3_vl_tiny``'s (its ``reference_loss_grads(aux=True)`` adds the
whole batch's load-balancing loss). transformers is imported inside functions: spawned test
ranks import this module.
"""

from __future__ import annotations

from tests.dist.hf_qwen3_vl_tiny import TOKENS
from tests.dist.hf_qwen35_vl_tiny import TEXT, TOWER
from tests.dist.qwen35_moe_tiny import CONFIG, MOE_KEYS, randomize_, sharpen_router_

TEXT_MOE = {k: v for k, v in TEXT.items() if k != "intermediate_size"} | {
    k: CONFIG[k] for k in MOE_KEYS}
EAGER = {"experts_implementation": "eager"}  # transformers' grouped GEMM takes no float64


def make_hf_model(seed: int, tie: bool = False):
    """A float32 ``Qwen3_5MoeForConditionalGeneration`` with fresh random weights (eval)."""
    import transformers

    config = transformers.Qwen3_5MoeConfig(text_config=dict(TEXT_MOE),
                                           vision_config=dict(TOWER), tie_word_embeddings=tie,
                                           **TOKENS)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    return sharpen_router_(randomize_(model, seed))


def save_hf_model(seed: int, folder, tie: bool = False) -> None:
    make_hf_model(seed, tie).save_pretrained(folder)
