"""Triton row kernels of the fused linear + cross-entropy / log-prob heads.

Layout: one chunk of logits ``[n, V_local]`` (row-major, row stride ``stride_logits``), the rows
of a token chunk against this rank's vocab shard. Columns at or past ``n_valid_cols`` are vocab
padding: they take no part in the softmax and get a zero gradient. ``tgt [n]`` (int32) holds the
label's column in this shard, or -1 when the label lives on another rank or is ignored.
All arithmetic is fp32 on ``z = logits * inv_temp``. One program handles one row, streaming it
in ``BLOCK`` (up to 8192) columns at a time: the pass is memory bound, so the point is to read
each logit once per pass and write each gradient once.

Three entry points, same math as the PyTorch reference ``_lce_chunks.TorchRows``:
    row_stats        -> stats [4, n] fp32: max m, sum exp(z - m), target z, sum exp(z - m)(z - m)
    row_grad         writes d(out)/d(logits) given the global lse (and E_p[z] for entropy)
    row_stats_and_grad  both in one launch, for a single shard (the local stats are global)

The gradient may be written over the logits it is computed from (``grad`` a view of the same
memory): each program reads a block of its own row before writing the same or an earlier part
of that row, so an fp32 row can hold its own bf16 gradient in its first half.
"""

from __future__ import annotations

import torch

from mpcore.kernels._triton import tl, triton

_MAX_BLOCK = 8192


