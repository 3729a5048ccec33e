"""The Qwen3-MoE decoder: the shared ``Transformer`` with a MoE block in its sparse layers
(a part of the qwen3_moe and qwen3_vl_moe families).

Layers are ``mpcore.models.common.decoder.DecoderLayer`` (attention on tp / cp as for the dense
models) whose feed-forward is, in the sparse layers (``Qwen3MoeConfig.moe_layers``), a
``mpcore.models.common.moe.MoeBlock`` with its experts split over ``state.ep_group``. The MoE block
runs on the full local tokens of every tp rank (the same on each: experts are not tp-sharded),
so sequence parallelism is refused. ``forward`` takes ``moe_mask [L]`` (true at real tokens,
false at the cp padding; ``mpcore.models.common.moe_family.with_moe_mask``) so the routing statistics count real
tokens only; ``router_stats()`` pools the layers' statistics of the last forward
(``mpcore.models.common.moe_loss``).
"""

from __future__ import annotations

import torch

from mpcore.kernels.fp8_linear import check_fp8
from mpcore.models.common.decoder import DecoderLayer, Transformer, init_weights
from mpcore.models.common.moe import MoeBlock
from mpcore.models.common.moe_config import Qwen3MoeConfig
from mpcore.models.common.moe_model import MoeRouting, check_moe_layout
from mpcore.parallel.state import ParallelState


class Qwen3MoeLayer(DecoderLayer):
    """``DecoderLayer`` whose feed-forward is a ``MoeBlock`` when ``index`` is sparse."""

    def __init__(self, cfg: Qwen3MoeConfig, state: ParallelState, *, sequence_parallel: bool,
                 fp8: str = "none", dtype=None, index: int = 0):
        super().__init__(cfg, state, sequence_parallel=sequence_parallel, fp8=fp8, dtype=dtype)
        if index in cfg.moe_layers:
            self.feed_forward = MoeBlock(
                cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                ep_group=state.ep_group, dtype=dtype)


class Qwen3MoeTransformer(MoeRouting, Transformer):
    """The decoder of the module docstring (``Transformer``'s arguments)."""

    def __init__(self, cfg: Qwen3MoeConfig, state: ParallelState, **kwargs):
        check_moe_layout(cfg, state, bool(kwargs.get("sequence_parallel")))
        super().__init__(cfg, state, layer=Qwen3MoeLayer, **kwargs)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                moe_mask: torch.Tensor | None = None, **kwargs):
        """``Transformer.forward``; ``moe_mask [L]`` bool: the tokens the routing statistics
        count (None: all)."""
        self.set_moe_mask(moe_mask, input_ids)
        return super().forward(input_ids, position_ids, **kwargs)


def build_model(cfg: Qwen3MoeConfig, state: ParallelState, *, seed: int = 0,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                fp8: str = "none", **kwargs) -> Qwen3MoeTransformer:
    """On meta, materialised on ``device``, initialised from ``seed`` (the same function at any
    tp and ep); ``kwargs``: ``Transformer``'s (cp_mode, attention_backend, ...)."""
    check_fp8(fp8, device)
    with torch.device("meta"):
        model = Qwen3MoeTransformer(cfg, state, fp8=fp8, dtype=dtype, **kwargs)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model
