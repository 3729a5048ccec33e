"""Qwen3.5-MoE text decoder configuration: ``Qwen35Config`` (the hybrid layers) plus
``Qwen3MoeConfig``'s MoE fields, with what Qwen3.5-MoE fixes.

Every layer's feed-forward is a MoE block (transformers' ``Qwen3_5MoeSparseMoeBlock``): a
softmax router over ``num_experts``, the top ``num_experts_per_tok`` weights always
renormalised (``norm_topk_prob`` is true and cannot be set false), SwiGLU experts of
``moe_intermediate_size``, and one shared expert gated by ``sigmoid(shared_expert_gate)``.
The multi-token-prediction layer (``mtp.layers.0``) has the same MoE feed-forward.
Qwen3.5-MoE has no dense MLP, so ``intermediate_size`` here IS the shared expert's width
(transformers' ``shared_expert_intermediate_size``); ``decoder_sparse_step`` is 1 and
``mlp_only_layers`` empty. The MoE fields' checks and ``check_experts`` are Qwen3-MoE's.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.moe_config import Qwen3MoeConfig
from mpcore.models.common.moe_family import with_moe_fields
from mpcore.models.common.section import section_of


@dataclass(frozen=True)
class Qwen35MoeConfig(Qwen35Config, Qwen3MoeConfig):
    """A Qwen3.5-MoE text decoder (module docstring); ``qk_norm`` always on."""

    norm_topk_prob: bool = True
    """Always true: Qwen3.5-MoE renormalises the top-k routing weights."""

    def __post_init__(self):
        super().__post_init__()  # Qwen35Config's checks, then Qwen3MoeConfig's
        for name, fixed in (("norm_topk_prob", True), ("decoder_sparse_step", 1),
                            ("mlp_only_layers", ())):
            if getattr(self, name) != fixed:
                raise ValueError(f"Qwen3.5-MoE has {name}={fixed!r} (every layer sparse, top-k "
                                 f"renormalised), got {getattr(self, name)!r}; remove it")


Qwen35MoeExpertsSection = section_of(Qwen35MoeConfig, "Qwen35MoeExpertsSection",
                                     skip=Qwen35Config)
"""The YAML ``model.moe`` keys of the qwen3_5_moe family: ``Qwen35MoeConfig``'s MoE fields."""


def config_from_dict(d: dict) -> Qwen35MoeConfig:
    """``Qwen35MoeConfig`` of ``dataclasses.asdict(cfg)`` (a checkpoint's meta.json; the config
    turns its lists back into tuples)."""
    return Qwen35MoeConfig(**d)


def with_experts(dense, moe: dict) -> Qwen35MoeConfig:
    """``dense``'s decoder (a ``Qwen35Config``) with every feed-forward a MoE block of ``moe``
    (``Qwen35MoeConfig``'s MoE fields; ``dense.intermediate_size``: the shared expert's
    width)."""
    return with_moe_fields(Qwen35MoeConfig, dense, moe,
                           "mpcore.models.common.hybrid.moe_config.Qwen35MoeConfig")
