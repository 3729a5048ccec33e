"""Vision tower of Qwen2-VL and Qwen2.5-VL on tensor-parallel layers; HF config and weights."""

from models.vision.config import VisionConfig, hf_vision_config_dict, vision_config_from_hf
from models.vision.hf import (
    export_vision_weights,
    load_vision_tower,
    load_vision_weights,
    vision_hf_tensors,
    vision_shard_map,
)
from models.vision.plan import VisionPlan, plan_vision
from models.vision.tower import VisionTower, build_vision_tower

__all__ = [
    "VisionConfig",
    "VisionPlan",
    "VisionTower",
    "build_vision_tower",
    "export_vision_weights",
    "hf_vision_config_dict",
    "load_vision_tower",
    "load_vision_weights",
    "plan_vision",
    "vision_config_from_hf",
    "vision_hf_tensors",
    "vision_shard_map",
]
