"""A tiny random transformers ``Qwen3_5MoeForCausalLM`` (and its references: ``hf_moe_tiny``).

Qwen3.5's tiny shapes (``qwen35_tiny.HF_CONFIG``: 4 layers ``[linear, full, linear, linear]``,
gated attention, grouped DeltaNet heads, an untied head) with every MLP a MoE block: 8
experts, top-2 (always renormalised), experts of 24, a shared expert of 40 with its sigmoid
gate, a sharp router (weights 0.5-scaled) so the top-k choice is far from ties, and a large
``router_aux_loss_coef`` so the aux loss shows in the loss. The float64 reference with the
aux loss over the whole batch is ``hf_moe_tiny.reference`` (transformers'
``load_balancing_loss_func``, the same function in ``qwen3_moe`` and ``qwen3_5_moe``).
"""

from __future__ import annotations

import torch

from tests.dist.qwen35_tiny import HF_CONFIG, randomize_

CONFIG = {k: v for k, v in HF_CONFIG.items() if k != "intermediate_size"} | dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
    shared_expert_intermediate_size=40, router_aux_loss_coef=0.05)


def make_hf_model(seed: int, **overrides):
    """A float32 ``Qwen3_5MoeForCausalLM`` with fresh random weights (eval mode)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**CONFIG, **overrides})).eval()
    return sharpen_router_(randomize_(model, seed))


MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "router_aux_loss_coef")


@torch.no_grad()
def sharpen_router_(model):
    """Scale every router of a ``randomize_``d model to weights of 0.5 (top-k far from ties)."""
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.mul_(0.5 / 0.12)
    return model


def save_hf_model(seed: int, folder, **overrides) -> None:
    make_hf_model(seed, **overrides).save_pretrained(folder)
