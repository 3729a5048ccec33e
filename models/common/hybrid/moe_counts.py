"""Parameter and FLOP counts of the Qwen3.5-MoE text decoder.

Counts (logical, tp = ep = 1): Qwen3.5's (``mpcore.models.common.hybrid.counts``, whose SwiGLU of
``intermediate_size`` is here the shared expert) plus per layer the router ``E h``, the
experts ``E * 3 h I`` and the shared expert's gate ``h``; ``active`` keeps k of the E experts.
FLOPs per token: Qwen3.5's plus ``6 x`` (router, k experts, shared gate) per layer. With
multi-token prediction on (``cfg.uses_mtp``) the MTP layer counts as one more MoE layer.
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
    out["total"] += _num_moe(cfg) * (fixed + cfg.num_experts * expert)
    idle = idle_expert_params(cfg) * _num_moe(cfg) // len(cfg.moe_layers)
    return {**out, "active": out["total"] - idle}


def _num_moe(cfg: Qwen35MoeConfig) -> int:
    """MoE layers: every decoder layer, and the MTP layer when it is built."""
    return cfg.num_layers + (1 if cfg.uses_mtp else 0)


def flops_per_token(cfg: Qwen35MoeConfig, seq_len: int) -> float:
    """Training FLOPs per token at ``seq_len`` (module docstring)."""
    fixed, expert = _moe_sizes(cfg)
    moe = _num_moe(cfg) * (fixed + cfg.num_experts_per_tok * expert)
    return text_counts.flops_per_token(cfg, seq_len) + 6.0 * moe
