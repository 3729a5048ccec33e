"""Fused rotary position embedding (RoPE) of one tensor, forward and backward in one pass each.

Layout: ``x [T, H, D]`` (tokens, heads, head_dim; D even), ``cos, sin [T, D]`` (one row per
token, shared by all heads). The rotation is the "rotate half" form of Hugging Face's Llama:
pairs ``(x[i], x[i + D/2])``, with ``rot(x) = cat(-x[D/2:], x[:D/2])``.

Math, in float32 (float64 when x or the tables are float64), rounded once to the output dtype:

    y  = x * cos + rot(x) * sin                           (out_dtype)
    dx = dy * cos + rot^T(dy * sin)                       (x's dtype)
    rot^T(z) = cat(z[D/2:], -z[:D/2])

The tables are constants (positions are data, not parameters): they are never differentiated,
and they are the only tensors saved for backward ([T, D], H times smaller than x), as in eager.
What the fused op saves is time and peak memory: eager ``x * cos[:, None] + rot(x) *
sin[:, None]`` followed by ``.to(out_dtype)`` runs about six elementwise kernels per tensor and,
when bf16 activations meet fp32 tables under autocast, allocates three fp32 [T, H, D]
temporaries at once; the fused op reads x once and writes y once.

Rounding: the PyTorch reference upcasts x and the tables, does eager's multiplies and add in
the compute dtype and casts once, so for fp32 x or bf16 x with fp32 tables (training under
autocast) it is bitwise equal to eager followed by ``.to(out_dtype)``. The Triton kernels do
the same math, but the compiler may fuse a multiply-add: the fp32 value then differs from
eager's by up to ``2^-22 (|p| + |q|)`` (p, q the two products), so the rounded outputs agree
to one ulp of the output dtype except where p and q nearly cancel, where that fp32 difference
can be several ulps of the (small) result. Both are equally accurate approximations of the
exact rotation; neither rounding order is the wrong one.

Kernels: a 3D grid of programs over tiles of [BLOCK_T tokens, BLOCK_H heads, BLOCK_D columns
of the first half]; each program loads its columns in both halves of D (and each table row
once for all its heads), rotates and stores both halves. CUDA tensors run the Triton kernels;
other devices (and float64) the PyTorch reference. Both sit behind the same autograd.Function,
and the two passes are ``torch.library.custom_op``s (namespace ``mpcore``), so ``torch.compile``
traces ``rope`` without a graph break; eager calls skip the op's dispatch
(``mpcore.kernels._triton.eager_or_op``).
"""

from __future__ import annotations

import torch

from mpcore.kernels._triton import eager_or_op, tl, triton

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_table(ptrs, mask):
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)[:, None, :]


