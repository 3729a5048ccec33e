"""Qwen3-MoE: the Qwen3 decoder (QK-norm) whose MLPs are sparse mixture-of-experts blocks (the
decoder config of the qwen3_moe and qwen3_vl_moe families; Qwen3.5-MoE takes its MoE fields).

``Qwen3MoeConfig`` is ``ModelConfig`` plus the MoE fields of transformers' ``Qwen3MoeConfig``:
layer i is sparse iff ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``
(and ``num_experts > 0``); the other layers are dense SwiGLU MLPs of ``intermediate_size``.
config.json is read in both transformers forms (5.x ``rope_parameters``, 4.x top-level
``rope_theta``) and written in both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.hf_io import read_hf_config
from mpcore.models.common.section import DecoderSection, section_of

ARCH, MODEL_TYPE = "Qwen3MoeForCausalLM", "qwen3_moe"


@dataclass(frozen=True)
class Qwen3MoeConfig(ModelConfig):
    """``ModelConfig`` (qk_norm on) plus the MoE fields (module docstring)."""

    num_experts: int = 8
    """Routed experts per sparse layer."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 64
    """Width of each expert's SwiGLU hidden layer."""
    norm_topk_prob: bool = False
    """Divide the k routing weights by their sum."""
    decoder_sparse_step: int = 1
    """Every ``decoder_sparse_step``-th layer is sparse: layer i iff ``(i + 1) % step == 0``
    and i is not in ``mlp_only_layers``."""
    mlp_only_layers: tuple[int, ...] = field(default=())
    """Layers kept dense."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss in the training loss (transformers' coefficient)."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE; not in transformers: 0 there)."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.mlp_only_layers, list):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Qwen3MoeConfig.{name} must be a positive integer, got "
                                 f"{value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} is above "
                             f"num_experts {self.num_experts}; route to at most every expert")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layers of a {self.num_layers}-"
                             f"layer model")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 <= value < float("inf")):
                raise ValueError(f"model.moe.{name} must be a finite weight >= 0 (0 turns "
                                 f"that loss off), got {value!r}: a negative weight rewards "
                                 f"what the loss penalises; set it to 0 or more")
        if not self.moe_layers:
            raise ValueError(f"no layer of this {self.num_layers}-layer MoE model is sparse "
                             f"(mlp_only_layers {list(self.mlp_only_layers)}, "
                             f"decoder_sparse_step {self.decoder_sparse_step}): it would train "
                             f"as a dense model with idle experts; leave at least one layer out "
                             f"of model.moe.mlp_only_layers (and keep model.moe."
                             f"decoder_sparse_step <= {self.num_layers}), or train a dense "
                             f"family")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The sparse layers (transformers' rule, module docstring)."""
        return tuple(i for i in range(self.num_layers) if i not in self.mlp_only_layers
                     and (i + 1) % self.decoder_sparse_step == 0)

    def check_experts(self, ep: int) -> None:
        """``ValueError`` naming the fix when the experts cannot be split over ``ep`` ranks."""
        if self.num_experts % ep:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by ep {ep}; "
                             f"choose an ep that divides {self.num_experts}")


MoeSection = section_of(Qwen3MoeConfig, "MoeSection", skip=ModelConfig)
"""The YAML ``model.moe`` keys: ``Qwen3MoeConfig``'s fields beyond the decoder's."""


@dataclass(frozen=True)
class Qwen3MoeSection(DecoderSection):
    """Our YAML model section of the qwen3_moe family: the decoder's keys and ``moe``."""

    moe: MoeSection | None = None
    """A mixture-of-experts model from scratch: ``Qwen3MoeConfig``'s MoE fields
    (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
    decoder_sparse_step, mlp_only_layers, router_aux_loss_coef, router_z_loss_coef). Null:
    their defaults."""


def config_from_dict(d: dict) -> Qwen3MoeConfig:
    """``Qwen3MoeConfig`` of ``dataclasses.asdict(cfg)`` (a checkpoint's meta.json)."""
    d = dict(d)
    d["mlp_only_layers"] = tuple(d.get("mlp_only_layers") or ())
    if d.get("mrope_section") is not None:
        d["mrope_section"] = tuple(d["mrope_section"])
    return Qwen3MoeConfig(**d)


def _theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type"))
    if kind not in (None, "default"):
        raise ValueError(f"RoPE type {kind!r} is not supported for Qwen3-MoE; supported: "
                         f"default")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(source: str | Path | dict) -> Qwen3MoeConfig:
    """``Qwen3MoeConfig`` of a ``Qwen3MoeForCausalLM`` config.json (either transformers form).
    ``ValueError`` for another architecture (a dense checkpoint included) or a feature outside
    this model (naming the key)."""
    hf = read_hf_config(source)
    archs = hf.get("architectures") or [hf.get("model_type")]
    if archs not in ([ARCH], [MODEL_TYPE]):
        raise ValueError(f"{archs} is not a Qwen3-MoE checkpoint ({ARCH}); load it with its "
                         f"own family (mpcore.models.registry.family_of_hf)")
    for key, allowed, what in (("hidden_act", "silu", "an activation other than silu"),
                               ("use_sliding_window", False, "sliding-window attention"),
                               ("attention_bias", False, "attention biases")):
        if hf.get(key, allowed) != allowed:
            raise ValueError(f"config.json sets {key}={hf[key]!r}; {what} is not supported")
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))  # 5.x writes the latter
    if not num_experts:
        raise ValueError("config.json has num_experts = 0: a dense model; load it as the "
                         "llama family (Qwen3ForCausalLM)")
    heads = hf["num_attention_heads"]
    return Qwen3MoeConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rope_theta=_theta(hf),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_norm=True,
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        num_experts=num_experts, num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def hf_config_dict(cfg: Qwen3MoeConfig) -> dict:
    """A config.json dict transformers loads as ``Qwen3MoeForCausalLM`` (both forms)."""
    plain = ModelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)})
    if plain.rope_scaling is not None or plain.mrope_section is not None or (
            plain.rotary_dim is not None or plain.qkv_bias or not plain.qk_norm):
        raise ValueError("a Qwen3-MoE config.json has QK-norm, no QKV bias and plain RoPE; this "
                         "config departs from it")
    return {
        "architectures": [ARCH], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False,
    }
