"""The Qwen3-VL-MoE model: ``mpcore.models.qwen3_vl``'s model (tower, DeepStack, interleaved M-RoPE)
whose decoder layers are Qwen3-MoE's (``mpcore.models.common.moe_decoder.Qwen3MoeLayer``: a
``mpcore.models.common.moe.MoeBlock`` in each sparse layer, experts split over ``state.ep_group``).

Layout as ``mpcore.models.common.qwen3_vl.model`` plus ``moe_mask [L]`` (true at real tokens, false at cp
padding; ``mpcore.models.common.moe_model``), so the routing statistics count real tokens only;
``router_stats()`` pools them for the load-balancing loss of the step (``mpcore.moe_step``).
"""

from __future__ import annotations

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.moe_decoder import Qwen3MoeLayer
from mpcore.models.common.moe_model import DecoderMoeRouting, check_moe_layout, idle_expert_params
from mpcore.models.common.qwen3_vl.model import Qwen3VLModel
from mpcore.models.common.qwen3_vl.model import flops_per_token as dense_flops_per_token
from mpcore.models.common.qwen3_vl.model import num_params as dense_num_params
from mpcore.models.qwen3_vl_moe.config import Qwen3VLMoeConfig
from mpcore.parallel.state import ParallelState


class Qwen3VLMoeModel(DecoderMoeRouting, Qwen3VLModel):
    """The model of the module docstring (``Qwen3VLModel``'s arguments)."""

    decoder_layer = Qwen3MoeLayer

    def __init__(self, cfg: Qwen3VLMoeConfig, state: ParallelState, **kwargs):
        check_moe_layout(cfg.text, state, bool(kwargs.get("sequence_parallel")))
        super().__init__(cfg, state, **kwargs)


def build_model(cfg: Qwen3VLMoeConfig, state: ParallelState, *, device="cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0,
                **kwargs) -> Qwen3VLMoeModel:
    """On meta, materialised on ``device``, initialised from ``seed`` (the same function at any
    tp and ep); ``kwargs``: ``Qwen3VLModel``'s (sequence_parallel, cp_mode, vision_cp, ...)."""
    with torch.device("meta"):
        model = Qwen3VLMoeModel(cfg, state, dtype=dtype, **kwargs)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model


def num_params(cfg: Qwen3VLMoeConfig) -> dict[str, int]:
    """``mpcore.models.common.qwen3_vl.model.num_params``' counts of this model plus ``active`` (k of the E
    experts of every sparse layer)."""
    counts = dense_num_params(cfg, Qwen3VLMoeModel)
    return {**counts, "active": counts["total"] - idle_expert_params(cfg.text)}


def flops_per_token(cfg: Qwen3VLMoeConfig, seq_len: int) -> float:
    """``mpcore.models.common.qwen3_vl.model.flops_per_token`` over the ACTIVE decoder weights."""
    return dense_flops_per_token(cfg, seq_len, num_params(cfg))
