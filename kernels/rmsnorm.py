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

``add_rms_norm`` fuses the residual add before a norm (``s = x + delta``, both returned) and
its backward (the norm's input gradient summed with the gradient reaching ``s`` from its other
use, written once per addend dtype); ``out_dtype`` writes the output in the dtype its consumer
computes in (bf16 under autocast) instead of a separate cast. Each rounding happens where the
unfused PyTorch ops would do it; compiled, the fused kernels agree with the unfused ones to
fp32 rounding (the compiler may order the sum of squares or fuse a multiply-add differently:
about 1 row in 10 gets an rstd 1 ulp apart; ``tests/gpu/test_rmsnorm_gpu.py`` bounds it).
"""

import functools

import torch

from mpcore.kernels._triton import tl, triton

MAX_HIDDEN = 65536


@triton.jit
def _load_row(ptr, row, row_stride, cols, mask):
    """Row ``row`` of a row-major ``[M, H]`` tensor in float32 (masked columns 0)."""
    return tl.load(ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _slab(rows_per_program, M):
    """``(start, end)``: the rows this backward program walks. int64 bounds make the loop index
    int64, so row offsets cannot overflow."""
    start = tl.program_id(0).to(tl.int64) * rows_per_program
    return start, tl.minimum(start + rows_per_program, M)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, d_ptr, s_ptr, w_ptr, y_ptr, rstd_ptr, x_row_stride, d_row_stride, s_row_stride,
    y_row_stride, H, eps, HAS_DELTA: tl.constexpr, BLOCK_H: tl.constexpr
):
    # s_ptr: the norm's input, s = x + d when HAS_DELTA (written here), else x itself.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * d_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + d).to(s_ptr.dtype.element_ty)  # the sum rounded once, as torch's add does
        tl.store(s_ptr + row * s_row_stride + cols, s, mask=mask)
        x = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    # Round to the input dtype before the weight multiply, as Hugging Face does.
    normed = (x * rstd).to(s_ptr.dtype.element_ty).to(tl.float32)
    y = normed * w
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit(do_not_specialize=["M", "rows_per_program"])  # one compile per width
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    ds_ptr,
    dx_ptr,
    dd_ptr,
    dw_partial_ptr,
    dy_row_stride,
    x_row_stride,
    ds_row_stride,
    dx_row_stride,
    dd_row_stride,
    M,
    H,
    rows_per_program,
    HAS_DELTA: tl.constexpr,
    HAS_DS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # x_ptr: the norm's input (s of a fused add). HAS_DELTA: the input's gradient, plus ds (the
    # gradient that reached s from its other use, when HAS_DS), goes to both addends of the
    # fused add: dx (x's dtype) and dd (the delta's dtype).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_start, row_end = _slab(rows_per_program, M)
    for row in range(row_start, row_end):
        x = _load_row(x_ptr, row, x_row_stride, cols, mask)
        dy = _load_row(dy_ptr, row, dy_row_stride, cols, mask)
        rstd = tl.load(rstd_ptr + row)
        normed = x * rstd
        # dweight sees the rounded normalised value, exactly what multiplied the weight.
        dw += dy * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        dnormed = dy * w
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (dn - n * mean(dn * n)).
        dx = rstd * (dnormed - normed * (tl.sum(dnormed * normed, axis=0) / H))
        if HAS_DELTA:
            # As autograd would: the norm's input gradient rounded to the input's dtype, then
            # summed with s's other gradient, then cast to each addend's dtype.
            total = dx.to(x_ptr.dtype.element_ty).to(tl.float32)
            if HAS_DS:
                total += tl.load(ds_ptr + row * ds_row_stride + cols, mask=mask,
                                 other=0.0).to(tl.float32)
            tl.store(dd_ptr + row * dd_row_stride + cols, total.to(dd_ptr.dtype.element_ty),
                     mask=mask)
            dx = total
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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` as rows ``[M, H]`` with unit stride along H (a copy only when needed)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


class _RMSNormFunction(torch.autograd.Function):
    """forward: Triton RMSNorm of rows [M, H] (of ``x + delta`` when a delta is given, which is
    returned too); backward: Triton dx (and ddelta) and float32-reduced dweight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                eps: float, out_dtype: torch.dtype | None):
        shape, hidden = x.shape, x.shape[-1]
        x2d = _rows(x)
        weight = weight.contiguous()
        num_rows = x2d.shape[0]
        if delta is None:
            d2d = s2d = x2d
        else:
            d2d = _rows(delta)
            s2d = torch.empty((num_rows, hidden), dtype=torch.promote_types(x.dtype, delta.dtype),
                              device=x.device)
        y = torch.empty((num_rows, hidden), device=x.device,
                        dtype=out_dtype or torch.promote_types(s2d.dtype, weight.dtype))
        rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
        block_h = triton.next_power_of_2(hidden)
        _rms_norm_fwd_kernel[(num_rows,)](
            x2d, d2d, s2d, weight, y, rstd, x2d.stride(0), d2d.stride(0), s2d.stride(0),
            y.stride(0), hidden, eps, HAS_DELTA=delta is not None, BLOCK_H=block_h,
            num_warps=_num_warps(block_h),
        )  # fmt: skip
        ctx.save_for_backward(s2d, weight, rstd)
        ctx.shape, ctx.x_dtype = shape, x.dtype
        ctx.delta_dtype = None if delta is None else delta.dtype
        ctx.set_materialize_grads(False)
        if delta is None:
            return y.view(shape)
        return s2d.view(shape), y.view(shape)

    @staticmethod
    def backward(ctx, *grads):
        s2d, weight, rstd = ctx.saved_tensors
        num_rows, hidden = s2d.shape
        fused = ctx.delta_dtype is not None
        ds, dy = grads if fused else (None, grads[0])
        dy2d = s2d.new_zeros(s2d.shape) if dy is None else _rows(dy)
        ds2d = None if ds is None else _rows(ds)
        dx = torch.empty((num_rows, hidden), dtype=ctx.x_dtype, device=s2d.device)
        dd = torch.empty((num_rows, hidden), dtype=ctx.delta_dtype, device=s2d.device) if fused \
            else dx
        block_h = triton.next_power_of_2(hidden)
        num_programs = _num_bwd_programs(s2d.device, num_rows, block_h)
        rows_per_program = triton.cdiv(num_rows, num_programs)
        num_programs = triton.cdiv(num_rows, rows_per_program)
        dw_partial = torch.empty((num_programs, hidden), dtype=torch.float32, device=s2d.device)
        ds_arg = dy2d if ds2d is None else ds2d
        _rms_norm_bwd_kernel[(num_programs,)](
            dy2d, s2d, weight, rstd, ds_arg, dx, dd, dw_partial,
            dy2d.stride(0), s2d.stride(0), ds_arg.stride(0), dx.stride(0), dd.stride(0),
            num_rows, hidden, rows_per_program, HAS_DELTA=fused, HAS_DS=ds2d is not None,
            BLOCK_H=block_h, num_warps=_num_warps(block_h),
        )  # fmt: skip
        dweight = dw_partial.sum(0).to(weight.dtype)
        dx = dx.view(ctx.shape)
        return dx, (dd.view(ctx.shape) if fused else None), dweight, None, None


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


