"""The family registry: lookups by name, by config.json and by config type; the run's family
from the YAML (auto rules, a family's own keys set for another, a checkpoint of another
family); every family's record is complete and its config type is its own."""

from __future__ import annotations

import json

import pytest

from mpcore.build import run_family
from mpcore.config import load_config
from mpcore.models import FAMILIES, ModelConfig, family_named, family_of, family_of_hf
from mpcore.models.common.family import MODALITIES


def test_lookup_by_name_names_the_closest():
    assert family_named("qwen3_vl").name == "qwen3_vl"
    with pytest.raises(ValueError, match="did you mean qwen3_vl"):
        family_named("qwen3-vl")


def test_lookup_by_config_json_and_type():
    assert family_of_hf({"architectures": ["Qwen3ForCausalLM"]}).name == "llama"
    assert family_of_hf({"architectures": ["Qwen3VLForConditionalGeneration"]}).name == "qwen3_vl"
    assert family_of_hf({"model_type": "qwen2_vl"}).name == "qwen2_vl"  # no architectures
    with pytest.raises(ValueError, match="unsupported architecture.*MistralForCausalLM"):
        family_of_hf({"architectures": ["MistralForCausalLM"]})
    cfg = ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=8)
    assert family_of(cfg).name == "llama"
    with pytest.raises(TypeError, match="no family's config"):
        family_of(object())


def test_every_record_is_whole_and_distinct():
    types, archs = set(), set()
    for name, family in FAMILIES.items():
        assert family.name == name and family.modality in MODALITIES
        assert family.config_type not in types  # family_of must be unambiguous
        types.add(family.config_type)
        assert not archs & set(family.hf_architectures), name
        archs |= set(family.hf_architectures)
        if family.modality == "image-text":
            assert "vision" in family.section_extras and family.host_inputs


VISION = ["model.vision.depth=1", "model.mrope_section=[4,6,6]"]  # head_dim 32


def test_run_family_auto_rules_and_refusals(tmp_path):
    assert run_family(load_config(None)).name == "llama"
    assert run_family(load_config(None, VISION)).name == "qwen2_vl"
    assert run_family(load_config(None, ["model.moe.num_experts=4"])).name == "qwen3_moe"
    with pytest.raises(ValueError, match="model.vision is set but the llama family takes none"):
        run_family(load_config(None, ["model.family=llama", *VISION]))
    assert run_family(load_config(None, [*VISION, "model.moe.num_experts=4"])).name == \
        "qwen3_vl_moe"  # the first family with both (qwen3_5_vl_moe by model.family)
    with pytest.raises(ValueError, match="model.moe is set but the qwen2_vl family"):
        run_family(load_config(None, ["model.family=qwen2_vl", *VISION,
                                      "model.moe.num_experts=4"]))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert run_family(load_config(None, [f"model.init_from={hf}"])).name == "llama"
    with pytest.raises(ValueError, match="model.family=qwen3_vl but model.init_from=.* is a "
                                         "llama checkpoint"):
        run_family(load_config(None, [f"model.init_from={hf}", "model.family=qwen3_vl"]))
