"""GQA self-attention on tensor-parallel layers, through the context-parallel attention interface.

Layout (one tp rank, one cp rank): input ``x [L, hidden]`` (``[L / tp, hidden]`` under sequence
parallelism), L = this cp rank's local tokens. The fused projection ``wqkv`` (column-parallel,
parts ``[q, k, v]``) gives this rank's ``H / tp`` query heads and its kv heads on all L tokens:
``q [L, H/tp, D]``, ``k, v [L, H_kv_local, D]``. Optional Qwen3 QK-norm (RMSNorm over D, before
RoPE), RoPE by the tokens' own position ids, causal attention inside each document across the cp
group (``ring``/``ulysses``/``none``), and the row-parallel ``wo`` back to ``[L, hidden]`` (or
``[L / tp, hidden]`` under SP).

KV heads (see ``ModelConfig``): sharded ``H_kv / tp`` per rank when tp divides H_kv; otherwise
each rank holds the one kv head its query heads read, a replica shared by ``tp / H_kv`` ranks.
Replicas get different gradients (from different query heads); the logical gradient is their
sum, so ``_SumOverReplicas`` all-reduces it over the tp group in the backward and every replica
receives the same update.
"""

from __future__ import annotations

import torch
from torch import nn

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.norm import RMSNorm
from mpcore.models.common.rope import apply_rope
from mpcore.parallel.attention import AttentionPlan, context_attention
from mpcore.parallel.collectives import all_reduce, copy_to_tp, sp_all_gather
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear, linear
from mpcore.parallel.random import init_shard_, normal_init
from mpcore.parallel.state import ProcessGroup, group_size


def qkv_rows(cfg: ModelConfig, tp: int, rank: int) -> tuple[slice, slice]:
    """Rows of the logical q and k (= v) projections held by tp rank ``rank``.

    Query rows: an equal slice of ``num_heads * head_dim``. KV rows: an equal slice when tp
    divides ``num_kv_heads``, else the one kv head read by this rank's query heads.
    """
    d = cfg.head_dim
    q_local = cfg.q_size // tp
    q = slice(rank * q_local, (rank + 1) * q_local)
    if cfg.num_kv_heads % tp == 0:
        kv_local = cfg.kv_size // tp
        return q, slice(rank * kv_local, (rank + 1) * kv_local)
    head = rank // (tp // cfg.num_kv_heads)
    return q, slice(head * d, (head + 1) * d)


class _SumOverReplicas(torch.autograd.Function):
    """forward: identity on ``[q_local + 2 * D, ...]``; backward: the kv rows' gradient summed
    over the tp ranks that hold the same kv head (one all-reduce of ``[H_kv, 2D, ...]`` over the
    tp group, each rank contributing at its head's slot)."""

    @staticmethod
    def forward(ctx, w, q_local, head, num_kv_heads, group):
        ctx.args = (q_local, head, num_kv_heads, group)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        q_local, head, num_kv_heads, group = ctx.args
        kv = grad[q_local:]
        slots = kv.new_zeros((num_kv_heads, *kv.shape))
        slots[head] = kv
        slots = all_reduce(slots, group)
        return torch.cat([grad[:q_local], slots[head]]), None, None, None, None


