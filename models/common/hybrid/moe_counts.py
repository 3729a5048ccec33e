"""Parameter and FLOP counts of the Qwen3.5-MoE text decoder.

Counts (logical, tp = ep = 1): Qwen3.5's (``mpcore.models.common.hybrid.counts``, whose SwiGLU of
``intermediate_size`` is here the shared expert) plus per layer the router ``E h``, the
experts ``E * 3 h I`` and the shared expert's gate ``h``; ``active`` keeps k of the E experts.
FLOPs per token: Qwen3.5's plus ``6 x`` (router, k experts, shared gate) per layer.
"""

from __future__ import annotations

from mpcore.models.common.hybrid import counts as text_counts
from mpcore.models.common.hybrid.moe_config import Qwen35MoeConfig
from mpcore.models.common.moe_model import idle_expert_params


def _moe_sizes(cfg: Qwen35MoeConfig) -> tuple[int, int]:
    """Per layer: ``(router + shared gate, one expert)`` parameters."""
    h = cfg.hidden_size
    return cfg.num_experts * h + h, 3 * h * cfg.moe_intermediate_size


def num_params(cfg: Qwen35MoeConfig) -> dict[str, int]:
    """``total``, ``embedding``, ``head`` and ``active`` parameter counts (module docstring)."""
    out = text_counts.num_params(cfg)
    fixed, expert = _moe_sizes(cfg)
    out["total"] += cfg.num_layers * (fixed + cfg.num_experts * expert)
    return {**out, "active": out["total"] - idle_expert_params(cfg)}


def flops_per_token(cfg: Qwen35MoeConfig, seq_len: int) -> float:
    """Training FLOPs per token at ``seq_len`` (module docstring)."""
    fixed, expert = _moe_sizes(cfg)
    moe = cfg.num_layers * (fixed + cfg.num_experts_per_tok * expert)
    return text_counts.flops_per_token(cfg, seq_len) + 6.0 * moe
