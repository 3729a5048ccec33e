"""Flash varlen attention (CUDA) for arbitrary (doc, pos) metadata: kernel calls and planning.

Layout: packed streams, ``q [T, H, D]``, ``k``/``v`` ``[S, H_kv, D]``, metadata ``doc, pos``
per token (see ``reference.py`` for the mask: same doc and ``pos_k <= pos_q``).

The flash kernel only knows segments: ``cu_seq_q``/``cu_seq_k`` pair query segment i with key
segment i, either fully visible or causal aligned at the bottom right (query row j of a segment
of ``m`` queries sees key rows ``<= j + n - m`` of its ``n`` keys). A query/key pair of blocks
(local queries vs a ring block of remote keys, or the rank-major gathered stream of Ulysses) is
turned into at most two kernel calls by ``plan_flash``:

1. Sort both sides by (doc, pos) and cut them into runs of consecutive positions of one doc.
2. For a query run Q = positions ``[a, a+m)`` and a key run K = ``[b, b+n)`` of the same doc:
   - causal piece: queries ``[max(a, b), min(a+m, b+n))`` with keys ``[b, min(a+m, b+n))``.
     Both end at the same position, so flash's bottom-right causal mask is exactly
     ``pos_k <= pos_q``. Key runs of one doc are disjoint, so a query lies in at most one
     causal piece: all causal pieces go into ONE causal call.
   - full piece: queries at positions ``>= b+n`` see all of K. The fully visible key runs of a
     query are a prefix (in position order) of its doc's key runs, contiguous after sorting;
     queries are grouped by that prefix and all such pieces go into ONE non-causal call.
3. The two partial results are merged with their log-sum-exp (``merge_partials``).

What this gives per ring step (zigzag: rank r holds chunks r and 2cp-1-r of every document):
the diagonal step (own K/V) is one causal call (each chunk vs itself) plus one full call (high
chunk vs low chunk; rank cp-1, whose two chunks are adjacent, needs only the causal call; with
local ``cu_seqlens`` from ``mpcore.parallel.context`` it is one causal call without a plan); a
remote block from rank r' < r is one full call (its low chunk, seen by both local chunks); from
r' > r one full call (both remote chunks, seen by the local high chunk). No off-diagonal block
has a causal piece, and every rank does the same work per step. A block with no visible pair
makes no call (the ring skips it). Contiguous layout: the diagonal step is one causal call,
earlier ranks one full call, later ranks nothing. Ulysses (all tokens, rank-major order):
sorting restores each document's order, so it is one causal call on the permuted stream,
permuted back by ``index_copy`` afterwards.

Requirement: ``(doc, pos)`` is unique per token on each side (checked here); the CPU
reference has no such need. Planning runs on the host: metadata on the GPU is copied once
(a CPU-GPU sync point); pass it on the CPU to avoid the sync.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from mpcore.kernels import host_checked
from mpcore.parallel.attention.reference import compute_dtype, merge_partials
from mpcore.parallel.attention.sdpa_cudnn import sdpa_cudnn_backward, sdpa_cudnn_forward
from mpcore.parallel.attention.te_fused import te_fused_backward, te_fused_forward

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FlashCall:
    """One varlen kernel call: query rows ``q_index`` (None: all rows, in order) in segments
    ``cu_q``, paired with key rows ``k_index`` in segments ``cu_k`` (int32 on the device).
    ``uniform``: every query segment has ``max_q`` rows and every key segment ``max_k`` (a
    dense ``[B, L]`` batch); ``backend``: the kernel that runs it (``backends.assign``)."""

    causal: bool
    q_index: torch.Tensor | None
    k_index: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    uniform: bool = False
    backend: str = "flash"


def _runs(doc: np.ndarray, pos: np.ndarray, side: str):
    """Sort by (doc, pos) and cut into runs of consecutive positions of one doc.
    Returns the sort order and per run: doc, first pos, length, offset in sorted order."""
    order = np.lexsort((pos, doc))
    d, p = doc[order], pos[order]
    same_doc = d[1:] == d[:-1]
    if np.any(same_doc & (p[1:] == p[:-1])):
        raise ValueError(f"two {side} tokens share (doc_id, pos); give every token of a "
                         "document its own position (and padding its own doc id or positions)")
    starts = np.concatenate(([0], np.flatnonzero(~same_doc | (p[1:] != p[:-1] + 1)) + 1))
    lengths = np.diff(np.concatenate((starts, [len(d)])))
    return order, d[starts], p[starts], lengths, starts


def _segments(doc_q, pos_q, doc_k, pos_k):
    """Causal and full segments as (q_lo, q_hi, k_lo, k_hi) in sorted coordinates."""
    order_q, rd_q, ra_q, rm_q, ro_q = _runs(doc_q, pos_q, "query")
    order_k, rd_k, ra_k, rn_k, ro_k = _runs(doc_k, pos_k, "key")
    causal, full = [], []
    lo_k = np.searchsorted(rd_k, rd_q, side="left")
    hi_k = np.searchsorted(rd_k, rd_q, side="right")
    for i in range(len(rd_q)):
        a, m, qo = int(ra_q[i]), int(rm_q[i]), int(ro_q[i])
        end_q = a + m
        for j in range(lo_k[i], hi_k[i]):
            b, n, ko = int(ra_k[j]), int(rn_k[j]), int(ro_k[j])
            lo, hi = max(a, b), min(end_q, b + n)
            if lo < hi:
                causal.append((qo + lo - a, qo + hi - a, ko, ko + hi - b))
        # Full pieces: queries from max(a, end of K_j) on see K_first..K_j (one sorted range).
        first_k = int(ro_k[lo_k[i]]) if hi_k[i] > lo_k[i] else 0
        for j in range(lo_k[i], hi_k[i]):
            end_k = int(ra_k[j] + rn_k[j])
            if end_k >= end_q:
                break
            start = max(a, end_k)
            nxt = end_q
            if j + 1 < hi_k[i]:
                nxt = min(end_q, max(a, int(ra_k[j + 1] + rn_k[j + 1])))
            if start < nxt:
                full.append((qo + start - a, qo + nxt - a, first_k, int(ro_k[j] + rn_k[j])))
    return order_q, order_k, causal, full


def _index(order: np.ndarray, ranges, device) -> torch.Tensor | None:
    idx = np.concatenate([order[lo:hi] for lo, hi in ranges])
    if len(idx) == len(order) and np.array_equal(idx, np.arange(len(order))):
        return None  # every row in its own order: no gather
    return torch.from_numpy(idx).to(device)


def _call(causal: bool, segs, order_q, order_k, device) -> FlashCall:
    len_q = np.array([s[1] - s[0] for s in segs])
    len_k = np.array([s[3] - s[2] for s in segs])
    cu = [torch.from_numpy(np.concatenate(([0], np.cumsum(n))).astype(np.int32)).to(device)
          for n in (len_q, len_k)]
    uniform = bool(len_q.min() == len_q.max() and len_k.min() == len_k.max())
    return FlashCall(causal, _index(order_q, [s[:2] for s in segs], device),
                     _index(order_k, [s[2:] for s in segs], device), cu[0], cu[1],
                     int(len_q.max()), int(len_k.max()), uniform)


def plan_flash(doc_q, pos_q, doc_k, pos_k, device) -> list[FlashCall]:
    """Kernel calls that compute masked attention of queries ``(doc_q, pos_q) [T]`` over keys
    ``(doc_k, pos_k) [S]``; an empty list means no query sees any key."""
    if doc_q.numel() == 0 or doc_k.numel() == 0:
        return []
    host = [t.detach().cpu().numpy().astype(np.int64) for t in (doc_q, pos_q, doc_k, pos_k)]
    order_q, order_k, causal, full = _segments(*host)
    return [_call(kind, segs, order_q, order_k, device)
            for kind, segs in ((True, causal), (False, full)) if segs]


def plan_cu_seqlens(cu_seqlens: torch.Tensor, device) -> list[FlashCall]:
    """One causal call for tokens in order, documents cut by ``cu_seqlens [docs+1]``."""
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    # CPU-GPU sync point when cu_seqlens is on the GPU without a host copy (mpcore.kernels.host_checked).
    lengths = host_checked.host_values(cu_seqlens).diff()
    min_len, max_len = (int(n) for n in torch.aminmax(lengths))
    return [FlashCall(True, None, None, cu, cu, max_len, max_len, min_len == max_len)]


@lru_cache(maxsize=1)
def _varlen_api():
    """``(varlen_attn, AuxRequest, parameter names)``, or None when torch lacks the module or
    its ``varlen_attn`` takes no ``scale`` (torch 2.10); the aten op serves those."""
    try:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn
    except ImportError:
        return None
    params = frozenset(inspect.signature(varlen_attn).parameters)
    if "scale" not in params or not params & {"window_size", "is_causal"}:
        return None
    return varlen_attn, AuxRequest, params


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    # The kernels are called with as many kv heads as query heads (torch 2.11's varlen_attn
    # has no enable_gqa); kv head c serves query heads c*G .. c*G+G-1.
    group = num_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """One varlen flash call: ``out [Tq, H, D]`` (q's dtype) and ``lse [H, Tq]`` fp32.
    ``torch.nn.attention.varlen.varlen_attn`` where present, else the aten flash op."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    api = _varlen_api()
    if api is not None:
        varlen_attn, aux_request, params = api
        kwargs = {"return_aux": aux_request(lse=True), "scale": scale}
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            kwargs["is_causal"] = causal
        out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    else:
        out, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)[:2]
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"flash varlen returned lse of shape {tuple(lse.shape)}, expected "
                           f"[heads, tokens] = {(q.shape[1], q.shape[0])}; this torch version "
                           "is not supported by the flash path (use torch >= 2.10)")
    return out, lse


def flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
                   scale: float):
    """Gradients of one varlen flash call given the FINAL ``out``/``lse`` of each query row.
    Returns ``dq [Tq, H, D]``, ``dk, dv [Tk, H_kv, D]``."""
    num_kv = k.shape[1]
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    # No dropout: the rng state is never read (torch's own varlen backward passes the same).
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused,
        scale=scale)
    if num_kv != q.shape[1]:
        dk = dk.unflatten(1, (num_kv, -1)).sum(2)
        dv = dv.unflatten(1, (num_kv, -1)).sum(2)
    return dq, dk, dv


def _whole(calls: list[FlashCall]) -> FlashCall | None:
    """The one call when a single call covers every query and key row in order (the local
    causal step of a model: nothing to gather, scatter or merge), else None."""
    if len(calls) == 1 and calls[0].q_index is None and calls[0].k_index is None:
        return calls[0]
    return None


KERNELS = {"flash": (flash_forward, flash_backward),
           "sdpa_cudnn": (sdpa_cudnn_forward, sdpa_cudnn_backward),
           "te_fused": (te_fused_forward, te_fused_backward)}  # imports TE on its first call


def run_forward(q, k, v, calls: list[FlashCall], scale: float, kernel=None):
    """Execute planned calls; returns ``out [T, H, D]`` and ``lse [H, T]`` (rows no call
    covers: 0 and -inf). ``out`` is in the accumulation dtype (fp32) when partial results are
    merged, and the kernel's own output (q's dtype) when one call covers every row: the merge
    would return it unchanged, after five passes over ``[T, H, D]`` in fp32. ``kernel`` (with
    ``flash_forward``'s signature) overrides each call's backend (tests)."""
    num_q, num_heads, dim = q.shape
    acc = compute_dtype(q.dtype)
    whole = _whole(calls)
    if whole is not None:
        fwd = kernel or KERNELS[whole.backend][0]
        o, lse_c = fwd(q.contiguous(), k.contiguous(), v.contiguous(), whole.cu_q,
                       whole.cu_k, whole.max_q, whole.max_k, whole.causal, scale)
        return o, lse_c.to(acc)
    out = torch.zeros(num_q, num_heads, dim, dtype=acc, device=q.device)
    lse = torch.full((num_heads, num_q), float("-inf"), dtype=acc, device=q.device)
    for c in calls:
        fwd = kernel or KERNELS[c.backend][0]
        o, lse_c = fwd(_take(q, c.q_index), _take(k, c.k_index), _take(v, c.k_index), c.cu_q,
                       c.cu_k, c.max_q, c.max_k, c.causal, scale)
        if c.q_index is not None:
            o = torch.zeros_like(out).index_copy_(0, c.q_index, o.to(acc))
            lse_c = torch.full_like(lse, float("-inf")).index_copy_(1, c.q_index, lse_c.to(acc))
        out, lse = merge_partials(out, lse, o, lse_c.to(acc))
    return out, lse


