"""The Qwen3.5-MoE text family: the Qwen3.5 hybrid decoder with every feed-forward a MoE block
(``mpcore.models.common.hybrid.moe_*``), derived from the qwen3_5 family's record."""

from __future__ import annotations

from dataclasses import dataclass

from mpcore.models.common.hybrid.moe_config import (
    Qwen35MoeConfig,
    Qwen35MoeExpertsSection,
    config_from_dict,
    with_experts,
)
from mpcore.models.common.hybrid.moe_counts import flops_per_token, num_params
from mpcore.models.common.hybrid.moe_hf import (
    ARCHITECTURES,
    TEXT_ARCH,
    config_from_hf,
    export_hf,
    full_map,
    hf_config_dict,
    load_hf,
)
from mpcore.models.common.hybrid.moe_model import build
from mpcore.models.common.moe_family import moe_variant
from mpcore.models.common.section import given
from mpcore.models.qwen3_5.family import FAMILY as QWEN3_5


@dataclass(frozen=True)
class Qwen35MoeSection(QWEN3_5.section):
    """Our YAML model section of the qwen3_5_moe family: the qwen3_5 family's keys
    (``intermediate_size``: the shared expert's width) and ``moe``."""

    moe: Qwen35MoeExpertsSection | None = None
    """The experts from scratch: num_experts, num_experts_per_tok, moe_intermediate_size,
    router_aux_loss_coef, router_z_loss_coef (top-k always renormalised, every layer sparse).
    Null: their defaults."""


def config_from_section(section, token_ids: dict | None) -> Qwen35MoeConfig:
    """Our YAML model section as the qwen3_5 family reads it (``intermediate_size``: the shared
    expert's width), plus its ``moe`` mapping (``Qwen35MoeConfig``'s MoE fields:
    num_experts, num_experts_per_tok, moe_intermediate_size, router_aux_loss_coef,
    router_z_loss_coef)."""
    return with_experts(QWEN3_5.config_from_section(section, token_ids), given(section.moe))


FAMILY = moe_variant(
    QWEN3_5, name="qwen3_5_moe", config_type=Qwen35MoeConfig, hf_architectures=(TEXT_ARCH,),
    hf_model_types=(ARCHITECTURES[TEXT_ARCH],),
    config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build, load_hf=load_hf, export_hf=export_hf, shard_map=full_map,
    num_params=num_params, flops_per_token=flops_per_token, section=Qwen35MoeSection)

__all__ = ["FAMILY", "config_from_dict", "config_from_section", "with_experts"]