@triton.jit
def _rotate_tile(
    in_ptr, out_ptr, cos_ptr, sin_ptr, in_stride_t, in_stride_h, out_stride_t, out_stride_h,
    table_stride, num_tokens, num_heads, half,
    TRANSPOSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out = in * cos + rot(in) * sin (rot^T when TRANSPOSE) on this program's tile, in fp32."""
    # int64 token and head indices: offsets pass 2^31 elements on long packed sequences.
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.program_id(2).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    table_mask = (toks < num_tokens)[:, None] & (cols < half)[None, :]  # (BT, BD)
    mask = table_mask[:, None, :] & (heads < num_heads)[None, :, None]  # (BT, BH, BD)

    table_offs = toks[:, None] * table_stride + cols[None, :]
    c1 = _load_table(cos_ptr + table_offs, table_mask)  # (BT, 1, BD), shared by the heads
    c2 = _load_table(cos_ptr + table_offs + half, table_mask)
    s1 = _load_table(sin_ptr + table_offs, table_mask)
    s2 = _load_table(sin_ptr + table_offs + half, table_mask)

    tok_offs, head_offs = toks[:, None, None], heads[None, :, None]
    in_offs = tok_offs * in_stride_t + head_offs * in_stride_h + cols[None, None, :]
    a1 = tl.load(in_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    a2 = tl.load(in_ptr + in_offs + half, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:  # dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        o1 = a1 * c1 + a2 * s2
        o2 = a2 * c2 - a1 * s1
    else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        o1 = a1 * c1 - a2 * s1
        o2 = a2 * c2 + a1 * s2
    out_offs = tok_offs * out_stride_t + head_offs * out_stride_h + cols[None, None, :]
    tl.store(out_ptr + out_offs, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + out_offs + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every token count
def _rope_fwd_kernel(
    x_ptr, y_ptr, cos_ptr, sin_ptr, x_stride_t, x_stride_h, y_stride_t, y_stride_h,
    table_stride, num_tokens, num_heads, half,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    _rotate_tile(x_ptr, y_ptr, cos_ptr, sin_ptr, x_stride_t, x_stride_h, y_stride_t, y_stride_h,
                 table_stride, num_tokens, num_heads, half, False, BLOCK_T, BLOCK_H, BLOCK_D)


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_bwd_kernel(
    dy_ptr, dx_ptr, cos_ptr, sin_ptr, dy_stride_t, dy_stride_h, dx_stride_t, dx_stride_h,
    table_stride, num_tokens, num_heads, half,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    _rotate_tile(dy_ptr, dx_ptr, cos_ptr, sin_ptr, dy_stride_t, dy_stride_h, dx_stride_t,
                 dx_stride_h, table_stride, num_tokens, num_heads, half, True, BLOCK_T, BLOCK_H,
                 BLOCK_D)


def _tile(num_heads: int, half: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_D): about 2048 elements per half on CUDA (all heads of a token
    at head_dim 128 and 32 heads), at most 128 columns. Under the CPU interpreter small tiles,
    so the tests walk ragged token, head and column tails."""
    max_elems, max_heads, max_cols = (2048, 64, 128) if device.type == "cuda" else (64, 2, 16)
    block_d = min(triton.next_power_of_2(half), max_cols)
    block_h = min(triton.next_power_of_2(num_heads), max_heads, max(1, max_elems // block_d))
    return max(1, max_elems // (block_h * block_d)), block_h, block_d


def _rotate_triton(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   out_dtype: torch.dtype, kernel) -> torch.Tensor:
    num_tokens, num_heads, head_dim = src.shape
    half = head_dim // 2
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=out_dtype, device=src.device)
    block_t, block_h, block_d = _tile(num_heads, half, src.device)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads, block_h),
            triton.cdiv(half, block_d))
    kernel[grid](
        src, out, cos, sin, src.stride(0), src.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), num_tokens, num_heads, half,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any operand is float64, else float32."""
    compute = torch.float32
    for dtype in dtypes:
        compute = torch.promote_types(compute, dtype)
    return compute


def _fwd_torch(x, cos, sin, out_dtype):
    compute = _compute_dtype(x.dtype, cos.dtype)
    x, cos, sin = x.to(compute), cos.to(compute)[:, None, :], sin.to(compute)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # Eager's ops in eager's order, so the one rounding below gives eager's bits.
    return (x * cos + rotated * sin).to(out_dtype)


def _bwd_torch(dy, cos, sin, x_dtype):
    compute = _compute_dtype(x_dtype, cos.dtype)
    dy, cos, sin = dy.to(compute), cos.to(compute)[:, None, :], sin.to(compute)[:, None, :]
    half = dy.shape[-1] // 2
    z = dy * sin
    return (dy * cos + torch.cat([z[..., half:], -z[..., :half]], dim=-1)).to(x_dtype)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype,
              impl: str) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D], all with unit last stride -> y [T, H, D] in out_dtype."""
    if impl == "triton":
        return _rotate_triton(x, cos, sin, out_dtype, _rope_fwd_kernel)
    return _fwd_torch(x, cos, sin, out_dtype)


_rope_fwd_op = torch.library.custom_op("mpcore::rope_fwd", _rope_fwd, mutates_args=())


@_rope_fwd_op.register_fake
def _(x, cos, sin, out_dtype, impl):
    return x.new_empty(x.shape, dtype=out_dtype)


def _rope_bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_dtype: torch.dtype,
              impl: str) -> torch.Tensor:
    """dy [T, H, D], cos/sin [T, D], all with unit last stride -> dx [T, H, D] in x_dtype."""
    if impl == "triton":
        return _rotate_triton(dy, cos, sin, x_dtype, _rope_bwd_kernel)
    return _bwd_torch(dy, cos, sin, x_dtype)


_rope_bwd_op = torch.library.custom_op("mpcore::rope_bwd", _rope_bwd, mutates_args=())


@_rope_bwd_op.register_fake
def _(dy, cos, sin, x_dtype, impl):
    return dy.new_empty(dy.shape, dtype=x_dtype)


class _RopeFunction(torch.autograd.Function):
    """forward: y = x * cos + rot(x) * sin; backward: dx = dy * cos + rot^T(dy * sin)."""

    @staticmethod
    def forward(ctx, x, cos, sin, out_dtype, impl):
        cos, sin = _unit_stride(cos), _unit_stride(sin)
        ctx.save_for_backward(cos, sin)  # the only tensors kept: not x, not y
        ctx.x_dtype, ctx.impl = x.dtype, impl
        return eager_or_op(_rope_fwd_op, _rope_fwd, _unit_stride(x), cos, sin, out_dtype, impl)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dx = eager_or_op(_rope_bwd_op, _rope_bwd, _unit_stride(dy), cos, sin, ctx.x_dtype,
                         ctx.impl)
        return dx, None, None, None, None


def _check_inputs(x, cos, sin, out_dtype) -> torch.dtype:
    """Raise ValueError naming the fix for a bad input; return the output dtype."""
    if x.dim() != 3:
        raise ValueError(f"rope: x must be [T, heads, head_dim]; got shape {tuple(x.shape)}."
                         " Reshape it with .view(T, heads, head_dim).")
    num_tokens, _, head_dim = x.shape
    if head_dim == 0 or head_dim % 2 != 0:
        raise ValueError(f"rope: head_dim must be even and positive (pairs x[i], x[i + D/2]);"
                         f" got x of shape {tuple(x.shape)}.")
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (num_tokens, head_dim):
            raise ValueError(f"rope: {name} must be [T, head_dim] = {(num_tokens, head_dim)} for x"
                             f" of shape {tuple(x.shape)}; got {tuple(table.shape)}.")
        if table.requires_grad:
            raise ValueError(f"rope: {name} requires grad, but the tables are not differentiated."
                             f" Pass {name}.detach() (or build the tables under torch.no_grad).")
        if table.device != x.device:
            raise ValueError(f"rope: {name} is on {table.device} but x on {x.device};"
                             " move the tables to x's device.")
    if not (x.is_floating_point() and cos.is_floating_point()):
        raise ValueError(f"rope: x and the tables must be floating point; got x {x.dtype},"
                         f" cos {cos.dtype}. Cast them to bfloat16, float16 or float32.")
    if cos.dtype != sin.dtype:
        raise ValueError(f"rope: cos and sin must share a dtype; got {cos.dtype} and {sin.dtype}."
                         " Build both tables in one dtype.")
    out_dtype = torch.result_type(x, cos) if out_dtype is None else out_dtype
    if not out_dtype.is_floating_point:
        raise ValueError(f"rope: out_dtype must be a floating-point dtype; got {out_dtype}.")
    return out_dtype


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x * cos + rot(x) * sin`` in plain PyTorch, through the same autograd.Function as the
    kernels. Same contract as ``rope``, for any floating dtypes."""
    out_dtype = _check_inputs(x, cos, sin, out_dtype)
    return _RopeFunction.apply(x, cos, sin, out_dtype, "torch")


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``rope`` through the Triton kernels, whatever the device (CPU tensors need
    TRITON_INTERPRET=1). Same contract as ``rope``, for fp32, fp16 and bf16 only."""
    out_dtype = _check_inputs(x, cos, sin, out_dtype)
    if any(dtype not in _TRITON_DTYPES for dtype in (x.dtype, cos.dtype, out_dtype)):
        raise ValueError(f"rope: the Triton kernels take float32, float16 or bfloat16; got x"
                         f" {x.dtype}, tables {cos.dtype}, out_dtype {out_dtype}."
                         " Use rope_reference for other dtypes.")
    if x.numel() == 0:
        return rope_reference(x, cos, sin, out_dtype)
    return _RopeFunction.apply(x, cos, sin, out_dtype, "triton")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``cos, sin [T, D]``: Triton on CUDA, PyTorch reference elsewhere.

    Returns ``x * cos + rot(x) * sin``, ``[T, H, D]`` in ``out_dtype`` (default
    ``torch.result_type(x, cos)``, what eager produces), computed in float32 (float64 if x or
    the tables are float64) and rounded once. Differentiable in x only (the gradient is in x's
    dtype); only cos and sin are saved for backward. Raises ValueError for bad shapes, dtypes,
    devices, or tables that require grad.
    """
    dtypes = (x.dtype, cos.dtype, out_dtype or torch.result_type(x, cos))
    if x.is_cuda and all(dtype in _TRITON_DTYPES for dtype in dtypes):
        return rope_triton(x, cos, sin, out_dtype)
    return rope_reference(x, cos, sin, out_dtype)
