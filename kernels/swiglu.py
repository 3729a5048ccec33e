"""Fused SwiGLU activation: ``silu(gate) * up`` that keeps only its input for backward.

Layout: ``gate_up [..., 2 * I]`` (any leading dims, flattened to rows ``[M, 2 * I]``), the gate
in the first half of the last dim and up in the second, exactly what ``chunk(2, dim=-1)``
splits; the output is ``[..., I]`` and the gradient one ``[..., 2 * I]`` tensor (d_gate | d_up),
both in gate_up's dtype.

Memory: eager ``F.silu(gate) * up`` saves gate, up AND ``silu(gate)`` for backward, 1.5x the
bytes of gate_up (an extra ``[M, I]``, 256 MiB per layer at 16k tokens x I = 8192 in bf16).
The fused op saves gate_up alone and recomputes the sigmoid in backward.

Math, in float32 (float64 for float64 input), with s = sigmoid(g):

    y      = round(silu(g)) * u                      silu(g) = g * s
    d_up   = dy * round(silu(g))
    d_gate = dy * u * s * (1 + g * (1 - s))

Rounding follows eager PyTorch, as kernels/rmsnorm.py follows Hugging Face: eager rounds
``silu(g)`` to the input dtype before the multiply by up, so the fused forward does too and is
(nearly) bitwise equal to ``F.silu(gate) * up`` in bf16/fp16, which keeps the transformers
parity tests tight. d_up uses that same rounded value, the one that multiplied up (as rmsnorm's
dweight uses the rounded normalised value). d_gate stays in float32 until its final rounding,
where eager also rounds ``dy * up`` to the input dtype first (as rmsnorm's dx skips HF's
intermediate rounding): slightly closer to the exact gradient, and equal to eager's to about
one ulp of the input dtype, norm-wise.

Kernels: one Triton program per ``[BLOCK_M, BLOCK_I]`` tile of rows x columns of I, one pass
forward (read gate_up, write y) and one backward (read gate_up and dy, write the gradient).
CUDA tensors run the Triton kernels; other devices (and float64) the PyTorch reference. Both
sit behind the same autograd.Function, and the two passes are ``torch.library.custom_op``s
(namespace ``mpcore``), so ``torch.compile`` traces ``swiglu`` without a graph break; eager
calls skip the op's dispatch (``mpcore.kernels._triton.eager_or_op``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mpcore.kernels._triton import eager_or_op, tl, triton

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_tile(gu_ptr, gu_row_stride, num_rows, inter, BLOCK_M: tl.constexpr,
               BLOCK_I: tl.constexpr):
    """This program's tile: row and column indices, mask, gate and up in float32."""
    # int64 rows, so row offsets cannot overflow at 16k tokens x 2 * I.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < num_rows)[:, None] & (cols < inter)[None, :]
    gate_offs = rows[:, None] * gu_row_stride + cols[None, :]
    g = tl.load(gu_ptr + gate_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + gate_offs + inter, mask=mask, other=0.0).to(tl.float32)
    return rows, cols, mask, g, u


