"""Qwen3.5 vision-language (transformers ``Qwen3_5ForConditionalGeneration``): Qwen3-VL's tower
without DeepStack feeding the Qwen3.5 hybrid decoder (Gated DeltaNet beside gated attention)
with interleaved M-RoPE. The names below are the family's public surface (a registry entry)."""

from mpcore.models.common.hybrid.vl_config import (
    Qwen35VLConfig,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
)
from mpcore.models.common.hybrid.vl_hf import export_hf, load_hf_model, shard_map
from mpcore.models.common.hybrid.vl_model import Qwen35VLModel, build_model
from mpcore.models.qwen3_5_vl.family import FAMILY, config_from_section, flops_per_token, num_params

__all__ = [
    "FAMILY",
    "Qwen35VLConfig",
    "Qwen35VLModel",
    "build_model",
    "config_from_dict",
    "config_from_hf",
    "config_from_section",
    "export_hf",
    "flops_per_token",
    "hf_config_dict",
    "load_hf_model",
    "num_params",
    "shard_map",
]