def _check_delta(x: torch.Tensor, delta: torch.Tensor) -> None:
    if delta.shape != x.shape or delta.device != x.device or not delta.is_floating_point():
        raise ValueError(
            f"add_rms_norm: delta must be a float tensor of x's shape on x's device; got x "
            f"{tuple(x.shape)} on {x.device} and delta {tuple(delta.shape)} {delta.dtype} on "
            f"{delta.device}."
        )


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain PyTorch RMSNorm, op for op as Hugging Face's LlamaRMSNorm.forward.

    x [..., H] any float dtype, weight [H]; returns weight * (normalised x rounded to x.dtype),
    of shape [..., H] and dtype promote(x.dtype, weight.dtype), then cast to ``out_dtype`` when
    given (what a bf16 autocast matmul would cast it to next).
    """
    _check_inputs(x, weight)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(x.dtype)
    return y if out_dtype is None else y.to(out_dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float = 1e-6, out_dtype: torch.dtype | None = None):
    """``s = x + delta`` (a residual add) and ``rms_norm_reference(s, ...)``: returns (s, y)."""
    _check_delta(x, delta)
    s = x + delta
    return s, rms_norm_reference(s, weight, eps, out_dtype)


def _check_triton(x: torch.Tensor) -> None:
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(
            f"rms_norm: H = {x.shape[-1]} exceeds the Triton kernel's limit of {MAX_HIDDEN}"
            " (one row per program); use rms_norm_reference for wider rows."
        )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm through the Triton kernels, whatever the device (CPU needs TRITON_INTERPRET=1).

    Same contract as rms_norm_reference; differentiable in x and weight.
    """
    _check_inputs(x, weight)
    _check_triton(x)
    if x.numel() == 0:
        return rms_norm_reference(x, weight, eps, out_dtype)
    return _RMSNormFunction.apply(x, None, weight, eps, out_dtype)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float = 1e-6, out_dtype: torch.dtype | None = None):
    """``add_rms_norm_reference`` in one Triton pass each way (the add, the norm, the output
    cast; in backward the norm's gradient, the gradient reaching ``s`` from elsewhere and the
    cast of the sum to ``delta``'s dtype). The same values to fp32 rounding (module docstring)."""
    _check_inputs(x, weight)
    _check_delta(x, delta)
    _check_triton(x)
    if x.numel() == 0:
        return add_rms_norm_reference(x, delta, weight, eps, out_dtype)
    return _RMSNormFunction.apply(x, delta, weight, eps, out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dim: Triton on CUDA tensors, the PyTorch reference elsewhere and
    for float64 (the Triton kernels accumulate the weight's gradient in float32; float64 runs
    are the references that judge the others, as in layernorm, swiglu and rope).

    x [..., H] (fp32, fp16 or bf16; float64), weight [H]; returns [..., H] in promote(x.dtype,
    weight.dtype), or in ``out_dtype`` (one rounding of that result). Raises ValueError if
    weight is not [H] or lives on another device.
    """
    if x.is_cuda and torch.float64 not in (x.dtype, weight.dtype):
        return rms_norm_triton(x, weight, eps, out_dtype)
    return rms_norm_reference(x, weight, eps, out_dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6, out_dtype: torch.dtype | None = None):
    """The residual add and the next RMSNorm, ``s = x + delta; y = rms_norm(s)``: returns
    ``(s, y)``; ``s`` in promote(x.dtype, delta.dtype), ``y`` as :func:`rms_norm`. One fused
    pass each way on CUDA, the PyTorch reference elsewhere and for float64 (as :func:`rms_norm`)."""
    if x.is_cuda and torch.float64 not in (x.dtype, delta.dtype, weight.dtype):
        return add_rms_norm_triton(x, delta, weight, eps, out_dtype)
    return add_rms_norm_reference(x, delta, weight, eps, out_dtype)
