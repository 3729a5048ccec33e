"""Config: YAML + dotted overrides, types, validation, closest-key suggestions, round trip; the
shipped configs; backend selection; LR schedule; parameter and FLOP counts."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from mpcore.backends import adam_backend, apex_fused_adam
from mpcore.config import ModelSection, load_config, model_section, save_config
from mpcore.kernels._triton import HAVE_TRITON
from mpcore.metrics import flops_per_token, num_params
from mpcore.models import ModelConfig, build_model
from mpcore.optim import lr_at
from mpcore.parallel.state import ParallelState

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


def test_model_section_is_the_family_section_plus_run_keys():
    """No mirror: the decoder keys are ModelConfig's fields (derived), each family's section
    adds its own nested sections (derived from its configs), mpcore adds only run-level keys."""
    from mpcore.models import FAMILIES
    from mpcore.models.common.moe_config import Qwen3MoeConfig
    from mpcore.models.common.section import DecoderSection
    from mpcore.models.qwen2_vl import VisionConfig

    run = {f.name for f in dataclasses.fields(ModelSection)}
    assert run == {"family", "init_from", "attention_backend", "linear_backend", "fp8",
                   "residual_dtype", "freeze_vision", "vision_cp", "gdn_kernel"}
    decoder = {f.name for f in dataclasses.fields(DecoderSection)}
    assert decoder == {f.name for f in dataclasses.fields(ModelConfig)}
    for name, family in FAMILIES.items():
        keys = {f.name for f in dataclasses.fields(model_section(name))}
        assert keys == run | decoder | set(family.section_extras), name
    cfg = load_config(CONFIGS / "vl_tiny.yaml")
    assert {f.name for f in dataclasses.fields(cfg.model.vision)} == {
        f.name for f in dataclasses.fields(VisionConfig)}
    moe = load_config(CONFIGS / "qwen3_moe_tiny.yaml").model.moe
    assert {f.name for f in dataclasses.fields(moe)} == {
        f.name for f in dataclasses.fields(Qwen3MoeConfig)} - decoder
    assert set(load_config(None).model.shape_fields()) == decoder


def test_every_model_key_of_every_family_has_a_docstring():
    """--help shows these docstrings: the reference docs of each key (derived ones included)."""
    import typing

    from mpcore.models import FAMILIES
    from mpcore.models.common.section import field_docs

    def undocumented(cls, prefix):
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not docs.get(f.name, "").strip():
                yield prefix + f.name
            nested = typing.get_args(hints[f.name])[:1]
            if nested and dataclasses.is_dataclass(nested[0]):
                yield from undocumented(nested[0], f"{prefix}{f.name}.")

    for name in FAMILIES:
        assert list(undocumented(model_section(name), "model.")) == [], name


@pytest.mark.parametrize("overrides, message", [
    (["model.hiden_size=3"], r"did you mean 'model.hidden_size'\? \(the llama family's model "
                             r"keys: family, init_from, .*vocab_size"),
    (["model.vision.num_head=2", "model.mrope_section=[4,6,6]"],
     r"'model.vision.num_head'; did you mean 'model.vision.num_heads'\? \(the qwen2_vl "
     r"family's model.vision keys: arch, depth"),
    (["model.family=qwen3_vl", "model.vision.arch=qwen2_vl", "model.mrope_section=[4,6,6]"],
     r"'model.vision.arch'.*it is a key of the qwen2_vl family's model.vision"),
    (["model.family=qwen3_moe", "model.moe.num_expert=2"],
     r"did you mean 'model.moe.num_experts'\? \(the qwen3_moe family's model.moe keys"),
    (["model.family=qwen3_5", "model.vision.depth=2"],
     r"model.vision is set but the qwen3_5 family takes none; set model.family to one of "
     r"\['qwen2_vl', 'qwen3_vl', 'glm4v', 'qwen3_5_vl', 'qwen3_vl_moe', 'qwen3_5_vl_moe'\]"),
])
def test_unknown_model_keys_per_family(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_family_sections_round_trip_and_take_every_override_form(tmp_path):
    for name in sorted(CONFIGS.glob("*.yaml")):
        cfg = load_config(name)
        save_config(cfg, tmp_path / "config.yaml")
        assert load_config(tmp_path / "config.yaml") == cfg, name
    cfg = load_config(CONFIGS / "vl_tiny.yaml", ["model.vision.depth=3",
                                                 "model.vision.fullatt_block_indexes=[]"])
    assert cfg.model.vision.depth == 3 and cfg.model.vision.fullatt_block_indexes == []
    cfg = load_config(None, ["model.moe.num_experts=4", "model.moe.mlp_only_layers=[0]"])
    assert (cfg.model.resolved_family, cfg.model.moe.num_experts) == ("qwen3_moe", 4)
    assert cfg.model.moe.mlp_only_layers == [0] and cfg.model.moe.num_experts_per_tok == 2
    old = tmp_path / "old.yaml"  # a run folder's config.yaml from before: others' keys null
    old.write_text("model:\n  vision: null\n  moe: null\n  hidden_size: 64\n")
    assert load_config(old).model == load_config(None, ["model.hidden_size=64"]).model


def test_kernel_choices_mirror_the_library():
    """config.py imports nothing of ours, so it spells the names out; they must agree."""
    from mpcore import config
    from mpcore.kernels.fp8_linear import RECIPES
    from mpcore.parallel.attention.backends import BACKENDS
    from mpcore.parallel.te import LINEAR_BACKENDS, TE_RECIPES

    assert config.ATTENTION_BACKENDS == BACKENDS and config.FP8_RECIPES == RECIPES + TE_RECIPES
    assert config.LINEAR_BACKENDS == LINEAR_BACKENDS
    from mpcore.models import FAMILIES

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
    from mpcore.models.qwen2_vl import FAMILY

    ids = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
               vision_end_token_id=151653)
    cfg = FAMILY.config_from_section(load_config(CONFIGS / "vl_2b.yaml").model, ids)
    import torch
    import transformers

    from mpcore.models import hf_vl_config_dict

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
        assert adam_backend("auto", "cuda") == ("triton" if HAVE_TRITON else "torch")
    assert adam_backend("triton", "cpu") == adam_backend("triton", "cuda") == "triton"
    with pytest.raises(ValueError, match="use torch, triton, apex or auto"):
        adam_backend("fused", "cuda")


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


def test_residual_dtype_choices():
    cfg = load_config(None, ["model.residual_dtype=autocast"])
    assert cfg.model.residual_dtype == "autocast"
    assert load_config(None, []).model.residual_dtype == "float32"
    with pytest.raises(ValueError, match=r"model.residual_dtype must be one of \['float32', "
                                         r"'autocast'\], got 'bf16'"):
        load_config(None, ["model.residual_dtype=bf16"])


@pytest.mark.parametrize("config", ["tiny.yaml", "qwen35_tiny.yaml"])
def test_residual_dtype_reaches_the_decoder(tmp_path, config):
    from mpcore.build import build, resolve_device, setup

    cfg = load_config(CONFIGS / config, [
        f"logging.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path}",
        "training.device=cpu", "model.residual_dtype=autocast"])
    run = build(cfg, setup(cfg), resolve_device(cfg))
    assert run.family.decoder(run.model).residual_dtype == "autocast"
