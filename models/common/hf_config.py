"""Hugging Face ``config.json`` <-> ``ModelConfig``: the decoder's reader and writer (Llama,
Qwen2, Qwen3 causal LMs; the VL and MoE families read their text part with it, so it lives in
``models/common``).

Reading takes both config formats transformers writes: v5 (``rope_parameters`` holding
``rope_theta`` and the scaling) and v4 (top-level ``rope_theta`` and ``rope_scaling``). Variants
map to fields, never to names inside this package: Qwen2 -> ``qkv_bias``, Qwen3 -> ``qk_norm``.
Features these models do not implement (sliding windows, o_proj/MLP biases, other RoPE types,
partial rotary) raise ``ValueError`` naming the key instead of loading a different function.
Writing picks the architecture from the fields: qk_norm -> Qwen3, qkv_bias -> Qwen2, else Llama.
"""

from __future__ import annotations

from pathlib import Path

from mpcore.models.common.config import ROPE_SCALING_KEYS, ModelConfig
from mpcore.models.common.hf_io import read_hf_config

SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}
VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


def _rope(hf: dict) -> tuple[float, dict | None]:
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"RoPE type {kind!r} is not supported; supported: default, llama3")
    missing = [k for k in ROPE_SCALING_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"llama3 RoPE scaling lacks {missing} in config.json")
    return float(theta), {k: scaling[k] for k in ROPE_SCALING_KEYS}


def _reject(hf: dict, key: str, allowed, why: str) -> None:
    if hf.get(key, allowed) != allowed:
        raise ValueError(f"config.json sets {key}={hf[key]!r}; {why} is not supported "
                         f"(only {key}={allowed!r})")


def config_from_hf(source: str | Path | dict) -> ModelConfig:
    """``ModelConfig`` of a Llama / Qwen2 / Qwen3 ``*ForCausalLM`` checkpoint's config.json.

    Raises ``ValueError`` for another architecture (naming it and the supported ones) or a
    feature outside this model (naming the config key).
    """
    hf = read_hf_config(source)
    archs = hf.get("architectures") or []
    arch = archs[0] if len(archs) == 1 else None
    if arch not in SUPPORTED:
        if arch in VL_ARCHITECTURES:
            raise ValueError(f"{arch} is a vision-language checkpoint; load it with "
                             f"mpcore.models.load_hf_vl_model (this loader builds decoders only)")
        raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}; "
                         f"supported: {sorted(SUPPORTED)}")
    family = SUPPORTED[arch]
    _reject(hf, "hidden_act", "silu", "an activation other than silu")
    _reject(hf, "partial_rotary_factor", 1.0, "partial rotary embedding")
    _reject(hf, "use_sliding_window", False, "sliding-window attention")
    _reject(hf, "mlp_bias", False, "MLP biases")
    if family != "qwen2":
        _reject(hf, "attention_bias", False, "attention biases (they include o_proj)")
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise ValueError("config.json layer_types has non-full attention layers; only full "
                         "attention is supported")
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=theta, rope_scaling=scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
        max_position_embeddings=hf.get("max_position_embeddings", 8192))


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A config.json dict transformers loads as the architecture matching ``cfg``'s fields."""
    departs = {name: getattr(cfg, name) for name, plain in (
        ("mrope_section", None), ("mrope_interleaved", False), ("rotary_dim", None),
        ("rope_style", "half")) if getattr(cfg, name) != plain}
    if departs:
        raise ValueError(f"{departs}: a Llama / Qwen2 / Qwen3 config.json has no such RoPE; "
                         f"these belong to a vision-language family (model.family qwen2_vl, "
                         f"qwen3_vl or glm4v), whose export writes them")
    if cfg.qk_norm and cfg.qkv_bias:
        raise ValueError("qk_norm with qkv_bias has no Hugging Face architecture (Qwen3's "
                         "attention_bias also biases o_proj); export one of the two")
    arch = ("Qwen3ForCausalLM" if cfg.qk_norm else
            "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**rope, **cfg.rope_scaling, "rope_type": "llama3"}
    out = {
        "architectures": [arch], "model_type": SUPPORTED[arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        # v5 reads rope_parameters; v4 reads rope_theta and rope_scaling.
        "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else
        {**cfg.rope_scaling, "rope_type": "llama3"},
    }
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None,
                   layer_types=["full_attention"] * cfg.num_layers)
        if arch == "Qwen3ForCausalLM":
            out["attention_bias"] = False
    return out
