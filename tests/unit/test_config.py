"""Config: YAML + dotted overrides, types, validation, closest-key suggestions, round trip; the
shipped configs; backend selection; LR schedule; parameter and FLOP counts."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from models import ModelConfig, build_model
from mpcore.backends import adam_backend, apex_fused_adam
from mpcore.config import ModelSection, load_config, save_config
from mpcore.metrics import flops_per_token, num_params
from mpcore.optim import lr_at
from parallel.state import ParallelState

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"


def test_overrides_parse_to_field_types():
    cfg = load_config(CONFIGS / "tiny.yaml", [
        "optimizer.lr=1e-3", "training.max_steps=7", "parallel.sequence_parallel=true",
        "data.paths=[a, b]", "data.weights=1,3", "data.tokenizer=t.model", "model.head_dim=16",
        "schedule.total_steps=null", "model.rope_scaling.factor=8", "optimizer.betas=[0.8,0.9]"])
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.training.max_steps == 7 and cfg.parallel.sequence_parallel is True
    assert cfg.data.paths == ["a", "b"] and cfg.data.weights == [1.0, 3.0]
    assert cfg.model.head_dim == 16 and cfg.schedule.total_steps is None
    assert cfg.model.rope_scaling == {"factor": 8} and cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.total_steps == 7


@pytest.mark.parametrize("override, suggestion", [
    ("optimizer.lrr=1", "optimizer.lr"), ("optimiser.lr=1", "optimizer.lr"),
    ("lr=1", "optimizer.lr"), ("training.max_step=3", "training.max_steps"),
    ("data.micro_batch_size=2", "data.micro_batch"), ("parallel.tp_size=2", "parallel.tp")])
def test_unknown_key_names_the_closest(override, suggestion):
    with pytest.raises(ValueError, match=f"did you mean '{suggestion}'"):
        load_config(None, [override])


def test_unknown_key_in_yaml_and_bad_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  learning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"optimizer.learning_rate.*c\.yaml"):
        load_config(path)
    with pytest.raises(ValueError, match="training.max_steps='abc' is not a valid int"):
        load_config(None, ["training.max_steps=abc"])
    with pytest.raises(ValueError, match=r"parallel.cp_mode must be one of \['ring', 'ulysses'\]"):
        load_config(None, ["parallel.cp_mode=rign"])
    with pytest.raises(ValueError, match="data.weights has 1 entries but data.paths has 2"):
        load_config(None, ["data.paths=[a,b]", "data.weights=[1]", "data.tokenizer=t"])
    with pytest.raises(ValueError, match="set data.tokenizer"):
        load_config(None, ["data.paths=[a]"])
    with pytest.raises(ValueError, match="not key=value"):
        load_config(None, ["optimizer.lr"])
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "llama3_1b.yaml", ["optimizer.lr=2e-4", "data.paths=[x]",
                                                   "data.tokenizer=t.model"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_model_section_mirrors_model_config():
    kernels = {"init_from", "family", "attention_backend", "fp8", "linear_backend", "vision",
               "freeze_vision", "vision_cp", "moe"}
    ours = {f.name for f in dataclasses.fields(ModelSection)} - kernels
    assert ours == {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(ModelSection().shape_fields()) == ours


def test_kernel_choices_mirror_the_library():
    """config.py imports nothing of ours, so it spells the names out; they must agree."""
    from kernels.fp8_linear import RECIPES
    from mpcore import config
    from parallel.attention.backends import BACKENDS
    from parallel.te import LINEAR_BACKENDS, TE_RECIPES

    assert config.ATTENTION_BACKENDS == BACKENDS and config.FP8_RECIPES == RECIPES + TE_RECIPES
    assert config.LINEAR_BACKENDS == LINEAR_BACKENDS
    from models import FAMILIES

    assert config.FAMILIES == tuple(FAMILIES)
    cfg = load_config(None, ["model.attention_backend=sdpa_cudnn", "model.fp8=tensorwise"])
    assert (cfg.model.attention_backend, cfg.model.fp8) == ("sdpa_cudnn", "tensorwise")
    with pytest.raises(ValueError, match="attention_backend"):
        load_config(None, ["model.attention_backend=cudnn_ragged"])
    with pytest.raises(ValueError, match="model.fp8"):
        load_config(None, ["model.fp8=delayed"])


def test_shipped_shapes():
    llama = ModelConfig(**load_config(CONFIGS / "llama3_1b.yaml").model.shape_fields())
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads,
            llama.intermediate_size, llama.vocab_size) == (2048, 16, 32, 8, 8192, 128256)
    assert llama.tie_embeddings and llama.rope_theta == 500000 and llama.rope_scaling["factor"] == 32
    assert num_params(llama)["total"] == 1_235_814_400  # Llama-3.2-1B's published count
    qwen = ModelConfig(**load_config(CONFIGS / "qwen3_0_6b.yaml").model.shape_fields())
    assert qwen.qk_norm and qwen.head_dim == 128
    assert num_params(qwen)["total"] == 596_049_920  # Qwen3-0.6B's published count
    tiny = load_config(CONFIGS / "tiny.yaml")
    assert tiny == load_config(None)  # tiny.yaml spells out the defaults



def test_shipped_vl_shape_matches_qwen2_vl_2b():
    from models.qwen2_vl import FAMILY

    ids = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
               vision_end_token_id=151653)
    cfg = FAMILY.config_from_section(load_config(CONFIGS / "vl_2b.yaml").model, ids)
    import torch
    import transformers

    from models import hf_vl_config_dict

    with torch.device("meta"):  # transformers' own model of this config, counted without memory
        hf = transformers.Qwen2VLForConditionalGeneration(
            transformers.Qwen2VLConfig(**hf_vl_config_dict(cfg)))
    counts = num_params(cfg)
    assert counts["total"] == sum(p.numel() for p in hf.parameters()) == 2_208_985_600
    assert counts["vision"] == sum(p.numel() for p in hf.model.visual.parameters())
    assert cfg.text.mrope_section == (16, 24, 24) and cfg.vision.depth == 32


@pytest.mark.parametrize("tie, bias, qk_norm", [(True, False, False), (False, True, False),
                                                (False, False, True)])
def test_param_count_and_flops_match_the_model(tie, bias, qk_norm):
    cfg = ModelConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=48, tie_embeddings=tie, qkv_bias=bias, qk_norm=qk_norm)
    model = build_model(cfg, ParallelState())
    counts = num_params(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    dense = counts["total"] - (0 if tie else embedding)
    assert flops_per_token(cfg, 128) == 6 * dense + 12 * 2 * 4 * 8 * 128


def test_backends():
    assert adam_backend("torch", "cpu") == "torch"
    assert adam_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="needs CUDA"):
        adam_backend("apex", "cpu")
    if apex_fused_adam() is None:
        with pytest.raises(ValueError, match="github.com/NVIDIA/apex"):
            adam_backend("apex", "cuda")
        assert adam_backend("auto", "cuda") == "torch"


def test_lr_schedule():
    cfg = load_config(None, ["optimizer.lr=1.0", "schedule.warmup_steps=10",
                             "training.max_steps=110", "schedule.min_lr_ratio=0.1"])
    assert lr_at(5, cfg) == 0.5 and lr_at(10, cfg) == 1.0
    assert math.isclose(lr_at(60, cfg), 0.1 + 0.9 * 0.5)  # cosine midpoint
    assert math.isclose(lr_at(110, cfg), 0.1) and math.isclose(lr_at(500, cfg), 0.1)
    linear = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, decay="linear"))
    assert math.isclose(lr_at(35, linear), 0.1 + 0.9 * 0.75)
    short = load_config(None, ["optimizer.lr=1.0", "training.max_steps=4"])  # warmup 20 > 4
    assert [lr_at(s, short) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
