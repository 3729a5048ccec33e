"""SwiGLU feed-forward on tensor-parallel layers.

Layout: ``x [L, hidden]`` (``[L / tp, hidden]`` under sequence parallelism). ``w13`` is the fused
column-parallel ``[gate; up]`` projection (parts ``[I, I]``, so rank r holds ``[gate_r; up_r]``,
``[2 * I / tp, hidden]``); ``silu(gate) * up`` is ``[L, I / tp]``; the row-parallel ``w2`` sums
the partial outputs over the tp group: ``[L, hidden]`` (all-reduce) or ``[L / tp, hidden]``
(reduce-scatter under SP).

The activation is ``mpcore.kernels.swiglu`` on w13's ``[L, 2 * I / tp]`` output as it stands (gate in
the first half, up in the second, per rank): one fused pass each way on CUDA, and only that
output is saved for backward, not ``silu(gate)`` too as eager autograd would (an ``[L, I / tp]``
less per layer: 256 MiB at 16k tokens x 8192 in bf16). Same rounding as eager ``F.silu(gate) * up``.
"""

from __future__ import annotations

import torch
from torch import nn

from mpcore.kernels.swiglu import swiglu
from mpcore.models.common.config import ModelConfig
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mpcore.parallel.state import ProcessGroup


class FeedForward(nn.Module):
    """``w2(silu(x @ gate.T) * (x @ up.T))`` with gate/up fused in ``w13``; group: tp;
    ``fp8``: the recipe of ``w13`` and ``w2`` (``mpcore.parallel.layers``)."""

    def __init__(self, cfg: ModelConfig, *, tp_group: ProcessGroup | None,
                 sequence_parallel: bool, fp8: str = "none", device=None, dtype=None):
        super().__init__()
        inter = cfg.intermediate_size
        self.w13 = ColumnParallelLinear(cfg.hidden_size, 2 * inter, group=tp_group,
                                        sequence_parallel=sequence_parallel,
                                        partition_sizes=[inter, inter], fp8=fp8,
                                        device=device, dtype=dtype)
        self.w2 = RowParallelLinear(inter, cfg.hidden_size, group=tp_group,
                                    sequence_parallel=sequence_parallel, fp8=fp8, device=device,
                                    dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x)))  # (L, 2I/tp) -> (L, I/tp) -> w2
