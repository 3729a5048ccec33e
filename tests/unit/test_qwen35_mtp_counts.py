"""Parameter counts with the MTP block built equal the model's parameters (on the meta device),
for the four Qwen3.5 families: text, MoE (the MTP layer one more MoE layer), VL and VL-MoE;
and ``active`` drops the MTP layer's idle experts too."""

from __future__ import annotations

import pytest
import torch

from mpcore.models.common.hybrid import model as text_model
from mpcore.models.common.hybrid import moe_model, vl_model
from mpcore.models.qwen3_5_vl_moe.model import make_moe_model
from mpcore.models.registry import family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.hf_qwen3_vl_tiny import TOKENS
from tests.dist.hf_qwen35_vl_moe_tiny import TEXT_MOE
from tests.dist.hf_qwen35_vl_tiny import TEXT, TOWER
from tests.dist.qwen35_moe_tiny import CONFIG
from tests.dist.qwen35_tiny import HF_CONFIG

TEXT_ARCH = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}
MOE_ARCH = {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"]}
CASES = {
    "text": {**HF_CONFIG, **TEXT_ARCH},
    "moe": {**CONFIG, **MOE_ARCH},
    "vl": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": TEXT, "vision_config": TOWER, "tie_word_embeddings": False, **TOKENS},
    "vl_moe": {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "model_type": "qwen3_5_moe", "text_config": TEXT_MOE, "vision_config": TOWER,
               "tie_word_embeddings": False, **TOKENS},
}

MAKE = {"text": text_model.make_model, "moe": moe_model.make_model, "vl": vl_model.make_model,
        "vl_moe": make_moe_model}


@pytest.mark.parametrize("name", list(CASES))
def test_counts_with_mtp_equal_the_built_model(name):
    hf = CASES[name]
    if "text_config" in hf:
        hf = {**hf, "text_config": {**hf["text_config"], "mtp_num_hidden_layers": 1}}
    else:
        hf = {**hf, "mtp_num_hidden_layers": 1}
    family = family_of_hf(hf)
    plain = family.config_from_hf(hf)
    cfg = plain.with_mtp_weight(0.5)
    with torch.device("meta"):
        model = MAKE[name](cfg, ParallelState())
    total = sum(p.numel() for p in model.parameters())
    counts = family.num_params(cfg)
    assert counts["total"] == total, (counts, total)
    assert counts["total"] > family.num_params(plain)["total"]
    if "active" in counts:
        moe = cfg.text if hasattr(cfg, "text") else cfg
        idle = (moe.num_experts - moe.num_experts_per_tok) * 3 * moe.hidden_size * (
            moe.moe_intermediate_size)
        assert counts["total"] - counts["active"] == (moe.num_layers + 1) * idle
