"""The Qwen3.5 text family: hybrid Gated DeltaNet / gated attention decoder (``models.qwen3_5``)."""

from __future__ import annotations

from models.common.family import Family
from models.common.inputs import local_text_inputs
from models.qwen3_5 import counts
from models.qwen3_5.config import Qwen35Config
from models.qwen3_5.hf import (
    ARCHITECTURES,
    config_from_hf,
    export_hf,
    hf_config_dict,
    load_hf,
    shard_map,
)
from models.qwen3_5.model import build


def config_from_dict(d: dict) -> Qwen35Config:
    """``Qwen35Config`` of ``dataclasses.asdict(cfg)`` (a checkpoint's meta.json)."""
    d = dict(d)
    if d.get("layer_types") is not None:
        d["layer_types"] = tuple(d["layer_types"])
    return Qwen35Config(**d)


def config_from_section(section, token_ids: dict | None) -> Qwen35Config:
    """The decoder of our YAML model section. The section has no DeltaNet fields (the family
    keeps the shared ``DecoderSection``), so they follow from the shape fields: ``num_heads``
    value heads and ``num_heads / 2`` key heads of ``head_dim``, the conv of 4 taps, every
    4th layer full attention, a quarter of each head rotated. For other shapes start from a HF checkpoint (``model.init_from``)."""
    del token_ids
    fields = section.shape_fields()
    for key, why in (("qkv_bias", "attention biases"), ("rope_scaling", "RoPE scaling"),
                     ("mrope_section", "M-RoPE sections")):
        if fields.pop(key):
            raise ValueError(f"model.{key} is set but the qwen3_5 family has no {why}; "
                             f"remove it")
    cfg = Qwen35Config(**fields)
    return Qwen35Config(**{**fields, "linear_num_key_heads": max(1, cfg.num_heads // 2),
                           "linear_num_value_heads": cfg.num_heads,
                           "linear_key_head_dim": cfg.head_dim,
                           "linear_value_head_dim": cfg.head_dim})


def _decoder(model):
    return model


FAMILY = Family(
    name="qwen3_5", config_type=Qwen35Config, hf_architectures=tuple(ARCHITECTURES),
    hf_model_types=tuple(ARCHITECTURES.values()),
    config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build, load_hf=load_hf, export_hf=export_hf, shard_map=shard_map,
    local_inputs=local_text_inputs, num_params=counts.num_params,
    flops_per_token=counts.flops_per_token, decoder=_decoder)

__all__ = ["FAMILY", "config_from_dict", "config_from_section"]
