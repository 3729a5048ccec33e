"""Bidirectional segment attention of the vision tower, on tensor-parallel layers.

Layout (one tp rank): ``x [N, hidden]`` replicated over the tp group (no sequence
parallelism). ``wqkv`` (column-parallel, parts ``[q, k, v]``, bias) gives this rank's
``H / tp`` heads: ``q, k, v [N, H/tp, D]``. q and k are rotated by the 2-D rotary tables
(computed in fp32, the rotation rounded once to v's dtype, as transformers does), every row
attends to all rows of its segment (a frame, or a Qwen2.5-VL window), and the row-parallel
``wo`` (bias added once, after the all-reduce over tp) gives ``[N, hidden]`` again.

Kernels: CUDA fp16/bf16 with a head dim flash takes (``mpcore.parallel.attention.use_flash``) runs, by
default, dense non-causal cuDNN calls on the segments batched by length
(``mpcore.parallel.attention.sdpa_cudnn``), or one non-causal flash varlen call over all segments
(``mpcore.parallel.attention.flash``'s kernel calls); each with an autograd Function here. Everything
else runs ``F.scaled_dot_product_attention`` in the input dtype on the segments batched by
length: one call per distinct segment length.
"""

from __future__ import annotations

from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from mpcore.kernels.host_checked import copy_to
from mpcore.kernels.rope import rope
from mpcore.parallel.attention import flash, sdpa_cudnn, use_flash
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mpcore.parallel.state import ProcessGroup, group_size


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """``positions [N, 2]`` int (h, w) -> ``cos, sin [N, head_dim]`` fp32 on positions' device.

    A quarter of the head dim of frequencies (``theta ** (-4j / head_dim)``) per axis: the
    angles are ``[h * f, w * f]``, repeated for the two halves that "rotate half" pairs.
    """
    half = head_dim // 2
    exponents = torch.arange(0, half, 2, dtype=torch.float32, device=positions.device) / half
    inv_freq = 1.0 / (theta ** exponents)  # (D/4,)
    angles = (positions.float()[:, :, None] * inv_freq).flatten(1)  # (N, D/2): h then w
    angles = torch.cat([angles, angles], dim=-1)  # (N, D)
    return angles.cos(), angles.sin()