@triton.jit(do_not_specialize=["num_rows"])  # one compile for every row count
def _swiglu_fwd_kernel(
    gu_ptr, y_ptr, gu_row_stride, y_row_stride, num_rows, inter,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    rows, cols, mask, g, u = _load_tile(gu_ptr, gu_row_stride, num_rows, inter, BLOCK_M, BLOCK_I)
    # Round silu(g) to the input dtype before the multiply, as eager PyTorch does.
    silu = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    y = silu * u
    y_offs = rows[:, None] * y_row_stride + cols[None, :]
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _swiglu_bwd_kernel(
    gu_ptr, dy_ptr, dgu_ptr, gu_row_stride, dy_row_stride, dgu_row_stride, num_rows, inter,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    rows, cols, mask, g, u = _load_tile(gu_ptr, gu_row_stride, num_rows, inter, BLOCK_M, BLOCK_I)
    dy_offs = rows[:, None] * dy_row_stride + cols[None, :]
    dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(tl.float32)
    denom = 1.0 + tl.exp(-g)
    s = 1.0 / denom
    # d_up sees the rounded silu(g), exactly what multiplied up in the forward.
    silu = (g / denom).to(gu_ptr.dtype.element_ty).to(tl.float32)
    d_up = dy * silu
    d_gate = dy * u * s * (1.0 + g * (1.0 - s))
    dgu_offs = rows[:, None] * dgu_row_stride + cols[None, :]
    tl.store(dgu_ptr + dgu_offs, d_gate.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(dgu_ptr + dgu_offs + inter, d_up.to(dgu_ptr.dtype.element_ty), mask=mask)


def _tile(num_cols: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_I): 2048-element tiles on CUDA, at most 1024 columns wide, so a narrow
    I (small per-rank shards) still fills a tile with several rows. Under the CPU interpreter
    small tiles, so the tests walk ragged row and column tails."""
    max_elems, max_cols = (2048, 1024) if device.type == "cuda" else (64, 32)
    block_i = min(triton.next_power_of_2(num_cols), max_cols)
    return max(1, max_elems // block_i), block_i


def _launch_grid(num_rows: int, num_cols: int, block_m: int, block_i: int) -> tuple[int, int]:
    return triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_i)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fwd_triton(gu: torch.Tensor) -> torch.Tensor:
    num_rows, inter = gu.shape[0], gu.shape[1] // 2
    y = torch.empty((num_rows, inter), dtype=gu.dtype, device=gu.device)
    block_m, block_i = _tile(inter, gu.device)
    _swiglu_fwd_kernel[_launch_grid(num_rows, inter, block_m, block_i)](
        gu, y, gu.stride(0), y.stride(0), num_rows, inter,
        BLOCK_M=block_m, BLOCK_I=block_i, num_warps=4,
    )  # fmt: skip
    return y


def _bwd_triton(gu: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    num_rows, inter = gu.shape[0], gu.shape[1] // 2
    dgu = torch.empty((num_rows, 2 * inter), dtype=gu.dtype, device=gu.device)
    block_m, block_i = _tile(inter, gu.device)
    _swiglu_bwd_kernel[_launch_grid(num_rows, inter, block_m, block_i)](
        gu, dy, dgu, gu.stride(0), dy.stride(0), dgu.stride(0), num_rows, inter,
        BLOCK_M=block_m, BLOCK_I=block_i, num_warps=4,
    )  # fmt: skip
    return dgu


def _split_upcast(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up in the compute dtype, and silu(gate) rounded to gu's dtype (eager's rounding)."""
    compute = torch.promote_types(gu.dtype, torch.float32)
    inter = gu.shape[-1] // 2
    gate, up = gu[:, :inter].to(compute), gu[:, inter:].to(compute)
    return gate, up, F.silu(gate).to(gu.dtype).to(compute)


def _fwd_torch(gu: torch.Tensor) -> torch.Tensor:
    _, up, silu = _split_upcast(gu)
    return (silu * up).to(gu.dtype)


def _bwd_torch(gu: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    gate, up, silu = _split_upcast(gu)
    dy = dy.to(gate.dtype)
    s = torch.sigmoid(gate)
    d_gate = dy * up * s * (1 + gate * (1 - s))
    return torch.cat([d_gate, dy * silu], dim=-1).to(gu.dtype)


def _swiglu_fwd(gu: torch.Tensor, impl: str) -> torch.Tensor:
    """gu [M, 2I] with unit last stride -> y [M, I], same dtype."""
    return _fwd_triton(gu) if impl == "triton" else _fwd_torch(gu)


_swiglu_fwd_op = torch.library.custom_op("mpcore::swiglu_fwd", _swiglu_fwd, mutates_args=())


@_swiglu_fwd_op.register_fake
def _(gu, impl):
    return gu.new_empty((gu.shape[0], gu.shape[1] // 2))


def _swiglu_bwd(gu: torch.Tensor, dy: torch.Tensor, impl: str) -> torch.Tensor:
    """gu [M, 2I], dy [M, I], both with unit last stride -> (d_gate | d_up) [M, 2I]."""
    return _bwd_triton(gu, dy) if impl == "triton" else _bwd_torch(gu, dy)


_swiglu_bwd_op = torch.library.custom_op("mpcore::swiglu_bwd", _swiglu_bwd, mutates_args=())


@_swiglu_bwd_op.register_fake
def _(gu, dy, impl):
    return gu.new_empty(gu.shape)


class _SwiGLUFunction(torch.autograd.Function):
    """forward: y = round(silu(gate)) * up; backward: (d_gate | d_up) from gate_up alone."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, impl: str) -> torch.Tensor:
        shape = gate_up.shape
        # (M, 2I), a view when it can be; M spelled out, since -1 is ambiguous when 2I = 0.
        gu = _unit_stride(gate_up.reshape(math.prod(shape[:-1]), shape[-1]))
        y = eager_or_op(_swiglu_fwd_op, _swiglu_fwd, gu, impl)
        ctx.save_for_backward(gu)  # the only tensor kept: no silu(gate), no output
        ctx.impl, ctx.shape = impl, shape
        return y.view(*shape[:-1], shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (gu,) = ctx.saved_tensors
        dy = _unit_stride(dy.reshape(gu.shape[0], gu.shape[1] // 2))  # (M, I)
        return eager_or_op(_swiglu_bwd_op, _swiglu_bwd, gu, dy, ctx.impl).view(ctx.shape), None


def _check_input(gate_up: torch.Tensor) -> None:
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2 != 0:
        raise ValueError(
            f"swiglu: gate_up must have shape [..., 2 * I] (gate then up along the last dim);"
            f" got {tuple(gate_up.shape)}. Pass the fused [gate; up] projection's output."
        )
    if not gate_up.is_floating_point():
        raise ValueError(
            f"swiglu: gate_up must be a floating-point tensor; got {gate_up.dtype}."
            " Cast it to bfloat16, float16 or float32."
        )


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in plain PyTorch, through the same autograd.Function as the kernels.

    gate_up ``[..., 2 * I]``, any floating dtype; returns ``[..., I]`` in gate_up's dtype,
    saving only gate_up for backward. Raises ValueError for an odd last dim or a non-float dtype.
    """
    _check_input(gate_up)
    return _SwiGLUFunction.apply(gate_up, "torch")


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` through the Triton kernels, whatever the device (CPU tensors need
    TRITON_INTERPRET=1). Same contract as swiglu_reference, for fp32, fp16 and bf16."""
    _check_input(gate_up)
    if gate_up.dtype not in _TRITON_DTYPES:
        raise ValueError(
            f"swiglu: the Triton kernels take float32, float16 or bfloat16; got {gate_up.dtype}."
            " Use swiglu_reference for other dtypes."
        )
    if gate_up.numel() == 0:
        return swiglu_reference(gate_up)
    return _SwiGLUFunction.apply(gate_up, "triton")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused ``[gate | up]`` tensor: Triton on CUDA, the PyTorch reference elsewhere.

    gate_up ``[..., 2 * I]`` (bf16, fp16 or fp32 take the kernels; float64 the reference);
    returns ``silu(gate) * up``, ``[..., I]`` in gate_up's dtype. Only gate_up is saved for
    backward. Raises ValueError for an odd last dim or a non-float dtype.
    """
    if gate_up.is_cuda and gate_up.dtype in _TRITON_DTYPES:
        return swiglu_triton(gate_up)
    return swiglu_reference(gate_up)
