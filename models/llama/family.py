"""The Llama 3 / Qwen2 / Qwen3 family: the shared decoder alone (variants are config fields)."""

from __future__ import annotations

from mpcore.models.common import counts
from mpcore.models.common.config import ModelConfig
from mpcore.models.common.decoder import build_model
from mpcore.models.common.decoder_hf import shard_map
from mpcore.models.common.family import Family
from mpcore.models.common.hf_config import SUPPORTED, config_from_hf, hf_config_dict
from mpcore.models.common.inputs import local_text_inputs
from mpcore.models.common.stage import build_stages
from mpcore.models.llama.hf import export_hf, load_hf_model


def config_from_dict(d: dict) -> ModelConfig:
    """``ModelConfig`` of ``dataclasses.asdict(cfg)`` (a checkpoint's meta.json)."""
    d = dict(d)
    if d.get("mrope_section") is not None:
        d["mrope_section"] = tuple(d["mrope_section"])
    return ModelConfig(**d)


def config_from_section(section, token_ids: dict | None) -> ModelConfig:
    """The decoder of our YAML model section (its shape fields); text data has no special ids."""
    del token_ids
    return ModelConfig(**section.shape_fields())


def _export(model, state, out_dir, progress=None) -> None:
    export_hf(model, model.cfg, state, out_dir, progress)


def _decoder(model):
    return model


FAMILY = Family(
    name="llama", config_type=ModelConfig, hf_architectures=tuple(SUPPORTED),
    hf_model_types=tuple(SUPPORTED.values()),
    config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build_model, load_hf=load_hf_model, export_hf=_export, shard_map=shard_map,
    local_inputs=local_text_inputs, num_params=counts.num_params,
    flops_per_token=counts.flops_per_token, decoder=_decoder,
    pipeline_stages=build_stages)

__all__ = ["FAMILY", "config_from_dict"]
