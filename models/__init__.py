"""Decoder-only models (Llama 3, Qwen2, Qwen3 by config) and vision-language models (Qwen2-VL,
Qwen2.5-VL) on TP/SP/CP layers; Hugging Face import/export."""

from models.config import ModelConfig
from models.hf import export_hf, load_hf_model, load_hf_weights
from models.hf_config import config_from_hf, hf_config_dict
from models.transformer import Transformer, build_model
from models.vision import VisionConfig, VisionTower
from models.vl import VLModel, build_vl_model
from models.vl_config import (
    VLConfig,
    hf_vl_config_dict,
    is_vl_config,
    vl_config_from_dict,
    vl_config_from_hf,
)
from models.vl_hf import export_hf_vl, load_hf_vl_model, load_hf_vl_weights
from models.vl_inputs import local_vl_inputs, vl_inputs

__all__ = [
    "ModelConfig",
    "Transformer",
    "VLConfig",
    "VLModel",
    "VisionConfig",
    "VisionTower",
    "build_model",
    "build_vl_model",
    "config_from_hf",
    "export_hf",
    "export_hf_vl",
    "hf_config_dict",
    "hf_vl_config_dict",
    "is_vl_config",
    "load_hf_model",
    "load_hf_vl_model",
    "load_hf_vl_weights",
    "load_hf_weights",
    "local_vl_inputs",
    "vl_config_from_dict",
    "vl_config_from_hf",
    "vl_inputs",
]
