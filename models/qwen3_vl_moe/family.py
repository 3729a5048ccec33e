"""The Qwen3-VL-MoE family: Qwen3-VL (tower, DeepStack) over the Qwen3-MoE decoder."""

from __future__ import annotations

from dataclasses import dataclass

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.moe_family import moe_variant
from mpcore.models.common.section import given, section_of
from mpcore.models.qwen3_vl.family import FAMILY as QWEN3_VL
from mpcore.models.qwen3_vl_moe.config import (
    ARCH,
    MODEL_TYPE,
    Qwen3MoeConfig,
    Qwen3VLMoeConfig,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
    with_experts,
)
from mpcore.models.qwen3_vl_moe.hf import export_hf, load_hf_model, shard_map
from mpcore.models.qwen3_vl_moe.model import build_model, flops_per_token, num_params

Qwen3VLMoeExpertsSection = section_of(Qwen3MoeConfig, "Qwen3VLMoeExpertsSection",
                                      skip=ModelConfig, defaults={"norm_topk_prob": True},
                                      module=__name__)
"""The YAML ``model.moe`` keys of the qwen3_vl_moe family: ``Qwen3MoeConfig``'s MoE fields,
``norm_topk_prob`` true (the family's router always renormalises)."""


@dataclass(frozen=True)
class Qwen3VLMoeSection(QWEN3_VL.section):
    """Our YAML model section of the qwen3_vl_moe family: Qwen3-VL's keys and ``moe``."""

    moe: Qwen3VLMoeExpertsSection | None = None
    """The decoder's experts from scratch: ``Qwen3MoeConfig``'s MoE fields (num_experts,
    num_experts_per_tok, moe_intermediate_size, ...; norm_topk_prob must stay true). Null:
    their defaults."""


def config_from_section(section, token_ids: dict | None) -> Qwen3VLMoeConfig:
    """Qwen3-VL's YAML model section (decoder fields, ``vision``) plus ``moe`` (the MoE fields
    of ``Qwen3MoeConfig``; ``norm_topk_prob`` is always true)."""
    return with_experts(QWEN3_VL.config_from_section(section, token_ids),
                        given(section.moe))


FAMILY = moe_variant(
    QWEN3_VL, name="qwen3_vl_moe", config_type=Qwen3VLMoeConfig, hf_architectures=(ARCH,),
    hf_model_types=(MODEL_TYPE,), config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build_model, load_hf=load_hf_model, export_hf=export_hf, shard_map=shard_map,
    num_params=num_params, flops_per_token=flops_per_token, section=Qwen3VLMoeSection)
