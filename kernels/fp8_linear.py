"""FP8 linear: ``y = x @ w.T`` with its three GEMMs in FP8, tensorwise current scaling (Hopper).

Layout: ``x [..., K]`` (flattened to ``[N, K]`` rows), ``w [M, K]`` (fp32 master weights, or
bf16 as FSDP2 gathers them), ``y [..., M]`` in the autocast dtype under autocast (bf16), else
in x's dtype. ``dx`` comes back in x's dtype, ``dw`` in w's (fp32, straight out of the GEMM).

Recipe ``tensorwise`` (current scaling): every operand is scaled by ``fp8_max / amax`` of that
tensor in that call (no history), cast to FP8, and the GEMM output multiplied back by the two
inverse scales (``torch._scaled_mm``, fp32 accumulation):

    forward   y  = x8 @ w8^T           x, w in e4m3 (3 mantissa bits, max 448)
    backward  dx = dy8 @ w8            dy in e5m2 (2 mantissa bits, max 57344)
              dw = dy8^T @ x8

Gradients in e5m2: one scale per tensor maps its amax to the format's max, and e4m3 then
keeps values down to 2^-9 / 448 ~ 4e-6 of the amax (below that they flush to zero), e5m2 down
to 2^-16 / 57344 ~ 3e-10. Activations and weights are bounded and compact, gradients are
heavy-tailed (a few large entries next to many small ones per tensor), so they get the range;
this is TransformerEngine's HYBRID format and torchao's tensorwise default.
``tests/gpu/test_fp8_linear_gpu.py`` measures both choices' errors.

Saved for backward: ``x8`` and ``w8`` (one byte per element, half of bf16's) and their
scales; the backward re-uses the forward's quantized operands, as TransformerEngine does.
Constraints of the FP8 GEMM: K and M multiples of 16 (checked by the layers that use it);
rows are zero-padded to a multiple of 16 where needed (zero rows change no sum).

Kernels: a Triton pass per quantization (reads the tensor once, writes FP8 once; the scale is
computed on the device from the amax, so no CPU-GPU sync), ``torch._scaled_mm`` for the GEMMs.
``fp8_linear_reference`` runs the same autograd math in plain PyTorch (FP8 casts, fp32
matmuls) on any device: what the CPU tests check.
"""

from __future__ import annotations

import torch

from mpcore.kernels._triton import tl, triton

RECIPES = ("none", "tensorwise")
FWD_DTYPE = torch.float8_e4m3fn
GRAD_DTYPE = torch.float8_e5m2


@triton.jit
def _quantize_kernel(x_ptr, y_ptr, amax_ptr, inv_scale_ptr, n, FP8_MAX: tl.constexpr,
                     BLOCK: tl.constexpr):
    """y = clamp(x * s) in FP8 with s = FP8_MAX / amax; program 0 also writes 1 / s."""
    pid = tl.program_id(0)
    amax = tl.maximum(tl.load(amax_ptr).to(tl.float32), 1e-12)
    scale = FP8_MAX / amax
    if pid == 0:
        tl.store(inv_scale_ptr, 1.0 / scale)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.clamp(x * scale, -FP8_MAX, FP8_MAX)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _amax(t: torch.Tensor) -> torch.Tensor:
    # One reduction pass, no |t| temporary.
    return torch.linalg.vector_norm(t, float("inf"))


