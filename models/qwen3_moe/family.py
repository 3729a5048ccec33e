"""The Qwen3-MoE family: the shared decoder with MoE blocks (``mpcore.models.common.moe``)."""

from __future__ import annotations

import torch

from mpcore.models.common.family import Family
from mpcore.models.common.inputs import local_text_inputs
from mpcore.models.common.moe_config import (
    ARCH,
    MODEL_TYPE,
    Qwen3MoeConfig,
    Qwen3MoeSection,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
)
from mpcore.models.common.moe_decoder import Qwen3MoeTransformer, build_model
from mpcore.models.common.moe_decoder_hf import export_hf, load_hf_model, shard_map
from mpcore.models.common.moe_family import check_experts, with_moe_mask
from mpcore.models.common.moe_model import idle_expert_params
from mpcore.models.common.section import given
from mpcore.models.common.stage import build_stages
from mpcore.parallel.state import ParallelState


def config_from_section(section, token_ids: dict | None) -> Qwen3MoeConfig:
    """Our YAML model section's shape fields plus its ``moe`` mapping (``Qwen3MoeConfig``'s MoE
    fields); QK-norm always on."""
    del token_ids
    fields = dict(section.shape_fields())
    fields.update(qk_norm=True, **given(section.moe))
    try:
        return Qwen3MoeConfig(**fields)
    except TypeError as e:
        raise ValueError(f"model section: {e}; the MoE keys are mpcore.models.common.moe_config."
                         f"Qwen3MoeConfig's fields") from None


local_inputs = with_moe_mask(local_text_inputs)


def num_params(cfg: Qwen3MoeConfig) -> dict[str, int]:
    """``total``, ``embedding``, ``head`` and ``active`` (what one token's forward multiplies:
    k of the E experts) parameter counts (the module tree on the meta device, at tp = ep = 1)."""
    with torch.device("meta"):
        model = Qwen3MoeTransformer(cfg, ParallelState())
    total = sum(p.numel() for p in model.parameters())
    embedding = cfg.vocab_size * cfg.hidden_size
    return {"total": total, "embedding": embedding,
            "head": embedding, "active": total - idle_expert_params(cfg)}


def flops_per_token(cfg: Qwen3MoeConfig, seq_len: int) -> float:
    """``6 x`` the active matmul parameters (the embedding only when it is also the head) plus
    attention's ``12 * layers * q_size * seq_len`` (``mpcore.models.common.counts``)."""
    counts = num_params(cfg)
    dense = counts["active"] - (0 if cfg.tie_embeddings else counts["embedding"])
    return 6.0 * dense + 12.0 * cfg.num_layers * cfg.q_size * seq_len


def _decoder(model):
    return model


FAMILY = Family(
    name="qwen3_moe", config_type=Qwen3MoeConfig, hf_architectures=(ARCH,),
    hf_model_types=(MODEL_TYPE,), config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build_model, load_hf=load_hf_model, export_hf=export_hf, shard_map=shard_map,
    local_inputs=local_inputs, num_params=num_params, flops_per_token=flops_per_token,
    decoder=_decoder, section=Qwen3MoeSection, check_experts=check_experts,
    pipeline_stages=build_stages)

__all__ = ["FAMILY"]
