"""The Qwen3.5-MoE family through the training path (mpcore asks the registry):

- launch/configs/qwen35_moe_tiny.yaml resolves to a hybrid Qwen35MoeConfig (meta.json round
  trip included), and a model section that names the wrong family is refused;
- it trains (cut to a few steps): the loss falls, every logged row carries the step's global
  router statistics (aux loss, tokens per expert, no dropped token), and a resumed run is
  bit-identical (checkpoint of the MoE model at ep = 1).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from mpcore.build import run_family
from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.models.common.hybrid.moe_hf import hf_config_dict
from mpcore.models.qwen3_5_moe import FAMILY, Qwen35MoeConfig
from tests.unit.test_moe_train import trains_and_resumes_bit_identically

YAML = Path(__file__).resolve().parents[2] / "launch" / "configs" / "qwen35_moe_tiny.yaml"


def test_shipped_tiny_yaml_is_a_hybrid_moe_and_wrong_families_are_refused(tmp_path):
    cfg = load_config(YAML)
    assert run_family(cfg) is FAMILY
    model_cfg = FAMILY.config_from_section(cfg.model, None)
    assert isinstance(model_cfg, Qwen35MoeConfig)
    assert model_cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (model_cfg.num_experts, model_cfg.num_experts_per_tok) == (8, 2)
    assert model_cfg.intermediate_size == 128 and model_cfg.norm_topk_prob
    assert FAMILY.config_from_dict(json.loads(json.dumps(dataclasses.asdict(model_cfg)))) \
        == model_cfg
    with pytest.raises(ValueError, match="model.moe is set but the qwen3_5 family takes none"):
        run_family(load_config(YAML, ["model.family=qwen3_5"]))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(model_cfg)))
    with pytest.raises(ValueError, match="is a qwen3_5_moe checkpoint; set model.family="
                                         "qwen3_5_moe"):
        run_family(load_config(None, ["model.family=qwen3_5", f"model.init_from={tmp_path}"]))
    with pytest.raises(ValueError, match=r"unknown config key 'model.moe.top_k' \(the "
                                         r"qwen3_5_moe family's model.moe keys: num_experts"):
        FAMILY.config_from_section(load_config(YAML, ["model.moe.top_k=2"]).model, None)


@pytest.mark.slow
def test_tiny_yaml_trains_and_resumes_bit_identically(tmp_path):
    prepare_default(tmp_path / "data", 512)
    common = [f"data.cache_dir={tmp_path / 'data'}", "data.default_vocab_size=512",
              "model.vocab_size=512", "data.seq_len=64", "training.device=cpu",
              "training.dtype=float32", "schedule.warmup_steps=2", "schedule.total_steps=6",
              "logging.log_every=100"]
    for row in trains_and_resumes_bit_identically(YAML, tmp_path, common, 6):
        load = row["expert_load"]
        assert len(load) == 8 and sum(load) > 0 and row["dropped_tokens"] == 0
        assert row["aux_loss"] > 0 and math.isfinite(row["z_loss"])
