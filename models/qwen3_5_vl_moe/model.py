"""The Qwen3.5-MoE vision-language model: ``mpcore.models.qwen3_5_vl``'s model (Qwen3-VL's tower
without DeepStack, interleaved M-RoPE) whose decoder is ``mpcore.models.qwen3_5_moe``'s
``Qwen35MoeTransformer`` (a ``mpcore.models.common.moe.MoeBlock`` with a shared expert in every layer,
experts split over ``state.ep_group``; sequence parallelism and an ep that does not divide the
experts refused when it is built).

Layout as ``mpcore.models.common.hybrid.vl_model`` plus ``moe_mask [L]`` (true at real tokens, false at cp
padding; ``mpcore.models.common.moe_model``), so the routing statistics count real tokens only;
``router_stats()`` pools them for the load-balancing loss of the step (``mpcore.moe_step``).
"""

from __future__ import annotations

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.hybrid.moe_model import Qwen35MoeTransformer
from mpcore.models.common.hybrid.vl_model import Qwen35VLModel, make_model
from mpcore.models.common.moe_model import DecoderMoeRouting
from mpcore.models.qwen3_5_vl_moe.config import Qwen35VLMoeConfig
from mpcore.parallel.state import ParallelState


class Qwen35VLMoeModel(DecoderMoeRouting, Qwen35VLModel):
    """The model of the module docstring (``Qwen35VLModel``'s arguments)."""

    decoder_cls = Qwen35MoeTransformer
    # Not measured: a 35B-A3B step is GPU-bound like Qwen2-VL-2B's, where cuDNN was faster.
    auto_vision_attention = "cudnn"


def make_moe_model(cfg: Qwen35VLMoeConfig, state: ParallelState, **options) -> Qwen35VLMoeModel:
    """The model on the meta device (``mpcore.models.common.hybrid.vl_model.make_model``'s arguments)."""
    return make_model(cfg, state, model_cls=Qwen35VLMoeModel, **options)


def build_model(cfg: Qwen35VLMoeConfig, state: ParallelState, *, seed: int = 0,
                device: torch.device | str = "cpu", **options) -> Qwen35VLMoeModel:
    """On meta, materialised on ``device``, initialised from ``seed`` (the same function at any
    tp and ep); ``options``: ``make_model``'s (dtype, fp8, vision_cp, gdn_kernel, ...)."""
    model = make_moe_model(cfg, state, device=device, **options)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model
