"""What a model with MoE blocks (``mpcore.models.common.moe``) offers beyond a dense one: the
trainer's hooks (``mpcore.moe_step``) and the inputs' ``moe_mask``, shared by every MoE family.

    model.router_stats()     the MoE layers' statistics of the last forward, pooled
    model.moe_cfg            the config with the MoE fields (router_aux_loss_coef, ...); a VL
                             model's (``DecoderMoeRouting``): its decoder's ``cfg.text``
    forward(..., moe_mask)   ``moe_mask [L]`` bool: the local tokens the statistics count (real
                             tokens, not cp padding); ``set_moe_mask`` hands it to every block
    moe_mask(plan, state)    that mask for this cp rank's tokens of a ``ContextPlan``

The MoE blocks run on every tp rank's full local tokens (experts are not tp-sharded), so
sequence parallelism is refused (``check_moe_layout``), as is an ep that does not divide the
experts.
"""

from __future__ import annotations

import torch

from mpcore.models.common.moe import MoeBlock, RouterStats
from mpcore.models.common.moe_loss import pool_layers
from mpcore.parallel.state import ParallelState


def check_moe_layout(text_cfg, state: ParallelState, sequence_parallel: bool) -> None:
    """``ValueError`` naming the fix when a MoE decoder cannot run at ``state``'s layout."""
    if sequence_parallel and state.tp > 1:
        raise ValueError("sequence parallelism is not supported with MoE layers yet (the "
                         "experts run on every tp rank's full tokens); set "
                         "sequence_parallel false")
    text_cfg.check_experts(state.ep)


def idle_expert_params(cfg) -> int:
    """Expert parameters a token's forward does not multiply: the E - k experts of each sparse
    layer it is not routed to (``active = total - idle``). ``cfg``: a ``Qwen3MoeConfig``."""
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return len(cfg.moe_layers) * (cfg.num_experts - cfg.num_experts_per_tok) * expert


def moe_mask(plan, state: ParallelState, device) -> torch.Tensor:
    """``[L]`` bool: true at this cp rank's real tokens of ``plan`` (false at cp padding)."""
    return (plan.rank_layout(state.cp_rank).global_index >= 0).to(device)


class MoeRouting:
    """Mixin of a ``nn.Module`` holding ``MoeBlock``s: the hooks of the module docstring."""

    @property
    def moe_cfg(self):
        """The config holding the MoE fields: the model's own (a VL model: its decoder's)."""
        return self.cfg

    def moe_blocks(self) -> list[MoeBlock]:
        return [m for m in self.modules() if isinstance(m, MoeBlock)]

    def router_stats(self) -> RouterStats:
        """The MoE layers' statistics of the last forward, pooled (``moe_loss.pool_layers``);
        a block that did not run in it (an MTP layer the forward skipped: None) is left out."""
        return pool_layers(b.last_stats for b in self.moe_blocks() if b.last_stats is not None)

    def set_moe_mask(self, moe_mask: torch.Tensor | None, input_ids: torch.Tensor) -> None:
        """Every block counts the tokens of ``moe_mask [L]`` bool (None: all) in its
        statistics; ``ValueError`` when it does not match ``input_ids [L]``."""
        if moe_mask is not None and tuple(moe_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"moe_mask has shape {tuple(moe_mask.shape)} but input_ids "
                             f"{tuple(input_ids.shape)}; split it with the same plan")
        for block in self.moe_blocks():
            block.token_mask = moe_mask


class DecoderMoeRouting(MoeRouting):
    """``MoeRouting`` of a model whose MoE blocks are its decoder's (a vision-language model:
    ``cfg.text`` holds the MoE fields), its forward taking ``moe_mask``. Put it before the
    model class in the bases: ``forward`` hands the mask to the blocks, then runs the model's."""

    @property
    def moe_cfg(self):
        return self.cfg.text

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                moe_mask: torch.Tensor | None = None, **kwargs):
        """The model's forward; ``moe_mask [L]`` bool: the tokens the routing statistics count
        (None: all)."""
        self.set_moe_mask(moe_mask, input_ids)
        return super().forward(input_ids, position_ids, **kwargs)
