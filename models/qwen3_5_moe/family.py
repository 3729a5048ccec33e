"""The Qwen3.5-MoE text family: Qwen3.5's hybrid decoder with Qwen3-MoE's MoE plumbing.

Counts (logical, tp = ep = 1): Qwen3.5's (``mpcore.models.common.hybrid.counts``, whose SwiGLU of
``intermediate_size`` is here the shared expert) plus per layer the router ``E h``, the
experts ``E * 3 h I`` and the shared expert's gate ``h``; ``active`` keeps k of the E experts.
FLOPs per token: Qwen3.5's plus ``6 x`` (router, k experts, shared gate) per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpcore.models.common.moe_family import moe_variant, with_moe_fields
from mpcore.models.common.moe_model import idle_expert_params
from mpcore.models.common.section import given, section_of
from mpcore.models.qwen3_5.family import FAMILY as QWEN3_5
from mpcore.models.qwen3_5_moe.config import Qwen35MoeConfig
from mpcore.models.qwen3_5_moe.hf import (
    ARCHITECTURES,
    TEXT_ARCH,
    config_from_hf,
    export_hf,
    hf_config_dict,
    load_hf,
    shard_map,
)
from mpcore.models.qwen3_5_moe.model import build

Qwen35MoeExpertsSection = section_of(Qwen35MoeConfig, "Qwen35MoeExpertsSection",
                                     skip=QWEN3_5.config_type)
"""The YAML ``model.moe`` keys of the qwen3_5_moe family: ``Qwen35MoeConfig``'s MoE fields."""


@dataclass(frozen=True)
class Qwen35MoeSection(QWEN3_5.section):
    """Our YAML model section of the qwen3_5_moe family: the qwen3_5 family's keys
    (``intermediate_size``: the shared expert's width) and ``moe``."""

    moe: Qwen35MoeExpertsSection | None = None
    """The experts from scratch: num_experts, num_experts_per_tok, moe_intermediate_size,
    router_aux_loss_coef, router_z_loss_coef (top-k always renormalised, every layer sparse).
    Null: their defaults."""


def config_from_dict(d: dict) -> Qwen35MoeConfig:
    """``Qwen35MoeConfig`` of ``dataclasses.asdict(cfg)`` (a checkpoint's meta.json; the config
    turns its lists back into tuples)."""
    return Qwen35MoeConfig(**d)


def with_experts(dense, moe: dict) -> Qwen35MoeConfig:
    """``dense``'s decoder (a ``Qwen35Config``) with every feed-forward a MoE block of ``moe``
    (``Qwen35MoeConfig``'s MoE fields; ``dense.intermediate_size``: the shared expert's
    width)."""
    return with_moe_fields(Qwen35MoeConfig, dense, moe,
                           "mpcore.models.qwen3_5_moe.config.Qwen35MoeConfig")


def config_from_section(section, token_ids: dict | None) -> Qwen35MoeConfig:
    """Our YAML model section as the qwen3_5 family reads it (``intermediate_size``: the shared
    expert's width), plus its ``moe`` mapping (``Qwen35MoeConfig``'s MoE fields:
    num_experts, num_experts_per_tok, moe_intermediate_size, router_aux_loss_coef,
    router_z_loss_coef)."""
    return with_experts(QWEN3_5.config_from_section(section, token_ids), given(section.moe))


def _moe_sizes(cfg: Qwen35MoeConfig) -> tuple[int, int]:
    """Per layer: ``(router + shared gate, one expert)`` parameters."""
    h = cfg.hidden_size
    return cfg.num_experts * h + h, 3 * h * cfg.moe_intermediate_size


def num_params(cfg: Qwen35MoeConfig) -> dict[str, int]:
    """``total``, ``embedding``, ``head`` and ``active`` parameter counts (module docstring)."""
    out = QWEN3_5.num_params(cfg)
    fixed, expert = _moe_sizes(cfg)
    out["total"] += cfg.num_layers * (fixed + cfg.num_experts * expert)
    return {**out, "active": out["total"] - idle_expert_params(cfg)}


def flops_per_token(cfg: Qwen35MoeConfig, seq_len: int) -> float:
    """Training FLOPs per token at ``seq_len`` (module docstring)."""
    fixed, expert = _moe_sizes(cfg)
    moe = cfg.num_layers * (fixed + cfg.num_experts_per_tok * expert)
    return QWEN3_5.flops_per_token(cfg, seq_len) + 6.0 * moe


FAMILY = moe_variant(
    QWEN3_5, name="qwen3_5_moe", config_type=Qwen35MoeConfig, hf_architectures=(TEXT_ARCH,),
    hf_model_types=(ARCHITECTURES[TEXT_ARCH],),
    config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build, load_hf=load_hf, export_hf=export_hf, shard_map=shard_map,
    num_params=num_params, flops_per_token=flops_per_token, section=Qwen35MoeSection)

__all__ = ["FAMILY", "config_from_dict", "config_from_section", "with_experts"]
