"""RMSNorm module over the last dim, on the project's RMSNorm kernel (HF-exact numerics), and
the LayerNorm the vision towers use (``mpcore.kernels.layernorm`` on CUDA).

Layout: ``x [..., H]``, weight ``[H]`` replicated on every tp rank. When the ranks of the tp
group see DIFFERENT inputs through this weight (token shards under sequence parallelism, or
different heads for the per-head QK-norm), each computes only part of the weight's gradient:
``sum_grad_over_tp=True`` routes the weight through ``copy_to_tp`` so autograd sums it over the
tp group. When every rank sees the same input the gradient is already whole on each rank.

``zero_centred=True`` (Qwen3.5's norms): the scale is ``1 + weight`` and the weight starts at
zero, so weight decay pulls the scale toward one. The kernel multiplies by ``1 + weight``; in
fp32 that equals transformers' ``x_normed * (1 + w)``, in bf16 the normalised value is rounded
once before the multiply (``mpcore.kernels.rmsnorm``'s rule), where transformers rounds after it.
The ``1 + weight`` scale is fp32 even for bf16 weights, so without an ``out_dtype`` the output is
written in x's dtype (transformers' ``type_as(x)``), not promoted to fp32: a bf16 model run
without autocast (``score.py --dtype bfloat16``) fed fp32 rows to its bf16 projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpcore.kernels.layernorm import layer_norm
from mpcore.kernels.rmsnorm import add_rms_norm, rms_norm
from mpcore.parallel.collectives import copy_to_tp
from mpcore.parallel.state import ProcessGroup


def matmul_dtype(h: torch.Tensor) -> torch.dtype | None:
    """The dtype the next matmul computes ``h`` in under autocast (None: no autocast): what a
    norm feeding a projection writes (``out_dtype``)."""
    kind = h.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dim of width ``dim``; weight initialised to 1.
    ``zero_centred``: ``(1 + weight) * x / rms(x)``, weight initialised to 0."""

    def __init__(self, dim: int, eps: float, *, group: ProcessGroup | None = None,
                 sum_grad_over_tp: bool = False, zero_centred: bool = False, device=None,
                 dtype=None):
        super().__init__()
        self.eps, self.group, self.sum_grad_over_tp = eps, group, sum_grad_over_tp
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def reset_parameters(self, seed: int = 0) -> None:
        del seed  # norm scales start at one at every TP degree
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centred else 1.0)

    def _weight(self) -> torch.Tensor:
        w = copy_to_tp(self.weight, self.group) if self.sum_grad_over_tp else self.weight
        if not self.zero_centred:
            return w
        # 1 + w in at least fp32: a bf16 weight (FSDP's bf16 parameters) would round the scale
        # itself to 8 bits (1.0123 -> 1.0117); transformers adds in fp32 too.
        return 1.0 + w.to(torch.promote_types(w.dtype, torch.float32))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [..., dim]`` -> normalised, in ``out_dtype`` when given (``mpcore.kernels.rmsnorm``);
        zero-centred: else in x's dtype."""
        if out_dtype is None and self.zero_centred:
            out_dtype = x.dtype
        return rms_norm(x, self._weight(), self.eps, out_dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor,
            out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before this norm and the norm, fused: ``(x + delta, norm(x +
        delta))`` (``mpcore.kernels.rmsnorm.add_rms_norm``); the norm's dtype as ``forward``'s."""
        if out_dtype is None and self.zero_centred:
            out_dtype = torch.promote_types(x.dtype, delta.dtype)
        return add_rms_norm(x, delta, self._weight(), self.eps, out_dtype)

    def extra_repr(self) -> str:
        return (f"dim={self.weight.shape[0]}, eps={self.eps}, sum_grad_over_tp="
                f"{self.sum_grad_over_tp}" + (", zero_centred" if self.zero_centred else ""))


class LayerNorm(nn.Module):
    """LayerNorm over the last dim (weight 1, bias 0 at init); replicated over tp. On CUDA the
    project's kernel (``mpcore.kernels.layernorm``: float32 math, as ``F.layer_norm`` under autocast),
    elsewhere ``F.layer_norm`` itself."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def reset_parameters(self, seed: int = 0) -> None:
        del seed  # nothing is drawn
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [..., dim]`` -> normalised: in ``out_dtype`` when given (the dtype of the matmul
        it feeds, bf16 under autocast: one rounding of the float32 result, where eager writes
        float32 and the matmul rounds it), else as ``F.layer_norm`` gives it (float32 under
        autocast)."""
        if x.is_cuda and x.dtype != torch.float64:
            if out_dtype is None and torch.is_autocast_enabled("cuda"):
                out_dtype = torch.float32  # autocast runs layer_norm in float32
            return layer_norm(x, self.weight, self.bias, self.eps, out_dtype)
        y = F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        return y if out_dtype is None else y.to(out_dtype)