class QKVProjection(ColumnParallelLinear):
    """Fused ``[q; k; v]`` column-parallel projection; local rows ``[q_r; k_r; v_r]``.

    ``x [L, hidden]`` (``[L / tp, hidden]`` under SP) -> ``[L, (H / tp + 2 * H_kv_local) * D]``.
    """

    def __init__(self, cfg: ModelConfig, *, group: ProcessGroup | None,
                 sequence_parallel: bool, fp8: str = "none", device=None, dtype=None,
                 query_factor: int = 1):
        tp = group_size(group)
        kv_all = cfg.local_kv_heads(tp) * tp * cfg.head_dim  # replicas counted
        q_size = cfg.q_size * query_factor
        super().__init__(cfg.hidden_size, q_size + 2 * kv_all, bias=cfg.qkv_bias,
                         group=group, sequence_parallel=sequence_parallel,
                         partition_sizes=[q_size, kv_all, kv_all], fp8=fp8, device=device,
                         dtype=dtype)
        # query_factor: rows per query head in units of head_dim (2 when each head also
        # yields an output gate, Qwen3.5); heads stay whole on each rank either way.
        self.cfg, self.q_size = cfg, q_size
        self.replicated = cfg.num_kv_heads % tp != 0

    def _take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's ``[q_r; k_r; v_r]`` rows of a logical ``[q; k; v]`` tensor."""
        q_full, k_full, v_full = full.split([self.q_size, self.cfg.kv_size, self.cfg.kv_size])
        q, kv = qkv_rows(self.cfg, self.tp, self.tp_rank)
        factor = self.q_size // self.cfg.q_size
        q = slice(q.start * factor, q.stop * factor)
        return torch.cat([q_full[q], k_full[kv], v_full[kv]])

    def reset_parameters(self, seed: int) -> None:
        full_rows = self.q_size + 2 * self.cfg.kv_size
        init_shard_(self.weight, (full_rows, self.in_features), self._take,
                    normal_init(self.init_std), seed)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def _replica_sum(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not self.replicated:
            return t
        head = self.tp_rank // (self.tp // self.cfg.num_kv_heads)
        return _SumOverReplicas.apply(t, self.q_size // self.tp, head,
                                      self.cfg.num_kv_heads, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = sp_all_gather(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        return linear(x, self._replica_sum(self.weight), self._replica_sum(self.bias),
                      self.fp8, self.gemm)


class Attention(nn.Module):
    """Self-attention of one decoder layer (module docstring). ``tp_group`` shards heads; the
    cp group, mode and attention backend come with the forward's ``AttentionPlan``; ``fp8``
    (``mpcore.parallel.layers``) is the recipe of ``wqkv`` and ``wo``."""

    def __init__(self, cfg: ModelConfig, *, tp_group: ProcessGroup | None,
                 sequence_parallel: bool, fp8: str = "none", device=None, dtype=None):
        super().__init__()
        tp = group_size(tp_group)
        self.head_dim, self.rope_style = cfg.head_dim, cfg.rope_style
        self.num_local_heads = cfg.num_heads // tp
        self.num_local_kv_heads = cfg.local_kv_heads(tp)
        self.wqkv = QKVProjection(cfg, group=tp_group, sequence_parallel=sequence_parallel,
                                  fp8=fp8, device=device, dtype=dtype)
        self.wo = RowParallelLinear(cfg.q_size, cfg.hidden_size, group=tp_group,
                                    sequence_parallel=sequence_parallel, fp8=fp8, device=device,
                                    dtype=dtype)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            # Each tp rank normalises different heads: the weight's gradient is a sum over tp.
            norm = dict(group=tp_group, sum_grad_over_tp=tp > 1, device=device, dtype=dtype)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        """``x [L(/tp), hidden]``, ``cos, sin [L, D]``, ``plan``: the attention metadata of the
        L local tokens (made once per forward by the model, with this layer's cp group and
        mode) -> ``[L(/tp), hidden]``."""
        d = self.head_dim
        q_width, kv_width = self.num_local_heads * d, self.num_local_kv_heads * d
        q, k, v = self.wqkv(x).split([q_width, kv_width, kv_width], dim=-1)
        q = q.view(q.shape[0], self.num_local_heads, d)  # (L, H/tp, D)
        k = k.view(k.shape[0], self.num_local_kv_heads, d)  # (L, H_kv_local, D)
        # v gets storage of its own: saved for backward as a view, it would keep the whole
        # fused [L, q + 2 kv] output alive (q and k are rotated into new tensors). The flash
        # path copied v to contiguous memory anyway.
        v = v.contiguous().view(v.shape[0], self.num_local_kv_heads, d)
        if self.q_norm is not None:
            # The norms save their input: a copy of its own, not a view of the fused output
            # (the Triton norm copied these strided views to contiguous rows anyway).
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        # Under autocast the projections are bf16 but fp32 norm weights and rope tables would
        # promote q and k to fp32; attention runs in the projections' dtype, as SDPA would, so
        # the rotation (computed in fp32) is rounded once straight to v's dtype.
        q = apply_rope(q, cos, sin, out_dtype=v.dtype, style=self.rope_style)
        k = apply_rope(k, cos, sin, out_dtype=v.dtype, style=self.rope_style)
        out = context_attention(q, k, v, plan=plan, softmax_scale=d ** -0.5)
        return self.wo(out.reshape(out.shape[0], q_width))
