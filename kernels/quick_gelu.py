"""Fused QuickGELU, ``x * sigmoid(1.702 * x)`` (Qwen2-VL's vision MLP), keeping only x.

Layout: ``x`` of any shape, walked as one flat array; the output and the gradient have x's
shape and dtype.

Eager PyTorch runs the forward as three elementwise kernels (the scale, the sigmoid, the
product) and keeps ``x`` and the sigmoid for its backward, which takes four more; at the
Qwen2-VL-2B tower's ``[16.5k patches, 5120]`` per block that is some 40 bytes of memory
traffic per element per step and two activations per block. Here it is one pass each way
(forward: read x, write y; backward: read x and dy, write dx), about 10 bytes per element in
16 bits, and x is the only tensor kept: the sigmoid is recomputed.

Math, in float32 (float64 for float64 input), k = 1.702:

    forward   t = round(k * x),  s = round(sigmoid(t)),  y = x * s
    backward  dx = dy * (sigma + k * x * sigma * (1 - sigma)),  sigma = sigmoid(k * x)

The forward rounds ``k * x`` and the sigmoid to the input dtype where eager does, so in bf16 and
fp16 it equals ``x * torch.sigmoid(1.702 * x)`` (transformers' ``QuickGELUActivation``) to the
last bit or nearly; the gradient is the exact derivative, rounded once (eager rounds each of its
intermediate products: ours is slightly closer to the float64 gradient).

CUDA tensors (fp32, fp16, bf16) run the Triton kernels; other devices and float64 the PyTorch
reference; both behind one autograd.Function, the two passes ``torch.library.custom_op``s
(namespace ``mpcore``) so ``torch.compile`` keeps them without a graph break, skipped in eager
mode (``mpcore.kernels._triton.eager_or_op``).
"""

from __future__ import annotations

import torch

from mpcore.kernels._triton import eager_or_op, tl, triton

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
K = 1.702


# ``n`` stays specialised (on n % 16): a mask of unknown alignment turns the 16-byte vector
# accesses into 2-byte ones (tests/unit/test_quick_gelu.py checks it).
@triton.jit
def _quick_gelu_fwd_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    t = (x * 1.702).to(dtype).to(tl.float32)  # eager rounds 1.702 * x ...
    s = (1.0 / (1.0 + tl.exp(-t))).to(dtype).to(tl.float32)  # ... and the sigmoid
    tl.store(y_ptr + offs, (x * s).to(dtype), mask=mask)


@triton.jit
def _quick_gelu_bwd_kernel(x_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-1.702 * x))
    dx = dy * (s + 1.702 * x * s * (1.0 - s))
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _block(device: torch.device) -> int:
    """Elements per program: 4096 on CUDA; small under the CPU interpreter, so the tests walk a
    ragged tail over several programs."""
    return 4096 if device.type == "cuda" else 64


def _fwd_triton(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    n, block = x.numel(), _block(x.device)
    _quick_gelu_fwd_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block, num_warps=4)
    return y


def _bwd_triton(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    dx = torch.empty_like(x)
    n, block = x.numel(), _block(x.device)
    _quick_gelu_bwd_kernel[(triton.cdiv(n, block),)](x, dy, dx, n, BLOCK=block, num_warps=4)
    return dx


def _compute(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _fwd_torch(x: torch.Tensor) -> torch.Tensor:
    xc = _compute(x)
    t = (xc * K).to(x.dtype).to(xc.dtype)
    s = torch.sigmoid(t).to(x.dtype).to(xc.dtype)
    return (xc * s).to(x.dtype)


def _bwd_torch(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    xc = _compute(x)
    s = torch.sigmoid(K * xc)
    return (dy.to(xc.dtype) * (s + K * xc * s * (1 - s))).to(x.dtype)


def _quick_gelu_fwd(x: torch.Tensor, impl: str) -> torch.Tensor:
    """x contiguous -> y, same shape and dtype."""
    return _fwd_triton(x) if impl == "triton" else _fwd_torch(x)


_quick_gelu_fwd_op = torch.library.custom_op("mpcore::quick_gelu_fwd", _quick_gelu_fwd,
                                             mutates_args=())


@_quick_gelu_fwd_op.register_fake
def _(x, impl):
    return torch.empty_like(x)


def _quick_gelu_bwd(x: torch.Tensor, dy: torch.Tensor, impl: str) -> torch.Tensor:
    """x, dy contiguous, same shape -> dx."""
    return _bwd_triton(x, dy) if impl == "triton" else _bwd_torch(x, dy)


_quick_gelu_bwd_op = torch.library.custom_op("mpcore::quick_gelu_bwd", _quick_gelu_bwd,
                                             mutates_args=())


@_quick_gelu_bwd_op.register_fake
def _(x, dy, impl):
    return torch.empty_like(x)


class _QuickGELUFunction(torch.autograd.Function):
    """forward: ``x * round(sigmoid(round(1.702 x)))``; backward from x alone."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, impl: str) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)  # the only tensor kept
        ctx.impl = impl
        return eager_or_op(_quick_gelu_fwd_op, _quick_gelu_fwd, x, impl)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        return eager_or_op(_quick_gelu_bwd_op, _quick_gelu_bwd, x, dy.contiguous(),
                           ctx.impl), None


def _check_input(x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"quick_gelu: x must be a floating-point tensor; got {x.dtype}. Cast "
                         f"it to bfloat16, float16 or float32.")


def quick_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` in plain PyTorch, through the same autograd.Function as the
    kernels (only x saved). Any floating dtype; raises ValueError for an integer x."""
    _check_input(x)
    return _QuickGELUFunction.apply(x, "torch")


def quick_gelu_triton(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` through the Triton kernels, whatever the device (CPU tensors
    need TRITON_INTERPRET=1). Same contract as quick_gelu_reference, for fp32, fp16, bf16."""
    _check_input(x)
    if x.dtype not in _TRITON_DTYPES:
        raise ValueError(f"quick_gelu: the Triton kernels take float32, float16 or bfloat16; "
                         f"got {x.dtype}. Use quick_gelu_reference for other dtypes.")
    if x.numel() == 0:
        return quick_gelu_reference(x)
    return _QuickGELUFunction.apply(x, "triton")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """QuickGELU: Triton on CUDA (bf16, fp16, fp32), the PyTorch reference elsewhere; the
    output in x's dtype, only x saved for backward."""
    if x.is_cuda and x.dtype in _TRITON_DTYPES:
        return quick_gelu_triton(x)
    return quick_gelu_reference(x)
