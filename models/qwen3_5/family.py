"""The Qwen3.5 text family: hybrid Gated DeltaNet / gated attention decoder (``mpcore.models.qwen3_5``).

It owns ``Qwen3_5ForCausalLM``; the released ``Qwen3_5ForConditionalGeneration`` checkpoints
belong to the vision-language family (``mpcore.models.qwen3_5_vl``), whose decoder is this one."""

from __future__ import annotations

from mpcore.models.common.family import Family
from mpcore.models.common.hybrid import counts
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.hybrid.hf import (
    ARCHITECTURES,
    config_from_hf,
    export_hf,
    full_map,
    hf_config_dict,
    load_hf,
)
from mpcore.models.common.hybrid.model import build
from mpcore.models.common.hybrid.mtp import local_inputs
from mpcore.models.common.hybrid.section import (
    Qwen35Section,
    config_from_dict,
    config_from_section,
)
from mpcore.models.common.stage import build_stages

TEXT_ARCH = "Qwen3_5ForCausalLM"


def _decoder(model):
    return model


FAMILY = Family(
    name="qwen3_5", config_type=Qwen35Config, hf_architectures=(TEXT_ARCH,),
    hf_model_types=(ARCHITECTURES[TEXT_ARCH],),
    config_from_hf=config_from_hf, hf_config_dict=hf_config_dict,
    config_from_dict=config_from_dict, config_from_section=config_from_section,
    build=build, load_hf=load_hf, export_hf=export_hf, shard_map=full_map,
    local_inputs=local_inputs, num_params=counts.num_params,
    flops_per_token=counts.flops_per_token, decoder=_decoder, section=Qwen35Section,
    options=("gdn_kernel",), pipeline_stages=build_stages,
    hf_skipped=("mtp.*",))  # multi-token prediction: read only when trained (mtp_loss_weight)

__all__ = ["FAMILY", "config_from_dict", "config_from_section"]
