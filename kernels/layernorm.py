"""LayerNorm over the last dimension: a Triton forward/backward and a plain PyTorch reference.

Layout: x [..., H] (any leading dims, flattened to rows [M, H]), weight [H], bias [H].
Semantics are those of ``F.layer_norm`` computed in float32, which is what it runs under
autocast (autocast lists layer_norm as an fp32 op) and what the vision towers of transformers'
Qwen2-VL, Qwen3-VL and GLM-4V compute:

    m = mean(x.float()),  r = rsqrt(mean((x.float() - m) ** 2) + eps)
    y = ((x.float() - m) * r) * weight + bias          rounded once, to out_dtype

``out_dtype`` (default: promote(x.dtype, weight.dtype), what ``F.layer_norm`` returns outside
autocast; ``mpcore.models.common.norm.LayerNorm`` asks for float32 under autocast) lets the output go
straight to the dtype its consumer computes in (bf16 for the next autocast matmul), where eager
writes float32 and the matmul casts it again; the values are the same (one rounding of the same
float32 result). x is read in its own dtype, so a bf16 input is not first copied to float32.

Kernels: as ``mpcore.kernels.rmsnorm``'s. One program per row forward (the row in registers, H at most
``MAX_HIDDEN``), saving the per-row rstd; the backward runs a fixed grid of programs, each over a
contiguous slab of rows, recomputing the mean from x and keeping float32 partials of dweight and
dbias in registers, summed in float32 afterwards:

    n = (x - m) r,  dn = dy * weight
    dx = r * (dn - mean(dn) - n * mean(dn * n)),   dweight = sum dy * n,   dbias = sum dy
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpcore.kernels._triton import tl, triton
from mpcore.kernels.rmsnorm import (
    MAX_HIDDEN,
    _load_row,
    _num_bwd_programs,
    _num_warps,
    _rows,
    _slab,
)


@triton.jit
def _layer_norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, rstd_ptr, x_row_stride, y_row_stride, H,
                           eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = _load_row(x_ptr, row, x_row_stride, cols, mask)
    mean = tl.sum(x, axis=0) / H
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w + b
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit(do_not_specialize=["M", "rows_per_program"])  # one compile per width
def _layer_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
                           db_partial_ptr, dy_row_stride, x_row_stride, dx_row_stride, M, H,
                           rows_per_program, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    db = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_start, row_end = _slab(rows_per_program, M)
    for row in range(row_start, row_end):
        x = _load_row(x_ptr, row, x_row_stride, cols, mask)
        dy = _load_row(dy_ptr, row, dy_row_stride, cols, mask)
        rstd = tl.load(rstd_ptr + row)
        mean = tl.sum(x, axis=0) / H
        normed = tl.where(mask, (x - mean) * rstd, 0.0)
        dw += dy * normed
        db += dy
        dnormed = dy * w
        dx = rstd * (dnormed - tl.sum(dnormed, axis=0) / H
                     - normed * (tl.sum(dnormed * normed, axis=0) / H))
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * H + cols, dw, mask=mask)
    tl.store(db_partial_ptr + pid.to(tl.int64) * H + cols, db, mask=mask)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, out_dtype) -> torch.dtype:
    return out_dtype or torch.promote_types(x.dtype, weight.dtype)


class _LayerNormFunction(torch.autograd.Function):
    """forward: Triton LayerNorm of rows [M, H]; backward: Triton dx and float32-reduced
    dweight and dbias."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                out_dtype: torch.dtype):
        shape, hidden = x.shape, x.shape[-1]
        x2d = _rows(x)
        weight, bias = weight.contiguous(), bias.contiguous()
        num_rows = x2d.shape[0]
        y = torch.empty((num_rows, hidden), device=x.device, dtype=out_dtype)
        rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
        block_h = triton.next_power_of_2(hidden)
        _layer_norm_fwd_kernel[(num_rows,)](
            x2d, weight, bias, y, rstd, x2d.stride(0), y.stride(0), hidden, eps,
            BLOCK_H=block_h, num_warps=_num_warps(block_h))
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.shape, ctx.x_dtype, ctx.bias_dtype = shape, x.dtype, bias.dtype
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, weight, rstd = ctx.saved_tensors
        num_rows, hidden = x2d.shape
        dy2d = _rows(dy)
        dx = torch.empty((num_rows, hidden), dtype=ctx.x_dtype, device=x2d.device)
        block_h = triton.next_power_of_2(hidden)
        num_programs = _num_bwd_programs(x2d.device, num_rows, block_h)
        rows_per_program = triton.cdiv(num_rows, num_programs)
        num_programs = triton.cdiv(num_rows, rows_per_program)
        partial = torch.empty((2, num_programs, hidden), dtype=torch.float32,
                              device=x2d.device)
        _layer_norm_bwd_kernel[(num_programs,)](
            dy2d, x2d, weight, rstd, dx, partial[0], partial[1], dy2d.stride(0),
            x2d.stride(0), dx.stride(0), num_rows, hidden, rows_per_program, BLOCK_H=block_h,
            num_warps=_num_warps(block_h))
        dweight, dbias = partial.sum(1)
        return (dx.view(ctx.shape), dweight.to(weight.dtype), dbias.to(ctx.bias_dtype), None,
                None)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    if x.dim() == 0 or not x.is_floating_point():
        raise ValueError(f"layer_norm: x must be a float tensor of shape [..., H]; got "
                         f"{x.dtype} {tuple(x.shape)}.")
    width = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t.dim() != 1 or t.shape[0] != width or t.device != x.device:
            raise ValueError(f"layer_norm: {name} must have shape [H] = ({width},) on x's device "
                             f"{x.device}; got {tuple(t.shape)} on {t.device}.")


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float = 1e-5, out_dtype: torch.dtype | None = None
                         ) -> torch.Tensor:
    """``F.layer_norm`` over the last dim in float32 (float64 for float64 input), the result
    rounded once to ``out_dtype`` (default promote(x.dtype, weight.dtype))."""
    _check_inputs(x, weight, bias)
    compute = torch.promote_types(x.dtype, torch.float32)
    y = F.layer_norm(x.to(compute), (x.shape[-1],), weight.to(compute), bias.to(compute), eps)
    return y.to(_out_dtype(x, weight, out_dtype))


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float = 1e-5, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """LayerNorm through the Triton kernels, whatever the device (CPU needs TRITON_INTERPRET=1);
    same contract as layer_norm_reference for fp32, fp16 and bf16 x; differentiable in x,
    weight and bias."""
    _check_inputs(x, weight, bias)
    if x.dtype == torch.float64 or x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"layer_norm: the Triton kernels take fp32/fp16/bf16 rows of at most "
                         f"{MAX_HIDDEN}; got {x.dtype} H = {x.shape[-1]}. Use "
                         f"layer_norm_reference.")
    if x.numel() == 0:
        return layer_norm_reference(x, weight, bias, eps, out_dtype)
    return _LayerNormFunction.apply(x, weight, bias, eps, _out_dtype(x, weight, out_dtype))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """LayerNorm over the last dim: Triton on CUDA (fp32, fp16, bf16 rows up to MAX_HIDDEN),
    the PyTorch reference elsewhere; float32 math, one rounding to ``out_dtype``."""
    if x.is_cuda and x.dtype != torch.float64 and x.shape[-1] <= MAX_HIDDEN:
        return layer_norm_triton(x, weight, bias, eps, out_dtype)
    return layer_norm_reference(x, weight, bias, eps, out_dtype)
