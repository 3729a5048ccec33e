"""GLM-4V / GLM-4.1V: config, vision tower, inputs, HF format, the model."""

from mpcore.models.glm4v.config import (
    Glm4vConfig,
    Glm4vVisionConfig,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
    text_config,
    vision_from_hf,
)
from mpcore.models.glm4v.family import FAMILY
from mpcore.models.glm4v.hf import export_hf, load_hf_weights, shard_map, vision_shard_map
from mpcore.models.glm4v.inputs import (
    glm4v_inputs,
    local_glm4v_inputs,
    mm_token_types,
    position_ids,
)
from mpcore.models.glm4v.model import Glm4vDecoderLayer, Glm4vModel, build_model, load_hf_model
from mpcore.models.glm4v.processor import resize_size
from mpcore.models.glm4v.tower import Glm4vVisionTower, build_vision_tower

__all__ = [
    "FAMILY",
    "Glm4vDecoderLayer",
    "Glm4vModel",
    "build_model",
    "export_hf",
    "glm4v_inputs",
    "load_hf_model",
    "load_hf_weights",
    "local_glm4v_inputs",
    "mm_token_types",
    "position_ids",
    "resize_size",
    "Glm4vConfig",
    "Glm4vVisionConfig",
    "Glm4vVisionTower",
    "build_vision_tower",
    "config_from_dict",
    "config_from_hf",
    "hf_config_dict",
    "shard_map",
    "text_config",
    "vision_from_hf",
    "vision_shard_map",
]