def run_backward(dout, q, k, v, out, lse, calls: list[FlashCall], scale: float,
                 kernel=None):
    """Gradients through planned calls given the final ``out``/``lse``; returns ``dq``, ``dk``,
    ``dv`` (the contribution of these keys) in the accumulation dtype (fp32), or as the kernel
    gives them (the inputs' dtype) when one call covers every row."""
    acc = compute_dtype(q.dtype)
    whole = _whole(calls)
    if whole is not None:
        bwd = kernel or KERNELS[whole.backend][1]
        return bwd(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                   out.to(q.dtype).contiguous(), lse.to(acc).contiguous(), whole.cu_q,
                   whole.cu_k, whole.max_q, whole.max_k, whole.causal, scale)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    out, lse = out.to(q.dtype), lse.to(acc)
    for c in calls:
        qi, ki = c.q_index, c.k_index
        bwd = kernel or KERNELS[c.backend][1]
        dq_c, dk_c, dv_c = bwd(
            _take(dout, qi), _take(q, qi), _take(k, ki), _take(v, ki), _take(out, qi),
            _take(lse, qi, dim=1), c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal, scale)
        _add(dq, qi, dq_c)
        _add(dk, ki, dk_c)
        _add(dv, ki, dv_c)
    return dq, dk, dv


def _take(x: torch.Tensor, index: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    return (x if index is None else x.index_select(dim, index)).contiguous()


def _add(acc: torch.Tensor, index: torch.Tensor | None, x: torch.Tensor) -> None:
    if index is None:
        acc += x.to(acc.dtype)
    else:
        acc.index_add_(0, index, x.to(acc.dtype))
