"""GLM-4V / GLM-4.1V: config, vision tower, inputs, HF format, the model."""

from models.glm4v.config import (
    Glm4vConfig,
    Glm4vVisionConfig,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
    text_config,
    vision_from_hf,
)
from models.glm4v.hf import shard_map, vision_shard_map
from models.glm4v.tower import Glm4vVisionTower, build_vision_tower

__all__ = [
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
