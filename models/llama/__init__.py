"""Llama 3 / Qwen2 / Qwen3 causal LMs (``FAMILY``): the shared decoder and its HF format."""

from mpcore.models.common.hf_config import config_from_hf, hf_config_dict
from mpcore.models.llama.family import FAMILY
from mpcore.models.llama.hf import export_hf, load_hf_model, load_hf_weights

__all__ = ["FAMILY", "config_from_hf", "export_hf", "hf_config_dict", "load_hf_model",
           "load_hf_weights"]
