"""SwiGLU feed-forward on tensor-parallel layers.

Layout: ``x [L, hidden]`` (``[L / tp, hidden]`` under sequence parallelism). ``w13`` is the fused
column-parallel ``[gate; up]`` projection (parts ``[I, I]``, so rank r holds ``[gate_r; up_r]``,
``[2 * I / tp, hidden]``); ``silu(gate) * up`` is ``[L, I / tp]``; the row-parallel ``w2`` sums
the partial outputs over the tp group: ``[L, hidden]`` (all-reduce) or ``[L / tp, hidden]``
(reduce-scatter under SP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from mpcore.dist import ProcessGroup
from parallel.layers import ColumnParallelLinear, RowParallelLinear


class FeedForward(nn.Module):
    """``w2(silu(x @ gate.T) * (x @ up.T))`` with gate/up fused in ``w13``; group: tp."""

    def __init__(self, cfg: ModelConfig, *, tp_group: ProcessGroup | None,
                 sequence_parallel: bool, device=None, dtype=None):
        super().__init__()
        inter = cfg.intermediate_size
        self.w13 = ColumnParallelLinear(cfg.hidden_size, 2 * inter, group=tp_group,
                                        sequence_parallel=sequence_parallel,
                                        partition_sizes=[inter, inter], device=device,
                                        dtype=dtype)
        self.w2 = RowParallelLinear(inter, cfg.hidden_size, group=tp_group,
                                    sequence_parallel=sequence_parallel, device=device,
                                    dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)  # (L, I/tp) each
        return self.w2(F.silu(gate) * up)
