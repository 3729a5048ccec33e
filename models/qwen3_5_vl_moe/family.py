"""The Qwen3.5-MoE vision-language family: the Qwen3.5 VL model (tower without DeepStack,
Qwen3-VL's position rule) over the Qwen3.5-MoE decoder.

Counts: the Qwen3.5-MoE decoder's (``mpcore.models.common.hybrid.moe_counts.num_params``) plus the tower
(``vision``, in ``total`` and ``active``). FLOPs per token: the decoder's over its active
weights; the tower's work depends on each batch's visual share and is left out, as for the
other VL families.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpcore.models.common.hybrid import moe_counts
from mpcore.models.common.hybrid.moe_config import Qwen35MoeExpertsSection, with_experts
from mpcore.models.common.hybrid.vl_counts import tower_params
from mpcore.models.common.moe_family import moe_variant
from mpcore.models.common.qwen3_vl.config import TOKEN_KEYS
from mpcore.models.common.section import given
from mpcore.models.qwen3_5_vl.family import FAMILY as QWEN3_5_VL
from mpcore.models.qwen3_5_vl_moe.config import (
    ARCH,
    MODEL_TYPE,
    Qwen35VLMoeConfig,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
)
from mpcore.models.qwen3_5_vl_moe.hf import export_hf, load_hf_model, shard_map
from mpcore.models.qwen3_5_vl_moe.model import build_model

NAME = "qwen3_5_vl_moe"


@dataclass(frozen=True)
class Qwen35VLMoeSection(QWEN3_5_VL.section):
    """Our YAML model section of the qwen3_5_vl_moe family: the qwen3_5_vl family's keys
    (``intermediate_size``: the shared expert's width) and ``moe``."""

    moe: Qwen35MoeExpertsSection | None = None
    """The experts from scratch: num_experts, num_experts_per_tok, moe_intermediate_size,
    router_aux_loss_coef, router_z_loss_coef (top-k always renormalised, every layer sparse).
    Null: their defaults."""


def config_from_section(section, token_ids: dict | None) -> Qwen35VLMoeConfig:
    """The qwen3_5_vl family's config of the section (decoder fields, ``mrope_section``,
    ``vision``, the tokenizer's ids) with every feed-forward a MoE block of ``moe``
    (``Qwen35MoeConfig``'s MoE fields)."""
    dense = QWEN3_5_VL.config_from_section(section, token_ids, NAME)
    return Qwen35VLMoeConfig(text=with_experts(dense.text, given(section.moe)),
                             vision=dense.vision, **{k: getattr(dense, k) for k in TOKEN_KEYS})


def num_params(cfg: Qwen35VLMoeConfig) -> dict[str, int]:
    """Logical counts (module docstring): ``total``, ``embedding``, ``head``, ``active`` and
    ``vision``."""
    text, vision = moe_counts.num_params(cfg.text), tower_params(cfg)
    return {**text, "total": text["total"] + vision, "active": text["active"] + vision,
            "vision": vision}


def flops_per_token(cfg: Qwen35VLMoeConfig, seq_len: int) -> float:
    """The decoder's training FLOPs per token over its active weights (module docstring)."""
    return moe_counts.flops_per_token(cfg.text, seq_len)


FAMILY = moe_variant(
    QWEN3_5_VL, name=NAME, config_type=Qwen35VLMoeConfig, hf_architectures=(ARCH,),
    hf_model_types=(MODEL_TYPE,), config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build_model, load_hf=load_hf_model, export_hf=export_hf, shard_map=shard_map,
    num_params=num_params, flops_per_token=flops_per_token, section=Qwen35VLMoeSection)
