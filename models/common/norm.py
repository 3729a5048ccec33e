"""RMSNorm module over the last dim, on the project's RMSNorm kernel (HF-exact numerics).

Layout: ``x [..., H]``, weight ``[H]`` replicated on every tp rank. When the ranks of the tp
group see DIFFERENT inputs through this weight (token shards under sequence parallelism, or
different heads for the per-head QK-norm), each computes only part of the weight's gradient:
``sum_grad_over_tp=True`` routes the weight through ``copy_to_tp`` so autograd sums it over the
tp group. When every rank sees the same input the gradient is already whole on each rank.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.rmsnorm import add_rms_norm, rms_norm
from parallel.collectives import copy_to_tp
from parallel.state import ProcessGroup


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dim of width ``dim``; weight initialised to 1."""

    def __init__(self, dim: int, eps: float, *, group: ProcessGroup | None = None,
                 sum_grad_over_tp: bool = False, device=None, dtype=None):
        super().__init__()
        self.eps, self.group, self.sum_grad_over_tp = eps, group, sum_grad_over_tp
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def reset_parameters(self, seed: int = 0) -> None:
        del seed  # norm weights start at one at every TP degree
        with torch.no_grad():
            self.weight.fill_(1.0)

    def _weight(self) -> torch.Tensor:
        return copy_to_tp(self.weight, self.group) if self.sum_grad_over_tp else self.weight

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [..., dim]`` -> normalised, in ``out_dtype`` when given (``kernels.rmsnorm``)."""
        return rms_norm(x, self._weight(), self.eps, out_dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor,
            out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before this norm and the norm, fused: ``(x + delta, norm(x +
        delta))`` (``kernels.rmsnorm.add_rms_norm``)."""
        return add_rms_norm(x, delta, self._weight(), self.eps, out_dtype)

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[0]}, eps={self.eps}, sum_grad_over_tp={self.sum_grad_over_tp}"
