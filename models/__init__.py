"""Decoder-only models (Llama 3, Qwen2, Qwen3 by config) on TP/SP/CP layers; HF import/export."""

from models.config import ModelConfig
from models.hf import export_hf, load_hf_model, load_hf_weights
from models.hf_config import config_from_hf, hf_config_dict
from models.transformer import Transformer, build_model

__all__ = [
    "ModelConfig",
    "Transformer",
    "build_model",
    "config_from_hf",
    "export_hf",
    "hf_config_dict",
    "load_hf_model",
    "load_hf_weights",
]
