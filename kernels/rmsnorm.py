"""RMSNorm over the last dimension: a Triton forward/backward and a plain PyTorch reference.

Layout: x [..., H] (any leading dims, flattened to rows [M, H]), weight [H].
Semantics are those of Hugging Face's LlamaRMSNorm / Qwen2RMSNorm:

    n = x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)
    y = weight * n.to(x.dtype)

The normalised value is rounded to x.dtype BEFORE the weight multiply, and y has the dtype of
that product (torch's promotion of x.dtype and weight.dtype, which is x.dtype when they match).

Kernels: one program per row for the forward (the whole row sits in registers, so H is bounded
by MAX_HIDDEN); the backward runs a fixed grid of programs that each walk a contiguous slab of
rows, keep a float32 partial of dweight in registers, and write it to a [programs, H] buffer that
is summed in float32 afterwards. All accumulation is float32.
"""

import functools

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, x_row_stride, y_row_stride, H, eps, BLOCK_H: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    # Round to the input dtype before the weight multiply, as Hugging Face does.
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = normed * w
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    M,
    H,
    rows_per_program,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    # int64 bounds make the loop index int64, so row offsets cannot overflow.
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in range(row_start, row_end):
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        normed = x * rstd
        # dweight sees the rounded normalised value, exactly what multiplied the weight.
        dw += dy * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        dnormed = dy * w
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (dn - n * mean(dn * n)).
        dx = rstd * (dnormed - normed * (tl.sum(dnormed * normed, axis=0) / H))
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * H + cols, dw, mask=mask)


def _num_warps(block_h: int) -> int:
    if block_h >= 32768:
        return 32
    if block_h >= 8192:
        return 16
    if block_h >= 2048:
        return 8
    return 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_bwd_programs(device: torch.device, num_rows: int, block_h: int) -> int:
    """Programs for the backward: about 8192 row elements in flight per SM (2 programs per SM
    at H=4096, 4 at H=2048; measured best on H200), so the float32 dweight partials stay near
    num_SMs * 32 KiB whatever H. Under the CPU interpreter a few, to exercise the slab logic."""
    if device.type == "cuda":
        target = _sm_count(device.index) * max(1, 8192 // block_h)
    else:
        target = 4
    return max(1, min(target, num_rows))


class _RMSNormFunction(torch.autograd.Function):
    """forward: Triton RMSNorm of rows [M, H]; backward: Triton dx and float32-reduced dweight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        hidden = shape[-1]
        x2d = x.reshape(-1, hidden)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        weight = weight.contiguous()
        num_rows = x2d.shape[0]
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty((num_rows, hidden), dtype=out_dtype, device=x.device)
        rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
        block_h = triton.next_power_of_2(hidden)
        _rms_norm_fwd_kernel[(num_rows,)](
            x2d, weight, y, rstd, x2d.stride(0), y.stride(0), hidden, eps,
            BLOCK_H=block_h, num_warps=_num_warps(block_h),
        )  # fmt: skip
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.x_shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, weight, rstd = ctx.saved_tensors
        num_rows, hidden = x2d.shape
        dy2d = dy.reshape(num_rows, hidden)
        if dy2d.stride(-1) != 1:
            dy2d = dy2d.contiguous()
        dx = torch.empty_like(x2d)
        block_h = triton.next_power_of_2(hidden)
        num_programs = _num_bwd_programs(x2d.device, num_rows, block_h)
        rows_per_program = triton.cdiv(num_rows, num_programs)
        num_programs = triton.cdiv(num_rows, rows_per_program)
        dw_partial = torch.empty((num_programs, hidden), dtype=torch.float32, device=x2d.device)
        _rms_norm_bwd_kernel[(num_programs,)](
            dy2d, x2d, weight, rstd, dx, dw_partial,
            dy2d.stride(0), x2d.stride(0), dx.stride(0), num_rows, hidden, rows_per_program,
            BLOCK_H=block_h, num_warps=_num_warps(block_h),
        )  # fmt: skip
        dweight = dw_partial.sum(0).to(weight.dtype)
        return dx.view(ctx.x_shape), dweight, None


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() == 0:
        raise ValueError(
            f"rms_norm: x must have shape [..., H]; got a scalar x and weight {tuple(weight.shape)}."
        )
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must have shape [H] with H = x.shape[-1]; got x {tuple(x.shape)}"
            f" and weight {tuple(weight.shape)}. Pass a weight of shape ({x.shape[-1]},)."
        )
    if weight.device != x.device:
        raise ValueError(
            f"rms_norm: x is on {x.device} but weight is on {weight.device}; move both to one device."
        )


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain PyTorch RMSNorm, op for op as Hugging Face's LlamaRMSNorm.forward.

    x [..., H] any float dtype, weight [H]; returns weight * (normalised x rounded to x.dtype),
    of shape [..., H] and dtype promote(x.dtype, weight.dtype).
    """
    _check_inputs(x, weight)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm through the Triton kernels, whatever the device (CPU needs TRITON_INTERPRET=1).

    Same contract as rms_norm_reference; differentiable in x and weight.
    """
    _check_inputs(x, weight)
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(
            f"rms_norm: H = {x.shape[-1]} exceeds the Triton kernel's limit of {MAX_HIDDEN}"
            " (one row per program); use rms_norm_reference for wider rows."
        )
    if x.numel() == 0:
        return rms_norm_reference(x, weight, eps)
    return _RMSNormFunction.apply(x, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim: Triton on CUDA tensors, the PyTorch reference elsewhere.

    x [..., H] (fp32, fp16 or bf16), weight [H]; returns [..., H] in promote(x.dtype,
    weight.dtype). Raises ValueError if weight is not [H] or lives on another device.
    """
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