@triton.jit
def _lce_rows_kernel(
    logits_ptr, stride_logits, grad_ptr, stride_grad, tgt_ptr, stats_ptr, stride_stats,
    lse_ptr, ez_ptr, glp_ptr, gent_ptr,
    n_cols, n_valid_cols, inv_temp,
    BLOCK: tl.constexpr, STATS: tl.constexpr, GRAD: tl.constexpr, ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    tgt = tl.load(tgt_ptr + row)
    offs = tl.arange(0, BLOCK)

    if STATS:
        # Online max / sum-exp over the valid columns; w is sum exp(z - m) * (z - m), kept
        # relative to the running max so the entropy never subtracts two large numbers.
        m = float("-inf")
        s = 0.0
        w = 0.0
        for start in range(0, n_valid_cols, BLOCK):
            cols = start + offs
            mask = cols < n_valid_cols
            z = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            z = z * inv_temp
            m_new = tl.maximum(m, tl.max(z, 0))
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new)
            if ENTROPY:
                shift = tl.where(s > 0, m - m_new, 0.0)
                w = alpha * (w + shift * s) + tl.sum(e * tl.where(mask, z - m_new, 0.0), 0)
            s = s * alpha + tl.sum(e, 0)
            m = m_new
        t = tl.load(logits_row + tl.maximum(tgt, 0), mask=tgt >= 0, other=0.0).to(tl.float32)
        t = t * inv_temp
        tl.store(stats_ptr + row, m)
        tl.store(stats_ptr + stride_stats + row, s)
        tl.store(stats_ptr + 2 * stride_stats + row, t)
        tl.store(stats_ptr + 3 * stride_stats + row, w)

    if GRAD:
        if STATS:
            lse = m + tl.log(s)
        else:
            lse = tl.load(lse_ptr + row)
        a = tl.load(glp_ptr + row)
        if ENTROPY:
            ez = tl.load(ez_ptr + row)
            b = tl.load(gent_ptr + row)
        grad_row = grad_ptr + row * stride_grad
        # d logprob / dz = onehot - p;  d entropy / dz = p * (E_p[z] - z);  d / dlogits = / T.
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            valid = cols < n_valid_cols
            z = tl.load(logits_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
            z = z * inv_temp
            p = tl.exp(z - lse)
            g = tl.where(cols == tgt, a, 0.0) - a * p
            if ENTROPY:
                g += b * p * tl.where(valid, ez - z, 0.0)
            g = g * inv_temp
            tl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _scale_kernel(x_ptr, y_ptr, scale_ptr, n, BLOCK: tl.constexpr, IN_PLACE: tl.constexpr):
    s = tl.load(scale_ptr)
    # In place, the common upstream gradient 1.0 costs one launch of empty programs.
    if (s != 1.0) or (not IN_PLACE):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        tl.store(y_ptr + offs, (x * s).to(y_ptr.dtype.element_ty), mask=mask)


def _scale_launch(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> None:
    assert x.is_contiguous() and y.is_contiguous() and scale.numel() == 1
    n = x.numel()
    if n:
        block = 8192
        _scale_kernel[(triton.cdiv(n, block),)](x, y, scale, n, BLOCK=block, IN_PLACE=x is y,
                                                num_warps=8)


def scale_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """``x *= scale`` in place (x contiguous, scale a 0-d fp32 tensor), without a host sync."""
    _scale_launch(x, x, scale)


def scale_to(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(x * scale)`` written as a new ``dtype`` tensor in one pass (the product in fp32, then
    rounded once to ``dtype``); x contiguous, scale a 0-d fp32 tensor; no host sync."""
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    _scale_launch(x, y, scale)
    return y


def _block(n_cols: int, block: int | None) -> int:
    if block is not None:
        return block
    return max(16, min(_MAX_BLOCK, triton.next_power_of_2(max(1, n_cols))))


def _launch(logits, grad, tgt, stats, lse, ez, g_lp, g_ent, n_valid_cols, inv_temp, *,
            stats_mode, grad_mode, entropy, block, num_warps=None):
    n, n_cols = logits.shape
    if n == 0:
        return
    assert logits.stride(1) == 1 and tgt.dtype == torch.int32
    assert grad is None or (grad.shape == logits.shape and grad.stride(1) == 1)
    blk = _block(n_cols, block)
    dummy = tgt
    _lce_rows_kernel[(n,)](
        logits, logits.stride(0),
        dummy if grad is None else grad, 0 if grad is None else grad.stride(0),
        tgt,
        dummy if stats is None else stats, 0 if stats is None else stats.stride(0),
        dummy if lse is None else lse, dummy if ez is None else ez,
        dummy if g_lp is None else g_lp, dummy if g_ent is None else g_ent,
        n_cols, n_valid_cols, float(inv_temp),
        BLOCK=blk, STATS=stats_mode, GRAD=grad_mode, ENTROPY=entropy,
        num_warps=num_warps or (16 if blk >= 8192 else 8 if blk >= 2048 else 4),
    )


def row_stats(logits: torch.Tensor, tgt: torch.Tensor, n_valid_cols: int, inv_temp: float,
              with_entropy: bool, *, block: int | None = None,
              num_warps: int | None = None) -> torch.Tensor:
    """Per-row ``[4, n]`` fp32 stats (m, s, t, w) of one logits chunk; w is 0 without entropy."""
    n = logits.shape[0]
    stats = torch.zeros(4, n, dtype=torch.float32, device=logits.device)
    _launch(logits, None, tgt, stats, None, None, None, None, n_valid_cols, inv_temp,
            stats_mode=True, grad_mode=False, entropy=with_entropy, block=block,
            num_warps=num_warps)
    return stats


def row_grad(logits: torch.Tensor, grad: torch.Tensor, tgt: torch.Tensor, lse: torch.Tensor,
             ez: torch.Tensor | None, g_lp: torch.Tensor, g_ent: torch.Tensor | None,
             n_valid_cols: int, inv_temp: float, *, block: int | None = None,
             num_warps: int | None = None) -> None:
    """Write ``grad = g_lp * dlogprob/dlogits + g_ent * dentropy/dlogits`` (fp32 row inputs)."""
    entropy = g_ent is not None
    _launch(logits, grad, tgt, None, lse, ez if entropy else None, g_lp, g_ent, n_valid_cols,
            inv_temp, stats_mode=False, grad_mode=True, entropy=entropy, block=block,
            num_warps=num_warps)


def row_stats_and_grad(logits: torch.Tensor, grad: torch.Tensor, tgt: torch.Tensor,
                       g_lp: torch.Tensor, n_valid_cols: int, inv_temp: float, *,
                       block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``row_stats`` then ``row_grad`` (log-prob term only) from the local stats, one launch."""
    n = logits.shape[0]
    stats = torch.zeros(4, n, dtype=torch.float32, device=logits.device)
    _launch(logits, grad, tgt, stats, None, None, g_lp, None, n_valid_cols, inv_temp,
            stats_mode=True, grad_mode=True, entropy=False, block=block,
            num_warps=num_warps)
    return stats