def quantize(t: torch.Tensor, dtype: torch.dtype, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (contiguous) in FP8 ``dtype`` scaled so that its amax maps to the format's max,
    and the fp32 scalar inverse scale (``t ~ t8 * inv_scale``)."""
    fp8_max = torch.finfo(dtype).max
    amax = _amax(t)
    if impl == "triton":
        out = torch.empty(t.shape, dtype=dtype, device=t.device)
        inv_scale = torch.empty((), dtype=torch.float32, device=t.device)
        block = 4096
        _quantize_kernel[(max(1, triton.cdiv(t.numel(), block)),)](
            t, out, amax, inv_scale, t.numel(), FP8_MAX=fp8_max, BLOCK=block, num_warps=8)
        return out, inv_scale
    scale = fp8_max / amax.float().clamp_min(1e-12)
    out = (t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return out, scale.reciprocal()


# Copies of FP8 tensors go through uint8 views (same bytes; zero bytes are +0.0 in both
# formats), so they need no FP8 support from cat, zeros or the transpose copy.
def _pad_rows(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    if extra == 0:
        return t
    raw = t.view(torch.uint8)
    return torch.cat([raw, raw.new_zeros(extra, *t.shape[1:])]).view(t.dtype)


def _transposed(t8: torch.Tensor) -> torch.Tensor:
    """``t8.t()`` copied to row-major storage."""
    return t8.view(torch.uint8).t().contiguous().view(t8.dtype)


def _gemm(a8, b8, inv_a, inv_b, out_dtype, impl: str) -> torch.Tensor:
    """``(a8 @ b8) * inv_a * inv_b``: a8 ``[n, k]`` row-major, b8 ``[k, m]`` column-major."""
    rows = a8.shape[0]
    if impl == "triton":
        out = torch._scaled_mm(_pad_rows(a8), b8, scale_a=inv_a, scale_b=inv_b,
                               out_dtype=out_dtype)
    else:
        out = ((a8.float() @ b8.float()) * (inv_a * inv_b)).to(out_dtype)
    return out[:rows]


def _col_major(t8: torch.Tensor) -> torch.Tensor:
    """``[r, c]`` with column-major strides (the FP8 GEMM's second operand layout)."""
    return _transposed(t8).t()


class _FP8Linear(torch.autograd.Function):
    """forward: ``x8 @ w8^T`` (e4m3); backward: ``dx = dy8 @ w8``, ``dw = dy8^T @ x8`` (dy in
    e5m2). Inputs ``x [N, K]``, ``w [M, K]``."""

    @staticmethod
    def forward(ctx, x, w, out_dtype, impl):
        # Autocast off: it would upcast the amax reduction's input to fp32 (a copy of x) and
        # run the reference's fp32 matmuls in bf16. Dtypes here are explicit.
        with torch.autocast(x.device.type, enabled=False):
            x8, inv_x = quantize(x.contiguous(), FWD_DTYPE, impl)
            w8, inv_w = quantize(w.contiguous(), FWD_DTYPE, impl)
            y = _gemm(x8, w8.t(), inv_x, inv_w, out_dtype, impl)  # w8 [M, K]: w8.t() col-major
        ctx.save_for_backward(x8, inv_x, w8, inv_w)
        ctx.dtypes, ctx.impl = (x.dtype, w.dtype), impl
        return y

    @staticmethod
    def backward(ctx, dy):
        x8, inv_x, w8, inv_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dy8, inv_dy = quantize(dy.contiguous(), GRAD_DTYPE, ctx.impl)
        dx = _gemm(dy8, _col_major(w8), inv_dy, inv_w, x_dtype, ctx.impl)  # (N, K)
        # dw [M, K] = dy8^T [M, N] @ x8 [N, K]; N (tokens) is the contraction: pad it.
        dy8_t = _transposed(_pad_rows(dy8))
        dw = _gemm(dy8_t, _col_major(_pad_rows(x8)), inv_dy, inv_x, w_dtype, ctx.impl)
        return dx, dw, None, None


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def check_fp8(recipe: str, device: torch.device | str | None = None) -> None:
    """Raise ``ValueError`` when ``recipe`` is unknown or, for a recipe other than ``none``,
    when ``device`` cannot run FP8 GEMMs (not CUDA, or compute capability below 8.9)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; use one of {list(RECIPES)}")
    if recipe != "none" and device is not None:
        check_fp8_device(recipe, device)


def check_fp8_device(recipe: str, device: torch.device | str) -> None:
    """Raise ``ValueError`` naming ``recipe`` (any FP8 recipe, ours or TransformerEngine's) when
    ``device`` cannot run FP8 GEMMs (not CUDA, or compute capability below 8.9)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"fp8={recipe!r} needs a CUDA GPU with FP8 tensor cores (compute "
                         f"capability >= 8.9: Ada, Hopper or later), got device {device}; set "
                         f"fp8 to 'none'")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"fp8={recipe!r} needs compute capability >= 8.9 (Ada, Hopper or "
                         f"later); {torch.cuda.get_device_name(device)} has {major}.{minor}; set "
                         f"fp8 to 'none'")


def fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w[M, K].T`` with the three GEMMs in FP8 (module docstring), on CUDA with
    compute capability >= 8.9 (else ``ValueError``). K and M must be multiples of 16."""
    check_fp8("tensorwise", x.device)
    return _apply(x, w, "triton")


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_linear` in plain PyTorch (same quantization, fp32 matmuls), any device."""
    return _apply(x, w, "torch")


def _apply(x: torch.Tensor, w: torch.Tensor, impl: str) -> torch.Tensor:
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8_linear: x [..., K] and w [M, K] needed, got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    if w.shape[0] % 16 or w.shape[1] % 16:
        raise ValueError(f"fp8_linear: the FP8 GEMM needs in and out features multiples of 16, "
                         f"got w of shape {tuple(w.shape)}; set fp8 to 'none' for this shape")
    lead = x.shape[:-1]
    y = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), w, _out_dtype(x), impl)
    return y.view(*lead, w.shape[0])
