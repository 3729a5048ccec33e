"""The Qwen3.5 vision-language family: Qwen3-VL's tower without DeepStack, the Qwen3.5 hybrid
decoder with interleaved M-RoPE, Qwen3-VL's position rule (``mpcore.models.common.qwen3_vl.inputs``)."""

from __future__ import annotations

from dataclasses import dataclass

from mpcore.models.common.family import Family
from mpcore.models.common.hybrid.section import decoder_from_fields
from mpcore.models.common.hybrid.vl_config import (
    ARCH,
    MODEL_TYPE,
    Qwen35VLConfig,
    config_from_dict,
    config_from_hf,
    hf_config_dict,
)
from mpcore.models.common.hybrid.vl_counts import flops_per_token, num_params
from mpcore.models.common.hybrid.vl_hf import export_hf, load_hf_model, shard_map
from mpcore.models.common.hybrid.vl_model import build_model
from mpcore.models.common.qwen3_vl.config import Qwen3VisionSection
from mpcore.models.common.qwen3_vl.inputs import local_inputs
from mpcore.models.common.qwen3_vl.presets import vision_from_section
from mpcore.models.common.qwen3_vl.processing import IMAGE_PROCESSING
from mpcore.models.common.section import VLSection, given
from mpcore.models.common.stage import build_vl_stages

NAME = "qwen3_5_vl"


@dataclass(frozen=True)
class Qwen35VLSection(VLSection):
    """Our YAML model section of the qwen3_5_vl family: the decoder's keys (the DeltaNet heads
    follow from them, as for qwen3_5; ``mrope_section`` over the rotated quarter of each head)
    and ``vision``."""

    vision: Qwen3VisionSection | None = None
    """The tower trained from scratch: ``Qwen3VisionConfig``'s fields (depth, hidden_size,
    num_heads, intermediate_size, num_position_embeddings, ...; no DeepStack;
    out_hidden_size defaults to hidden_size); needs mrope_section."""
    mtp_num_hidden_layers: int = 0
    """Multi-token-prediction layers of a model from scratch (1: the release's one; a
    checkpoint brings its own, config.json's ``mtp_num_hidden_layers``)."""
    mtp_loss_weight: float = 0.0
    """Weight of the MTP loss (``mpcore.models.common.hybrid.mtp``): total = main + weight *
    mtp; 0: the block is neither built nor run."""


def config_from_section(section, token_ids: dict | None, name: str = NAME) -> Qwen35VLConfig:
    """The ``Qwen35VLConfig`` of our YAML model section: the decoder as the qwen3_5 family
    derives it from the shape fields (``mpcore.models.common.hybrid.section.config_from_section``) with the
    section's ``mrope_section`` (interleaved, summing to ``rotary_dim / 2``: a quarter of each
    head is rotated, so ``head_dim / 8``), ``vision`` (``Qwen3VisionConfig`` fields, no
    DeepStack), and the data tokenizer's four special ids; ``name``: the family the errors
    name."""
    if token_ids is None:
        raise ValueError("a VL model from scratch takes its token ids from the data's tokenizer")
    if section.vision is None or section.mrope_section is None:
        raise ValueError(f"model.family={name} from scratch needs model.vision (the tower's "
                         f"fields) and model.mrope_section (summing to head_dim / 8, the pairs "
                         "of the rotated quarter: e.g. [2, 1, 1] for head_dim 32); or set "
                         "model.init_from")
    mtp = {k: getattr(section, k) for k in ("mtp_num_hidden_layers", "mtp_loss_weight")}
    text = decoder_from_fields({**section.shape_fields(), **mtp}, name, mrope=True)
    return Qwen35VLConfig(text=text, vision=vision_from_section(given(section.vision),
                                                                text.hidden_size),
                          **token_ids)


FAMILY = Family(
    name=NAME, config_type=Qwen35VLConfig, hf_architectures=(ARCH,),
    hf_model_types=(MODEL_TYPE,), config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build_model, load_hf=load_hf_model, export_hf=export_hf, shard_map=shard_map,
    local_inputs=local_inputs, num_params=num_params, flops_per_token=flops_per_token,
    decoder=lambda model: model.text, vision=lambda model: model.visual,
    placeholder_ids=lambda cfg: cfg.placeholder_ids, modality="image-text",
    options=("vision_cp", "gdn_kernel"), host_inputs=("grid_thw",),
    section=Qwen35VLSection, image_processing=IMAGE_PROCESSING,
    hf_skipped=("mtp.*",),  # multi-token prediction: read only when trained (mtp_loss_weight)
    pipeline_stages=build_vl_stages)
