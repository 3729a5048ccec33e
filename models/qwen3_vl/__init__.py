"""Qwen3-VL (transformers ``models/qwen3_vl``): interleaved M-RoPE Qwen3 decoder, a vision
tower with a learned, resampled position grid, and DeepStack features added after the first
decoder layers. The names below are the family's whole public surface (a registry entry)."""

from mpcore.models.common.qwen3_vl.config import (
    Qwen3VisionConfig,
    Qwen3VLConfig,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
)
from mpcore.models.common.qwen3_vl.hf import export_hf, load_hf_model, load_hf_weights, shard_map
from mpcore.models.common.qwen3_vl.inputs import global_inputs, local_inputs, position_ids
from mpcore.models.common.qwen3_vl.model import (
    Qwen3VLModel,
    build_model,
    flops_per_token,
    num_params,
)
from mpcore.models.common.qwen3_vl.presets import config_from_section
from mpcore.models.common.qwen3_vl.vision import Qwen3VisionTower
from mpcore.models.qwen3_vl.family import FAMILY

__all__ = [
    "FAMILY",
    "Qwen3VLConfig",
    "Qwen3VLModel",
    "Qwen3VisionConfig",
    "Qwen3VisionTower",
    "build_model",
    "config_from_dict",
    "config_from_hf",
    "config_from_section",
    "export_hf",
    "flops_per_token",
    "global_inputs",
    "hf_config_dict",
    "load_hf_model",
    "load_hf_weights",
    "local_inputs",
    "num_params",
    "position_ids",
    "shard_map",
]