class Segments:
    """Attention segments of one forward (frames or windows), from host cumulative lengths.

    ``cu`` and ``max_len`` feed the flash kernel; ``groups`` the batched reference. Each is made
    on ``device`` on first use only (a host-to-device copy), so a path pays for its own.
    """

    def __init__(self, cu_host: torch.Tensor, max_len: int, device: torch.device):
        self.cu_host, self.max_len, self.device = cu_host, max_len, device

    @cached_property
    def cu(self) -> torch.Tensor:
        """``[S+1]`` int32 on the device."""
        return copy_to(self.cu_host, self.device)

    @cached_property
    def groups(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per distinct segment length L, the rows of its B segments ``[B, L]`` int64; and the
        inverse permutation ``[N]`` taking the groups' concatenated rows back to row order."""
        starts, lengths = self.cu_host[:-1].long(), self.cu_host.diff().long()
        rows = []
        for length in torch.unique(lengths).tolist():
            first = starts[lengths == length]
            rows.append(first[:, None] + torch.arange(length))
        inverse = torch.argsort(torch.cat([r.flatten() for r in rows])) if rows else starts
        return [copy_to(r, self.device) for r in rows], copy_to(inverse, self.device)


def attention_reference(q, k, v, segments: Segments, scale: float) -> torch.Tensor:
    """``q, k, v [N, H, D]`` -> ``[N, H, D]``, each row attending to its segment's rows; SDPA in
    the input dtype, one call per distinct segment length. Differentiable."""
    rows, inverse = segments.groups
    if not rows:
        return torch.zeros_like(q)
    parts = []
    for index in rows:
        b, length = index.shape
        qs, ks, vs = (t[index.flatten()].view(b, length, *t.shape[1:]).transpose(1, 2)
                      for t in (q, k, v))  # (B, H, L, D)
        out = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        parts.append(out.transpose(1, 2).reshape(b * length, *q.shape[1:]))
    return torch.cat(parts).index_select(0, inverse)


class _FlashSegments(torch.autograd.Function):
    """forward: one non-causal flash varlen call (each row sees its whole segment);
    backward: the flash backward of that call, from the saved output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        out, lse = flash.flash_forward(q, k, v, cu, cu, max_len, max_len, False, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = flash.flash_backward(dout.contiguous(), q, k, v, out, lse, cu, cu,
                                          ctx.max_len, ctx.max_len, False, ctx.scale)
        return dq, dk, dv, None, None, None


class _CudnnSegments(torch.autograd.Function):
    """forward: the segments batched by length, one dense non-causal cuDNN call per length
    (``mpcore.parallel.attention.sdpa_cudnn``); backward: cuDNN's backward of each call, from its
    saved output and log-sum-exp. Rows are gathered per length and put back in row order."""

    @staticmethod
    def forward(ctx, q, k, v, segments: Segments, scale: float):
        rows, inverse = segments.groups
        saved, outs = [], []
        for index in rows:
            length, flat = index.shape[1], index.flatten()
            qs, ks, vs = (t.index_select(0, flat) for t in (q, k, v))  # (B * L, H, D)
            out, lse = sdpa_cudnn.sdpa_cudnn_forward(qs, ks, vs, None, None, length, length,
                                                     False, scale)
            saved += [qs, ks, vs, out, lse]
            outs.append(out)
        ctx.save_for_backward(*saved)
        ctx.rows, ctx.inverse, ctx.scale = rows, inverse, scale
        return torch.cat(outs).index_select(0, inverse)

    @staticmethod
    def backward(ctx, dout):
        saved, grads = ctx.saved_tensors, [[], [], []]
        order = torch.cat([index.flatten() for index in ctx.rows])
        dout = dout.index_select(0, order)  # rows in the groups' order
        start = 0
        for g, index in enumerate(ctx.rows):
            qs, ks, vs, out, lse = saved[5 * g:5 * g + 5]
            length, num = index.shape[1], index.numel()
            parts = sdpa_cudnn.sdpa_cudnn_backward(dout[start:start + num], qs, ks, vs, out,
                                                   lse, None, None, length, length, False,
                                                   ctx.scale)
            for acc, part in zip(grads, parts, strict=True):
                acc.append(part)
            start += num
        dq, dk, dv = (torch.cat(acc).index_select(0, ctx.inverse) for acc in grads)
        return dq, dk, dv, None, None


KERNELS = ("auto", "flash", "cudnn")


def segment_attention(q, k, v, segments: Segments, scale: float,
                      kernel: str = "auto") -> torch.Tensor:
    """Bidirectional attention inside segments: ``q, k, v [N, H, D]`` -> ``[N, H, D]`` in q's
    dtype. On CUDA fp16/bf16 (a head dim flash takes) ``kernel`` picks ``flash`` (one
    non-causal varlen call over all segments) or ``cudnn`` (dense cuDNN calls, one per distinct
    segment length); ``auto`` is cudnn: a Qwen2-VL-2B training step on an H200 took 562.6 ms
    with it, 574.8 ms with flash (tests/perf/results/vl_h200*.json; head dim 80, images of
    1.7k-5.4k patches), at 1.4 GiB more peak (the per-length gathers are saved for backward).
    A VL model resolves ``auto`` per family first (``VisionLanguageModel.auto_vision_attention``):
    Qwen3.5-0.8B's host-bound step runs flash. Elsewhere the batched SDPA reference."""
    if kernel not in KERNELS:
        raise ValueError(f"vision attention kernel must be one of {KERNELS}, got {kernel!r}")
    if q.shape[0] == 0:
        return torch.zeros_like(q)
    if use_flash(q) and kernel in ("auto", "cudnn"):
        return _CudnnSegments.apply(q, k, v, segments, scale)
    if use_flash(q):
        return _FlashSegments.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                    segments.cu, segments.max_len, scale)
    return attention_reference(q, k, v, segments, scale)


class VisionAttention(nn.Module):
    """Self-attention of one vision block (module docstring); heads sharded over ``tp_group``.
    ``cfg``: a family's vision config (``hidden_size``, ``num_heads``, ``head_dim``);
    ``qkv_bias`` / ``out_bias``: biases on wqkv / wo (GLM-4V: configurable / none)."""

    def __init__(self, cfg, *, tp_group: ProcessGroup | None, device=None,
                 dtype=None, qkv_bias: bool = True, out_bias: bool = True):
        super().__init__()
        hid, tp = cfg.hidden_size, group_size(tp_group)
        self.head_dim, self.num_local_heads = cfg.head_dim, cfg.num_heads // tp
        self.wqkv = ColumnParallelLinear(hid, 3 * hid, bias=qkv_bias, group=tp_group,
                                         partition_sizes=[hid, hid, hid], device=device,
                                         dtype=dtype)
        self.wo = RowParallelLinear(hid, hid, bias=out_bias, group=tp_group, device=device,
                                    dtype=dtype)
        self.kernel = "auto"  # segment_attention's CUDA kernel (VisionTower's attention_kernel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments) -> torch.Tensor:
        """``x [N, hidden]``, ``cos, sin [N, D]`` fp32 -> ``[N, hidden]`` (summed over tp)."""
        num, heads, d = x.shape[0], self.num_local_heads, self.head_dim
        q, k, v = self.wqkv(x).view(num, 3, heads, d).unbind(1)  # (N, H/tp, D) each
        v = v.contiguous()  # its own storage: saved alone, not as a view of the fused output
        q = rope(q, cos, sin, v.dtype)
        k = rope(k, cos, sin, v.dtype)
        out = segment_attention(q, k, v, segments, d ** -0.5, self.kernel)
        return self.wo(out.reshape(num, heads * d))
