"""The Qwen3.5-MoE text decoder: ``Qwen35Transformer`` whose feed-forwards are MoE blocks.

Each layer is a ``Qwen35Block`` (gated attention or Gated DeltaNet, on tp / cp as for the
dense model) whose feed-forward is a ``mpcore.models.common.moe.MoeBlock``: top-k renormalised, the
experts split over ``state.ep_group``, a shared expert of ``cfg.intermediate_size`` gated by
``sigmoid(shared_expert_gate)`` (replicated, like the router: the block runs on every tp rank's
full tokens). ``mpcore.models.common.moe_model`` adds ``moe_mask``, ``router_stats()`` and the layout
checks. Built on the meta device and initialised per shard: the same function at any tp and ep.

Multi-token prediction (``mpcore.models.common.hybrid.mtp``, built when ``mtp_loss_weight > 0``):
the MTP layer's feed-forward is a MoE block of the same shape, its experts split over ep like
the decoder's. Its router is balanced with the decoder's (Megatron-LM balances the MTP layer's
router too): when the MTP block ran, ``router_stats()`` pools it as one more layer, so the
step's aux loss is transformers' ``load_balancing_loss_func`` over L + 1 layers; a forward
without MTP inputs (validation, scoring) pools the L decoder layers only.
"""

from __future__ import annotations

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.hybrid.model import Qwen35Transformer, materialise
from mpcore.models.common.hybrid.moe_config import Qwen35MoeConfig
from mpcore.models.common.moe import MoeBlock
from mpcore.models.common.moe_model import MoeRouting, check_moe_layout
from mpcore.parallel.state import ParallelState


class Qwen35MoeTransformer(MoeRouting, Qwen35Transformer):
    """The decoder (module docstring); ``Qwen35Transformer``'s arguments."""

    def __init__(self, cfg: Qwen35MoeConfig, state: ParallelState, **kwargs):
        if not isinstance(cfg, Qwen35MoeConfig):
            raise TypeError(f"Qwen35MoeTransformer needs a Qwen35MoeConfig, got "
                            f"{type(cfg).__name__}")
        check_moe_layout(cfg, state, bool(kwargs.get("sequence_parallel")))
        super().__init__(cfg, state, **kwargs)
        # Qwen35Block builds a dense SwiGLU (on meta: no memory); each is replaced here, the
        # MTP layer's too (the release's mtp.layers.0.mlp is a MoE block like the decoder's).
        layers = [*self.layers, *(self.mtp.layers if self.mtp is not None else ())]
        for layer in layers:
            layer.feed_forward = MoeBlock(
                cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                cfg.moe_intermediate_size, norm_topk_prob=True, ep_group=state.ep_group,
                shared_intermediate=cfg.intermediate_size, dtype=kwargs.get("dtype"))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                moe_mask: torch.Tensor | None = None, **kwargs):
        """``Qwen35Transformer.forward``; ``moe_mask [L]`` bool: the tokens the routing
        statistics count (None: all)."""
        self.set_moe_mask(moe_mask, input_ids)
        if self.mtp is not None:  # a forward without MTP inputs leaves no MTP router stats
            self.mtp.layers[0].feed_forward.last_stats = None
        return super().forward(input_ids, position_ids, **kwargs)


def make_model(cfg: Qwen35MoeConfig, state: ParallelState, *, dtype: torch.dtype = torch.float32,
               **options) -> Qwen35MoeTransformer:
    """The model on the meta device (``build`` and ``load_hf`` materialise it); ``options``:
    ``Qwen35Transformer``'s (sequence_parallel, cp_mode, activation_checkpointing,
    attention_backend, fp8, gdn_kernel)."""
    with torch.device("meta"):
        return Qwen35MoeTransformer(cfg, state, dtype=dtype, **options)


def build(cfg: Qwen35MoeConfig, state: ParallelState, *, seed: int = 0,
          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
          fp8: str = "none", **options) -> Qwen35MoeTransformer:
    """Create on meta, materialise this rank's shards (tp, and ep for the experts) on
    ``device``, initialise from ``seed`` (``mpcore.models.common.hybrid.model.build``'s arguments)."""
    model = materialise(make_model, cfg, state, device=device, dtype=dtype, fp8=fp8, **options)
    init_weights(model, seed)
    return model
