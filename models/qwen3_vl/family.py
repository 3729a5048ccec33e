"""The Qwen3-VL family: interleaved M-RoPE Qwen3 decoder, a tower with DeepStack features."""

from __future__ import annotations

from mpcore.models.common.family import Family
from mpcore.models.common.qwen3_vl.config import (
    ARCH,
    MODEL_TYPE,
    Qwen3VLConfig,
    Qwen3VLSection,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
)
from mpcore.models.common.qwen3_vl.hf import export_hf, load_hf_model, shard_map
from mpcore.models.common.qwen3_vl.inputs import local_inputs
from mpcore.models.common.qwen3_vl.model import build_model, flops_per_token, num_params
from mpcore.models.common.qwen3_vl.presets import config_from_section as _from_fields
from mpcore.models.common.qwen3_vl.processing import IMAGE_PROCESSING
from mpcore.models.common.section import given
from mpcore.models.common.stage import build_vl_stages


def config_from_section(section, token_ids: dict | None) -> Qwen3VLConfig:
    """The ``Qwen3VLConfig`` of our YAML model section: the decoder's shape fields (with
    ``qk_norm`` and ``mrope_interleaved`` true, as the family needs) and ``vision`` (the
    ``Qwen3VisionConfig`` fields), with the data tokenizer's four special ids."""
    if token_ids is None:
        raise ValueError("a VL model from scratch takes its token ids from the data's tokenizer")
    return _from_fields({**section.shape_fields(), "vision": given(section.vision)}, token_ids)


FAMILY = Family(
    name="qwen3_vl", config_type=Qwen3VLConfig, hf_architectures=(ARCH,),
    hf_model_types=(MODEL_TYPE,), config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build_model, load_hf=load_hf_model, export_hf=export_hf, shard_map=shard_map,
    local_inputs=local_inputs, num_params=num_params, flops_per_token=flops_per_token,
    decoder=lambda model: model.text, vision=lambda model: model.visual,
    placeholder_ids=lambda cfg: cfg.placeholder_ids, modality="image-text",
    options=("vision_cp",), host_inputs=("grid_thw",),
    section=Qwen3VLSection, image_processing=IMAGE_PROCESSING, pipeline_stages=build_vl_stages)
