"""Single-process model checks: config validation, HF config reading, RoPE frequencies against
transformers, checkpoint errors (shape mismatch, missing tensor), sharded checkpoints, bad inputs.

Numerical parity with transformers at every parallel layout is in tests/dist/test_models_dist.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from mpcore.models import ModelConfig, build_model, config_from_hf, hf_config_dict, load_hf_model
from mpcore.models.common.rope import inverse_frequencies
from mpcore.parallel.state import ParallelState

SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
TINY = dict(vocab_size=53, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=48)


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**TINY, **kw})


@pytest.fixture
def llama_dir(tmp_path):
    torch.manual_seed(3)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=53, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, tie_word_embeddings=False))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", hf


def test_config_defaults_and_validation():
    assert _cfg().head_dim == 8 and _cfg(head_dim=16).q_size == 64
    bad = [dict(num_kv_heads=3), dict(head_dim=7), dict(vocab_size=0), dict(num_layers=True),
           dict(rope_theta=0.0), dict(rms_norm_eps=-1.0), dict(rope_scaling={"factor": 8.0}),
           dict(rope_scaling={**SCALING, "high_freq_factor": 0.5}), dict(hidden_size=30)]
    for kw in bad:
        with pytest.raises(ValueError):
            _cfg(**kw)


@pytest.mark.parametrize("tp, kw, match", [
    (3, {}, "num_heads 4 is not divisible by tp 3"),
    (4, dict(num_kv_heads=4, num_heads=8, intermediate_size=50), "intermediate_size 50"),
    (2, dict(num_heads=6, num_kv_heads=3, head_dim=8), "neither divides the other"),
])
def test_parallel_mismatch_raises_before_building(tp, kw, match):
    with pytest.raises(ValueError, match=match):
        build_model(_cfg(**kw), ParallelState(tp=tp))


def test_parallel_checks_kv_replication_and_ulysses():
    _cfg(num_kv_heads=1).check_parallel(4)  # kv heads replicated: allowed
    _cfg(num_kv_heads=4).check_parallel(2)  # kv heads sharded
    with pytest.raises(ValueError, match="Ulysses"):
        _cfg().check_parallel(2, cp=4, cp_mode="ulysses")
    with pytest.raises(ValueError, match="cp_mode 'ring' or 'ulysses'"):
        build_model(_cfg(), ParallelState(cp=2))


@pytest.mark.parametrize("scaling", [None, SCALING])
def test_inverse_frequencies_match_transformers(scaling):
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if scaling:
        rope = {**rope, **scaling, "rope_type": "llama3"}
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=256, num_attention_heads=2,
                                          rope_parameters=rope))
    ours = inverse_frequencies(128, 500000.0, scaling)
    assert ours.shape == hf.inv_freq.shape
    torch.testing.assert_close(ours, hf.inv_freq, rtol=1e-6, atol=0)
    if scaling:  # the scaling really changes low frequencies
        assert not torch.allclose(ours, inverse_frequencies(128, 500000.0, None))


def test_hf_config_formats_and_variants(llama_dir):
    folder, _ = llama_dir
    hf = json.loads((folder / "config.json").read_text())
    cfg = config_from_hf(folder)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.qkv_bias, cfg.qk_norm) == (2, 2, False, False)
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    legacy.update(rope_theta=5e5, rope_scaling={**SCALING, "type": "llama3"})
    assert config_from_hf(legacy).rope_scaling == SCALING
    assert config_from_hf(legacy).rope_theta == 5e5
    qwen3 = {**hf, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16,
             "tie_word_embeddings": True}
    cfg3 = config_from_hf(qwen3)
    assert cfg3.qk_norm and cfg3.tie_embeddings and cfg3.head_dim == 16 and not cfg3.qkv_bias
    assert config_from_hf({**hf, "architectures": ["Qwen2ForCausalLM"]}).qkv_bias
    assert config_from_hf(hf_config_dict(cfg3)) == cfg3  # export config reads back
    assert config_from_hf(hf_config_dict(config_from_hf(legacy))) == config_from_hf(legacy)


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM.*supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "sliding"),
])
def test_hf_config_unsupported(llama_dir, change, match):
    hf = json.loads((llama_dir[0] / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        config_from_hf({**hf, **change})


def test_export_config_refuses_unrepresentable():
    with pytest.raises(ValueError, match="qk_norm with qkv_bias"):
        hf_config_dict(_cfg(qk_norm=True, qkv_bias=True))


def test_checkpoint_shape_mismatch_and_missing_tensor(llama_dir, tmp_path):
    folder, _ = llama_dir
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ValueError, match=r"gate_proj.weight has shape \(48, 32\).*\(64, 32\)"):
        load_hf_model(folder, ParallelState())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 60}))
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \(53, 32\).*\(60, 32\)"):
        load_hf_model(folder, ParallelState())
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.v_proj.weight is missing"):
        load_hf_model(folder, ParallelState())


def test_sharded_checkpoint_and_logits(llama_dir, tmp_path):
    folder, hf = llama_dir
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one, _ = load_hf_model(folder, ParallelState())
    many, _ = load_hf_model(tmp_path / "sharded", ParallelState())
    for (name, a), (_, b) in zip(one.named_parameters(), many.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 53, (11,))
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6])
    with torch.no_grad():
        ours = one(ids, positions, cu_seqlens=cu, output="logits")
        ref = torch.cat([hf(ids[None, :4]).logits[0], hf(ids[None, 4:]).logits[0]])
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_bad_inputs_raise_before_compute(llama_dir):
    model, _ = load_hf_model(llama_dir[0], ParallelState())
    cu = torch.tensor([0, 6], dtype=torch.int32)
    ids, pos = torch.randint(0, 53, (6,)), torch.arange(6)
    with pytest.raises(ValueError, match="outside the vocab"):
        model(torch.tensor([1, 2, 53, 4, 5, 6]), pos, cu_seqlens=cu)
    with pytest.raises(ValueError, match="labels has shape"):
        model(ids, pos, cu_seqlens=cu, labels=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids has shape"):
        model(ids, torch.arange(5), cu_seqlens=cu, labels=ids)
    with pytest.raises(ValueError, match="needs labels"):
        model(ids, pos, cu_seqlens=cu)
    with pytest.raises(ValueError, match="output must be one of"):
        model(ids, pos, cu_seqlens=cu, labels=ids, output="probs")


def test_build_model_deterministic_and_checkpointing_same_grads():
    cfg = _cfg(qkv_bias=True, qk_norm=True, tie_embeddings=True)
    a = build_model(cfg, ParallelState(), seed=3)
    b = build_model(cfg, ParallelState(), seed=3, activation_checkpointing=True)
    c = build_model(cfg, ParallelState(), seed=4)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(),
                                            c.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" not in name and "bias" not in name:
            assert not torch.equal(pa, pc), name
    ids = torch.randint(0, 53, (9,))
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    cu = torch.tensor([0, 9], dtype=torch.int32)
    for model in (a, b):
        model(ids, torch.arange(9), cu_seqlens=cu, labels=labels).sum().backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.grad is not None and pa.grad.abs().sum() > 0, name
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_saved_activations_hold_no_dead_projection_output(qk_norm):
    """What backward keeps of a layer: never the fused qkv output (q and k are rotated into
    new tensors, v is copied), and of the MLP only w13's output and the SwiGLU output, not
    silu(gate) as well."""
    model = build_model(_cfg(qk_norm=qk_norm), ParallelState(), seed=0)
    outputs = {}
    for name in ("wqkv", "w13"):
        module = model.layers[0].attention.wqkv if name == "wqkv" else (
            model.layers[0].feed_forward.w13)
        module.register_forward_hook(
            lambda mod, args, out, name=name: outputs.__setitem__(name, out))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    ids = torch.randint(0, 53, (9,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, torch.arange(9), cu_seqlens=torch.tensor([0, 9], dtype=torch.int32),
              labels=ids)
    qkv, w13 = outputs["wqkv"], outputs["w13"]
    assert qkv.shape == (9, 32 + 2 * 16) and w13.shape == (9, 2 * 48)
    assert qkv.untyped_storage().data_ptr() not in saved, "v keeps the fused qkv output alive"
    assert saved.get(w13.untyped_storage().data_ptr()) == (9, 96)  # SwiGLU's one saved input
    intermediate = [shape for shape in saved.values() if shape == (9, 48)]
    assert len(intermediate) == 2, intermediate  # w2's input, in each of the two layers


def test_positions_beyond_max_position_embeddings_raise():
    model = build_model(_cfg(max_position_embeddings=16), ParallelState())
    ids = torch.randint(0, 53, (20,))
    cu = torch.tensor([0, 4, 20], dtype=torch.int32)
    model(ids, torch.cat([torch.arange(4), torch.arange(16)]), cu_seqlens=cu, output="logits")
    with pytest.raises(ValueError, match=r"position id 19 is beyond max_position_embeddings = "
                                         r"16.*larger max_position_embeddings"):
        model(ids, torch.arange(20), cu_seqlens=torch.tensor([0, 20], dtype=torch.int32),
              output="logits")


def test_autocast_residual_stream_is_transformers_with_a_bf16_stream(llama_dir):
    """``residual_dtype="autocast"`` under bf16 autocast computes what transformers computes
    when its embedding output is cast to bf16 (the stream Megatron-core and torchtitan keep):
    closer to that than to transformers' own fp32 stream, while the default stays closer to
    the fp32 one. Without autocast the setting changes nothing."""
    folder, hf = llama_dir
    ours, _ = load_hf_model(folder, ParallelState())
    ids, positions = torch.randint(0, 53, (64,)), torch.arange(64)
    cu = torch.tensor([0, 64], dtype=torch.int32)

    def transformers(bf16_stream: bool) -> torch.Tensor:
        cast = hf.model.embed_tokens.register_forward_hook(
            lambda module, args, out: out.to(torch.bfloat16)) if bf16_stream else None
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = hf(ids[None]).logits[0].float()
        if cast is not None:
            cast.remove()
        return logits

    def mpcore(residual_dtype: str, autocast: bool = True):
        ours.residual_dtype = residual_dtype
        seen = []
        hook = ours.layers[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = ours(ids, positions, cu_seqlens=cu, output="logits").float()
        hook.remove()
        return logits, seen

    def err(a, b):
        return ((a - b).norm() / b.norm()).item()

    bf16_stream, fp32_stream = transformers(True), transformers(False)
    auto, auto_seen = mpcore("autocast")
    default, default_seen = mpcore("float32")
    assert auto_seen == [torch.bfloat16] and default_seen == [torch.float32]
    assert err(auto, bf16_stream) < 0.9 * err(auto, fp32_stream) and err(auto, bf16_stream) < 1e-2
    assert err(default, fp32_stream) < 0.9 * err(default, bf16_stream)
    (plain, plain_seen), (same, same_seen) = mpcore("float32", False), mpcore("autocast", False)
    assert torch.equal(plain, same) and plain_seen == same_seen == [torch.float32]
