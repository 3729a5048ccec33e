"""Chunked engine of the fused linear + cross-entropy / log-prob heads.

Layout: ``hidden [N, H]``, ``weight [V_local, H]`` (this rank's rows ``[v_start, v_start +
V_local)`` of the vocab), ``tgt [N]`` int32 (the label's column in this shard, or -1). Tokens are
walked in chunks of ``rows`` so that one chunk of logits ``[rows, V_local]`` stays under
``CHUNK_BYTES``; nothing ever holds ``[N, V]``.

Per-row statistics, fp32, ``z = logits / T`` over the valid (non-padding) columns:
    m = max z,   s = sum exp(z - m),   t = z[label] (0 off the label's shard),
    w = sum exp(z - m) * (z - m)
Across the vocab shards of ``group`` they combine with two all-reduces (MAX of m, then one SUM
of the rescaled [s, t, w]); then ``lse = m + log s``, ``logprob = t - lse``,
``entropy = log s - w / s`` and ``E_p[z] = m + w / s``.

The row math runs through a backend: ``TorchRows`` below (the PyTorch reference, any device) or
``mpcore.kernels._lce_triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``); both have the same
``row_stats`` / ``row_grad`` / ``row_stats_and_grad``. The GEMMs are cuBLAS (``torch.mm``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mpcore.kernels.master_linear import mm_has_out_dtype

# Upper bound on one chunk of logits; the peak workspace of every path is about this much.
CHUNK_BYTES = 512 * 1024 * 1024
# Logits of 16-bit inputs in fp32 (cuBLAS fp32 output, where torch.mm has ``out_dtype``)?
# Per-token log-probs keep fp32 accuracy that way (a bf16 logit is off by up to 2^-9 of itself);
# the gradient-in-forward CE path averages such errors away and keeps 16-bit logits, which
# halves its row pass's memory traffic.
FP32_LOGITS_CE = False
FP32_LOGITS_RECOMPUTE = True


@contextlib.contextmanager
def chunk_budget(nbytes: int | None):
    """``CHUNK_BYTES`` set to ``nbytes`` inside the block (None: left as it is), for A/B runs
    of the chunk size (``tests/perf``); restored after. Covers a backward run inside the
    block too (the log-prob head picks its chunks again there)."""
    global CHUNK_BYTES
    default = CHUNK_BYTES
    CHUNK_BYTES = default if nbytes is None else nbytes
    try:
        yield
    finally:
        CHUNK_BYTES = default


class TorchRows:
    """PyTorch reference of the row math; same signatures as ``mpcore.kernels._lce_triton``."""

    @staticmethod
    def row_stats(logits, tgt, n_valid_cols, inv_temp, with_entropy):
        n = logits.shape[0]
        stats = torch.zeros(4, n, dtype=torch.float32, device=logits.device)
        if n_valid_cols == 0:
            stats[0] = float("-inf")
            return stats
        z = logits[:, :n_valid_cols].float() * inv_temp  # (n, V_valid)
        m = z.amax(dim=1)
        shifted = z - m[:, None]
        e = torch.exp(shifted)
        stats[0] = m
        stats[1] = e.sum(dim=1)
        has_tgt = tgt >= 0
        stats[2] = torch.where(has_tgt, z.gather(1, tgt.clamp(min=0).long()[:, None])[:, 0], 0.0)
        if with_entropy:
            stats[3] = (e * shifted).sum(dim=1)
        return stats

    @staticmethod
    def row_grad(logits, grad, tgt, lse, ez, g_lp, g_ent, n_valid_cols, inv_temp):
        z = logits[:, :n_valid_cols].float() * inv_temp  # (n, V_valid)
        p = torch.exp(z - lse[:, None])
        g = -g_lp[:, None] * p
        rows = torch.nonzero(tgt >= 0)[:, 0]
        g[rows, tgt[rows].long()] += g_lp[rows]
        if g_ent is not None:
            g += g_ent[:, None] * p * (ez[:, None] - z)
        grad[:, :n_valid_cols] = g * inv_temp
        grad[:, n_valid_cols:] = 0

    @staticmethod
    def row_stats_and_grad(logits, grad, tgt, g_lp, n_valid_cols, inv_temp):
        stats = TorchRows.row_stats(logits, tgt, n_valid_cols, inv_temp, False)
        lse = stats[0] + torch.log(stats[1])
        TorchRows.row_grad(logits, grad, tgt, lse, None, g_lp, None, n_valid_cols, inv_temp)
        return stats


@dataclass(frozen=True)
class Head:
    """The static part of one call: this rank's shard, temperature, group and backend."""

    group: Any  # torch.distributed ProcessGroup or None
    tp: int
    v_start: int
    n_valid_cols: int
    inv_temp: float
    rows: Any  # TorchRows or the mpcore.kernels._lce_triton module
    logits_dtype: torch.dtype

    @staticmethod
    def build(weight, group, vocab_size, temperature, rows, fp32_logits: bool) -> Head:
        tp = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        v_local = weight.shape[0]
        v_start = rank * v_local
        n_valid = max(0, min(v_local, vocab_size - v_start))
        logits_dtype = weight.dtype
        if fp32_logits and weight.dtype != torch.float32 and weight.is_cuda:
            if mm_has_out_dtype("cuda"):
                logits_dtype = torch.float32
        return Head(group if tp > 1 else None, tp, v_start, n_valid, 1.0 / temperature, rows,
                    logits_dtype)

    def local_targets(self, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        local = labels - self.v_start
        mine = valid & (local >= 0) & (local < self.n_valid_cols)
        return torch.where(mine, local, -1).to(torch.int32)

    def chunk_rows(self, n: int, v_local: int) -> int:
        elt = torch.empty((), dtype=self.logits_dtype).element_size()
        rows = max(1, CHUNK_BYTES // max(1, v_local * elt))
        if rows >= 256:
            rows -= rows % 128  # whole GEMM tiles
        return min(max(n, 1), rows)

    def logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.logits_dtype == h.dtype:
            return torch.mm(h, weight.t())
        return torch.mm(h, weight.t(), out_dtype=self.logits_dtype)


def grad_view(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` view over the logits chunk's own memory that can hold its gradient."""
    if logits.dtype == dtype:
        return logits
    return logits.view(dtype)[:, : logits.shape[1]]  # first half of each fp32 row, stride 2V


def combine_stats(stats: torch.Tensor, group) -> torch.Tensor:
    """Combine per-shard ``[4, n]`` stats across ``group`` (two all-reduces); local if None."""
    if group is None:
        return stats
    m_local, s, t, w = stats
    m = m_local.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(m_local - m)  # 0 on a shard that is all padding (m_local = -inf)
    shift = torch.where(s > 0, m_local - m, 0.0)
    part = torch.stack([s * scale, t, scale * (w + shift * s)])
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
    return torch.cat([m[None], part])


def finish(stats: torch.Tensor, valid: torch.Tensor):
    """(logprob, entropy, lse, E_p[z]) per row, fp32, from combined stats."""
    m, s, t, w = stats
    log_s = torch.log(s)
    lse = m + log_s
    logprob = torch.where(valid, t - lse, 0.0)
    entropy = log_s - w / s
    return logprob, entropy, lse, m + w / s


def forward_stats(hidden, weight, tgt, head: Head, with_entropy: bool) -> torch.Tensor:
    """Combined ``[4, N]`` stats; forward without gradient work (two all-reduces in all)."""
    n = hidden.shape[0]
    stats = torch.empty(4, n, dtype=torch.float32, device=hidden.device)
    step = head.chunk_rows(n, weight.shape[0])
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        logits = head.logits(hidden[r0:r1], weight)  # (rows, V_local)
        stats[:, r0:r1] = head.rows.row_stats(logits, tgt[r0:r1], head.n_valid_cols,
                                              head.inv_temp, with_entropy)
    return combine_stats(stats, head.group)


def _add_chunk_grads(g, h, weight, dh, r0, r1, dw, need_dw):
    """``dh[r0:r1] = g @ W`` (when ``dh`` is given); returns ``dw + g^T @ h`` (``g^T @ h`` for
    the first chunk, then accumulated in place) when ``need_dw``, else ``dw`` unchanged."""
    if dh is not None:
        torch.mm(g, weight, out=dh[r0:r1])
    if not need_dw:
        return dw
    return torch.mm(g.t(), h) if dw is None else dw.addmm_(g.t(), h)


def forward_ce_with_grad(hidden, weight, tgt, valid, head: Head, need_dh: bool, need_dw: bool):
    """Sum of the token losses, with d(sum)/d(hidden) and d(sum)/d(weight) computed on the way
    (``dw`` in the weight's dtype).

    Per chunk: logits GEMM, one row pass that turns the logits into their gradient in place,
    then ``dh_c = g @ W`` and ``dW += g^T @ h_c``. With ``group`` the chunk's stats are
    combined (two all-reduces per chunk) before the gradient pass.
    """
    n = hidden.shape[0]
    coef = -valid.to(torch.float32)  # d loss / d logprob on valid rows
    stats = torch.empty(4, n, dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if need_dh else None
    dw = None
    step = head.chunk_rows(n, weight.shape[0])
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        h = hidden[r0:r1]
        logits = head.logits(h, weight)  # (rows, V_local)
        g = grad_view(logits, hidden.dtype)
        args = (head.n_valid_cols, head.inv_temp)
        if head.group is None:
            stats[:, r0:r1] = head.rows.row_stats_and_grad(logits, g, tgt[r0:r1], coef[r0:r1],
                                                           *args)
        else:
            st = combine_stats(head.rows.row_stats(logits, tgt[r0:r1], *args, False), head.group)
            stats[:, r0:r1] = st
            lse = st[0] + torch.log(st[1])
            head.rows.row_grad(logits, g, tgt[r0:r1], lse, None, coef[r0:r1], None, *args)
        dw = _add_chunk_grads(g, h, weight, dh, r0, r1, dw, need_dw)
        del logits, g  # free the chunk before the next one is allocated
    if need_dw and dw is None:  # no rows
        dw = torch.zeros_like(weight)
    lse = stats[0] + torch.log(stats[1])
    loss_sum = torch.where(valid, lse - stats[2], 0.0).sum()
    return loss_sum, dh, dw


def backward(hidden, weight, tgt, lse, ez, g_lp, g_ent, head: Head, need_dh, need_dw):
    """Gradients from per-token ``g_lp`` (log-prob) and ``g_ent`` (entropy, or None).

    Recomputes the logits chunk by chunk; the saved lse (and E_p[z]) are already global, so no
    collective runs here. Returns this rank's partial ``dh`` and its shard's ``dw``.
    """
    n = hidden.shape[0]
    dh = torch.empty_like(hidden) if need_dh else None
    dw = None
    step = head.chunk_rows(n, weight.shape[0])
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        h = hidden[r0:r1]
        logits = head.logits(h, weight)  # (rows, V_local)
        g = grad_view(logits, hidden.dtype)
        head.rows.row_grad(logits, g, tgt[r0:r1], lse[r0:r1],
                           None if g_ent is None else ez[r0:r1], g_lp[r0:r1],
                           None if g_ent is None else g_ent[r0:r1],
                           head.n_valid_cols, head.inv_temp)
        dw = _add_chunk_grads(g, h, weight, dh, r0, r1, dw, need_dw)
        del logits, g  # free the chunk before the next one is allocated
    if need_dw and dw is None:  # no rows
        dw = torch.zeros_like(weight)
    return dh, dw
