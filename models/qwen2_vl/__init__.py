"""Qwen2-VL / Qwen2.5-VL (``FAMILY``): the vision tower, its inputs and HF format, the model."""

from mpcore.models.common.vision_plan import VisionPlan, plan_vision
from mpcore.models.qwen2_vl.config import (
    VLConfig,
    hf_vl_config_dict,
    is_vl_config,
    vl_config_from_dict,
    vl_config_from_hf,
)
from mpcore.models.qwen2_vl.family import FAMILY
from mpcore.models.qwen2_vl.hf import (
    export_hf_vl,
    load_hf_vl_model,
    load_hf_vl_weights,
    vl_shard_map,
)
from mpcore.models.qwen2_vl.inputs import local_vl_inputs, vl_inputs
from mpcore.models.qwen2_vl.model import VLModel, build_vl_model
from mpcore.models.qwen2_vl.tower import VisionTower, build_vision_tower
from mpcore.models.qwen2_vl.vision_config import (
    VisionConfig,
    hf_vision_config_dict,
    vision_config_from_hf,
)
from mpcore.models.qwen2_vl.vision_hf import (
    export_vision_weights,
    load_vision_tower,
    load_vision_weights,
    vision_hf_tensors,
    vision_shard_map,
)

__all__ = [
    "FAMILY",
    "VLConfig",
    "VLModel",
    "VisionConfig",
    "VisionPlan",
    "VisionTower",
    "build_vision_tower",
    "build_vl_model",
    "export_hf_vl",
    "export_vision_weights",
    "hf_vision_config_dict",
    "hf_vl_config_dict",
    "is_vl_config",
    "load_hf_vl_model",
    "load_hf_vl_weights",
    "load_vision_tower",
    "load_vision_weights",
    "local_vl_inputs",
    "plan_vision",
    "vision_config_from_hf",
    "vision_hf_tensors",
    "vision_shard_map",
    "vl_config_from_dict",
    "vl_config_from_hf",
    "vl_inputs",
    "vl_shard_map",
]
