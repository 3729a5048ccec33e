"""Linear under autocast with fp32 master weights: the weight gradient straight out of the GEMM.

Layout: ``x [..., K]`` (flattened to ``[N, K]`` rows), ``w [M, K]`` fp32 (the master weight),
``y [..., M]`` in the compute dtype (bf16 or fp16, autocast's). ``dx`` comes back in x's dtype,
``dw`` in fp32.

What it saves against ``F.linear`` under autocast: autocast casts ``w`` to bf16, the backward
GEMM writes ``dw`` in bf16, and autograd casts it back to fp32 for the fp32 parameter: one
extra pass that reads 2 and writes 4 bytes per weight element, per micro-batch. Here the
backward GEMM writes fp32 itself (cuBLAS bf16 inputs, fp32 accumulation and output:
``torch.mm(..., out_dtype=torch.float32)``, CUDA only), so that pass is gone and ``dw`` is
not rounded to bf16 on the way (more accurate than autocast's). The forward and ``dx`` are the
same bf16 GEMMs autocast runs.

Saved for backward: ``x`` and ``w`` in the compute dtype, as autocast saves them.
``master_linear_applies`` says when the layers use it (CUDA, autocast on, fp32 weight that
needs a gradient, and a torch whose ``mm`` has ``out_dtype``); elsewhere ``F.linear`` runs.
On other devices the function still runs (the fp32 product in fp32 math), which is what the
CPU tests check.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def mm_has_out_dtype(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` and ``torch.addmm(c, a, b,
    out_dtype=torch.float32)`` run here on 16-bit ``a``, ``b`` (fp32 ``c``): the GEMMs that
    write, or accumulate into, fp32 (probed once; one sync)."""
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
    c = torch.ones(2, 2, dtype=torch.float32, device=device_type)
    try:
        mm = torch.mm(a, a, out_dtype=torch.float32)
        addmm = torch.addmm(c, a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):  # this torch or device has neither
        return False
    return (mm.dtype == addmm.dtype == torch.float32 and bool((mm == 2).all())
            and bool((addmm == 3).all()))


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit operands accumulated and returned in fp32."""
    if a.is_cuda and mm_has_out_dtype("cuda"):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class _MasterLinear(torch.autograd.Function):
    """forward: ``y = x_c @ w_c.T (+ b_c)`` with ``_c`` the compute dtype; backward:
    ``dx = dy @ w_c`` (compute dtype, returned in x's), ``dw = dy^T @ x_c`` in fp32,
    ``db = sum(dy)`` in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        xc, wc = x.to(dtype), weight.to(dtype)
        y = F.linear(xc, wc, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(xc, wc)
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        dy = dy.to(wc.dtype)
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, M)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ wc).view(xc.shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = _mm_fp32(dy2.t(), xc.reshape(-1, xc.shape[-1]))  # (M, K) fp32
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None


def master_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """``x @ weight.T + bias`` computed in ``dtype`` (bf16 or fp16) with ``weight`` fp32;
    its gradient is fp32 out of the GEMM (module docstring). Shapes: ``x [..., K]``,
    ``weight [M, K]``, ``bias [M]`` or None -> ``[..., M]`` in ``dtype``."""
    if weight.dtype != torch.float32:
        raise ValueError(f"master_linear takes the fp32 master weight, got {weight.dtype}; "
                         "use F.linear for 16-bit weights")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input width {x.shape[-1]} != weight width {weight.shape[1]}")
    return _MasterLinear.apply(x, weight, bias, dtype)


def master_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The compute dtype when :func:`master_linear` should replace ``F.linear`` for this call
    (CUDA autocast to bf16/fp16, an fp32 weight that needs its gradient, ``mm`` with
    ``out_dtype`` in this torch), else None."""
    if not (weight.is_cuda and weight.dtype == torch.float32 and weight.requires_grad
            and torch.is_grad_enabled() and torch.is_autocast_enabled("cuda")):
        return None
    dtype = torch.get_autocast_dtype("cuda")
    if dtype not in COMPUTE_DTYPES or not x.is_floating_point() or not mm_has_out_dtype("cuda"):
        return None
    return dtype
