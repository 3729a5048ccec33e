"""Qwen3.5's decoder block: gated full attention or Gated DeltaNet, then SwiGLU, on TP/SP/CP.

Layout (one tp rank, one cp rank): ``x [L, hidden]`` (``[L / tp, hidden]`` under sequence
parallelism), L = this cp rank's local tokens; every projection is column- or row-parallel as
in ``mpcore.models.common`` (the column-parallel ones all-gather SP tokens, the row-parallel ones sum
or reduce-scatter over tp).

Gated attention (``GatedAttention``, transformers' ``Qwen3_5Attention``): ``wqkv`` gives per
query head ``[query (D) | gate (D)]`` (the layout of the checkpoints' ``q_proj`` rows), then k
and v; zero-centred QK-norm, RoPE on the first ``rotary_dim`` dims of each head, attention
through ``mpcore.parallel.attention`` (ring / Ulysses under cp), ``wo(attn * sigmoid(gate))``.

Gated DeltaNet (``GatedDeltaNet``, transformers' ``Qwen3_5GatedDeltaNet``): ``w_in`` fuses
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (parts ``[q, k, v, z, b, a]``, each
split over tp: rank r holds key heads ``[r Hk/tp, (r+1) Hk/tp)`` and the value heads grouped on
them); ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32 (``A_log``
and ``dt_bias`` sliced with the value heads); the short conv + SiLU over ``[q | k | v]`` and the
delta rule per document (``mpcore.models.common.hybrid.cp``: run order and, under cp, the head all-to-all);
an RMSNorm per value head times ``silu(z)`` (fp32), ``out_proj``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mpcore.models.common.attention import QKVProjection
from mpcore.models.common.hybrid import cp as deltanet_cp
from mpcore.models.common.hybrid import kernels
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.mlp import FeedForward
from mpcore.models.common.norm import RMSNorm, matmul_dtype
from mpcore.models.common.rope import apply_rope
from mpcore.parallel.attention import AttentionPlan, context_attention
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mpcore.parallel.random import init_shard_
from mpcore.parallel.state import ParallelState, ProcessGroup, group_rank, group_size


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate (module docstring); group: tp."""

    def __init__(self, cfg: Qwen35Config, *, tp_group: ProcessGroup | None,
                 sequence_parallel: bool, fp8: str = "none", dtype=None):
        super().__init__()
        tp = group_size(tp_group)
        self.head_dim, self.rotary_dim = cfg.head_dim, cfg.rotary_dim
        self.num_local_heads = cfg.num_heads // tp
        self.num_local_kv_heads = cfg.local_kv_heads(tp)
        self.wqkv = QKVProjection(cfg, group=tp_group, sequence_parallel=sequence_parallel,
                                  fp8=fp8, dtype=dtype, query_factor=2)
        self.wo = RowParallelLinear(cfg.q_size, cfg.hidden_size, group=tp_group,
                                    sequence_parallel=sequence_parallel, fp8=fp8, dtype=dtype)
        norm = dict(group=tp_group, sum_grad_over_tp=tp > 1, zero_centred=True, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **norm)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **norm)

    def _rope(self, x: torch.Tensor, cos, sin, dtype) -> torch.Tensor:
        rot = apply_rope(x[..., :self.rotary_dim].contiguous(), cos, sin, out_dtype=dtype)
        return torch.cat([rot, x[..., self.rotary_dim:].to(dtype)], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        """``x [L(/tp), hidden]``, ``cos, sin [L, rotary_dim]`` -> ``[L(/tp), hidden]``."""
        d, h, hkv = self.head_dim, self.num_local_heads, self.num_local_kv_heads
        qg, k, v = self.wqkv(x).split([2 * h * d, hkv * d, hkv * d], dim=-1)
        qg = qg.view(qg.shape[0], h, 2 * d)  # per head: [query | gate]
        q, gate = qg[..., :d], qg[..., d:].reshape(qg.shape[0], h * d)
        k = k.reshape(k.shape[0], hkv, d)
        v = v.contiguous().view(v.shape[0], hkv, d)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = self._rope(q, cos, sin, v.dtype), self._rope(k, cos, sin, v.dtype)
        out = context_attention(q, k, v, plan=plan, softmax_scale=d ** -0.5)
        return self.wo(out.reshape(out.shape[0], h * d) * torch.sigmoid(gate))


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x)`` per value head, times ``silu(z)`` in fp32, returned in x's dtype
    (transformers' ``Qwen3_5RMSNormGated``); weight ``[Dv]`` starts at one. Each tp rank
    normalises other heads, so its gradient is summed over tp."""

    def __init__(self, dim: int, eps: float, *, group: ProcessGroup | None, dtype=None):
        super().__init__()
        self.norm = RMSNorm(dim, eps, group=group, sum_grad_over_tp=group_size(group) > 1,
                            dtype=dtype)

    def forward(self, x: torch.Tensor, z: torch.Tensor, kernel: str = "reference"
                ) -> torch.Tensor:
        """``x, z [..., dim]`` -> ``[..., dim]`` in x's dtype. ``kernel="fla"``: fla-core's fused
        gated RMSNorm (one pass each way, rounded once at the end, where the reference rounds
        the normalised row before the gate: both within bf16 rounding of transformers')."""
        if kernel == "fla":
            weight = self.norm._weight()  # through copy_to_tp when tp > 1
            return kernels.fla_ops()[2](x, z, weight, None, activation="silu",
                                        eps=self.norm.eps)
        y = self.norm(x)  # weight * normalised x (rounded to x's dtype first), mpcore.kernels.rmsnorm
        return (y.float() * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer (module docstring); group: tp; ``gdn_kernel``:
    ``mpcore.models.common.hybrid.kernels``."""

    def __init__(self, cfg: Qwen35Config, *, tp_group: ProcessGroup | None,
                 sequence_parallel: bool, fp8: str = "none", dtype=None,
                 gdn_kernel: str = "auto"):
        super().__init__()
        tp = group_size(tp_group)
        self.tp, self.tp_rank = tp, group_rank(tp_group)
        self.gdn_kernel = kernels.check_kernel(gdn_kernel)
        kd, vd, hv = cfg.linear_key_size, cfg.linear_value_size, cfg.linear_num_value_heads
        self.num_key_heads, self.num_value_heads = cfg.linear_num_key_heads // tp, hv // tp
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        refusal = kernels.head_refusal(self.key_dim, self.value_dim)
        if gdn_kernel == "fla" and refusal is not None:  # auto falls back at run time, warned
            raise ValueError(f"gdn_kernel='fla' cannot run this model: {refusal}; use "
                             f"gdn_kernel='auto' or 'reference' (the PyTorch reference)")
        self.parts = [kd, kd, vd, vd, hv, hv]  # q, k, v, z, b, a
        self.w_in = ColumnParallelLinear(cfg.hidden_size, sum(self.parts), group=tp_group,
                                         sequence_parallel=sequence_parallel,
                                         partition_sizes=self.parts, fp8=fp8, dtype=dtype)
        self.conv_sizes = [kd // tp, kd // tp, vd // tp]
        self.kernel_size = cfg.linear_conv_kernel_dim
        self.conv_weight = nn.Parameter(torch.empty(sum(self.conv_sizes), 1, self.kernel_size,
                                                    dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(hv // tp, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.empty(hv // tp, dtype=dtype))
        self.norm = GatedRMSNorm(self.value_dim, cfg.rms_norm_eps, group=tp_group, dtype=dtype)
        self.out_proj = RowParallelLinear(vd, cfg.hidden_size, group=tp_group,
                                          sequence_parallel=sequence_parallel, fp8=fp8,
                                          dtype=dtype)
        self.full_sizes = (kd, vd, hv)

    def _shard(self, full: torch.Tensor, parts: list[int]) -> torch.Tensor:
        pieces = full.split(parts)
        return torch.cat([p.chunk(self.tp)[self.tp_rank] for p in pieces])

    def reset_parameters(self, seed: int) -> None:
        """The logical tensors, drawn as transformers' init does: conv like ``nn.Conv1d``
        (uniform, bound 1/sqrt(K)), ``A = U(1, 16)`` stored as ``log A``, ``dt_bias = 1``."""
        kd, vd, hv = self.full_sizes
        bound = 1.0 / math.sqrt(self.kernel_size)
        init_shard_(self.conv_weight, (2 * kd + vd, 1, self.kernel_size),
                    lambda full: self._shard(full, [kd, kd, vd]),
                    lambda t, gen: t.uniform_(-bound, bound, generator=gen), seed)
        init_shard_(self.A_log, (hv,), lambda full: self._shard(full, [hv]),
                    lambda t, gen: t.uniform_(1.0, 16.0, generator=gen).log_(), seed + 1)
        with torch.no_grad():
            self.dt_bias.fill_(1.0)

    def kernel(self, x: torch.Tensor) -> str:
        """``"fla"`` or ``"reference"`` for operands like ``x`` (``kernels.resolve``)."""
        return kernels.resolve(self.gdn_kernel, x, self.key_dim, self.value_dim)

    def describe_kernel(self, device: torch.device | str, dtype: torch.dtype) -> str:
        """The log line naming the kernel that runs for ``dtype`` operands on ``device``."""
        return kernels.describe(self.gdn_kernel, device, dtype, self.key_dim, self.value_dim)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, beta) [L, Hv]`` fp32: the log decay and the write strength."""
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, beta

    def forward(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """``x [L(/tp), hidden]`` -> ``[L(/tp), hidden]``."""
        hk, hv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_dim, self.value_dim
        projected = self.w_in(x)
        sizes = [p // self.tp for p in self.parts]
        q, k, v, z, b, a = projected.split(sizes, dim=-1)
        kernel = self.kernel(projected)
        num, cp = q.shape[0], plan.cp
        g, beta = self._gates(b, a)
        seq = deltanet_cp.sequence_of(plan, x.device)
        if cp == 1:  # no head split: the conv reads [q | k | v] in place (a strided view)
            mixed = projected[:, :sum(sizes[:3])]
        else:
            mixed, gates = deltanet_cp.heads_split(
                [q.reshape(num, hk, dk), k.reshape(num, hk, dk), v.reshape(num, hv, dv)],
                torch.stack([g, beta], dim=-1), plan, seq)  # (N, C/cp), (N, Hv/cp, 2)
            g, beta = gates[..., 0], gates[..., 1]
        weight = deltanet_cp.rank_channels(self.conv_weight[:, 0], self.conv_sizes, plan)
        mixed = kernels.short_conv(mixed, weight, seq.positions, seq.cu_seqlens, kernel,
                                   seq.cu_host)
        qc, kc, vc = mixed.split([s // cp for s in self.conv_sizes], dim=-1)
        n = mixed.shape[0]
        core = kernels.gated_delta_rule(
            qc.reshape(n, hk // cp, dk), kc.reshape(n, hk // cp, dk), vc.reshape(n, hv // cp, dv),
            g, beta.to(vc.dtype), seq.cu_seqlens, kernel, seq.cu_host)
        core = deltanet_cp.tokens_split(core, plan, seq)  # (L, Hv, Dv)
        out = self.norm(core, z.reshape(num, hv, dv), kernel)
        return self.out_proj(out.reshape(num, hv * dv))


class Qwen35Block(nn.Module):
    """Pre-norm residual block (``DecoderLayer``'s protocol): the mixer of ``layer_types[index]``
    then SwiGLU; zero-centred norms. ``gdn_kernel``: the DeltaNet kernels."""

    def __init__(self, cfg: Qwen35Config, state: ParallelState, *, sequence_parallel: bool,
                 fp8: str = "none", dtype=None, index: int = 0, gdn_kernel: str = "auto"):
        super().__init__()
        self.layer_type = cfg.layer_types[index]
        norm = dict(group=state.tp_group, sum_grad_over_tp=sequence_parallel and state.tp > 1,
                    zero_centred=True, dtype=dtype)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        mixer = dict(tp_group=state.tp_group, sequence_parallel=sequence_parallel, fp8=fp8,
                     dtype=dtype)
        if self.layer_type == "full_attention":
            self.attention = GatedAttention(cfg, **mixer)
        else:
            self.linear_attention = GatedDeltaNet(cfg, **mixer, gdn_kernel=gdn_kernel)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.feed_forward = FeedForward(cfg, **mixer)

    def forward(self, h, delta, cos, sin, plan: AttentionPlan):
        """``(h, delta) -> (h', delta')`` as ``mpcore.models.common.decoder.DecoderLayer``."""
        dtype = matmul_dtype(h)
        if delta is None:
            x = self.attention_norm(h, dtype)
        else:
            h, x = self.attention_norm.add(h, delta, dtype)
        if self.layer_type == "full_attention":
            mixed = self.attention(x, cos, sin, plan)
        else:
            mixed = self.linear_attention(x, plan)
        h, x = self.ffn_norm.add(h, mixed, dtype)
        return h, self.feed_forward(x)
