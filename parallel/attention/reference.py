"""Exact masked attention from per-token (doc, pos) metadata, and the log-sum-exp merge.

Layout: packed streams. ``q [T, H, D]``, ``k``/``v`` ``[S, H_kv, D]`` (GQA: query head ``h``
reads kv head ``h // (H / H_kv)``), metadata ``doc_q, pos_q [T]`` and ``doc_k, pos_k [S]``
(integers). Query t sees key s iff ``doc_k[s] == doc_q[t] and pos_k[s] <= pos_q[t]``: causal
attention inside each document, whatever the order of the tokens in the tensors.

This is the CPU path of the attention primitive (and the fallback for dtypes or head dims the
flash kernel does not take). It computes in fp32 (float64 for float64 inputs) over query chunks,
so at most ``_MAX_SCORES`` score elements exist at a time. A query row with no visible key gets
``lse = -inf`` and ``out = 0`` (a ring block may hide a whole row; the merge handles it).
"""

from __future__ import annotations

import torch

_MAX_SCORES = 1 << 22  # score elements per query chunk (16 MiB in fp32)
_MAX_QUERY_CHUNK = 256


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(num_q: int, num_k: int, num_heads: int):
    # Short chunks let _keys_for skip the keys of other documents (and of later positions):
    # packed streams then cost about the sum of per-document squares, not (T * S).
    step = max(1, min(_MAX_QUERY_CHUNK, _MAX_SCORES // max(1, num_k * num_heads)))
    for start in range(0, num_q, step):
        yield start, min(num_q, start + step)


def _keys_for(doc_q, pos_q, doc_k, pos_k) -> torch.Tensor:
    """Indices of the keys that any of these queries may see (same doc, pos not after the
    latest query position): a superset of the visible keys, in key order."""
    docs = torch.unique(doc_q)
    maybe = torch.isin(doc_k, docs) & (pos_k <= pos_q.max())
    return maybe.nonzero().squeeze(1)


def _visible(doc_q, pos_q, doc_k, pos_k) -> torch.Tensor:
    """(t, S) bool: which keys each query sees."""
    return (doc_q[:, None] == doc_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])


def any_visible(doc_q, pos_q, doc_k, pos_k) -> bool:
    """True when at least one (query, key) pair is visible; O((T + S) log S), no score matrix."""
    if doc_q.numel() == 0 or doc_k.numel() == 0:
        return False
    doc_q, pos_q, doc_k, pos_k = (t.long() for t in (doc_q, pos_q, doc_k, pos_k))
    docs, inverse = torch.unique(doc_k, return_inverse=True)
    first = torch.full_like(docs, torch.iinfo(torch.int64).max)
    first = first.scatter_reduce(0, inverse, pos_k, "amin")  # earliest key position per doc
    i = torch.searchsorted(docs, doc_q.contiguous()).clamp_max(docs.numel() - 1)
    return bool(((docs[i] == doc_q) & (pos_q >= first[i])).any())


def reference_forward(q, k, v, doc_q, pos_q, doc_k, pos_k, scale: float):
    """Masked attention forward. Returns ``out [T, H, D]`` and ``lse [H, T]``, both in the
    compute dtype (fp32, or float64 for float64 inputs)."""
    num_q, num_heads, dim = q.shape
    num_k, num_kv, _ = k.shape
    group = num_heads // num_kv
    ct = compute_dtype(q.dtype)
    qc = q.to(ct).view(num_q, num_kv, group, dim)
    kc, vc = k.to(ct), v.to(ct)
    out = torch.empty(num_q, num_heads, dim, dtype=ct, device=q.device)
    lse = torch.empty(num_heads, num_q, dtype=ct, device=q.device)
    for a, b in _chunks(num_q, num_k, num_heads):
        keys = _keys_for(doc_q[a:b], pos_q[a:b], doc_k, pos_k)  # (S',)
        if keys.numel() == 0:  # no query of this chunk sees any key
            out[a:b], lse[:, a:b] = 0.0, float("-inf")
            continue
        scores = torch.einsum("thgd,shd->hgts", qc[a:b], kc[keys]) * scale  # (H_kv, G, t, S')
        mask = _visible(doc_q[a:b], pos_q[a:b], doc_k[keys], pos_k[keys])
        scores = scores.masked_fill(~mask, float("-inf"))
        m = scores.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows that see nothing
        p = torch.exp(scores - m)
        denom = p.sum(-1, keepdim=True)  # (H_kv, G, t, 1)
        o = torch.einsum("hgts,shd->thgd", p, vc[keys])
        o = o / torch.where(denom > 0, denom, torch.ones_like(denom)).permute(2, 0, 1, 3)
        out[a:b] = o.reshape(b - a, num_heads, dim)
        lse[:, a:b] = (m + torch.log(denom)).reshape(num_heads, b - a)
    return out, lse


def reference_backward(dout, q, k, v, out, lse, doc_q, pos_q, doc_k, pos_k, scale: float):
    """Gradients of masked attention given the FINAL ``out`` and ``lse`` of every query row
    (over all key blocks, as the ring merges them). Returns ``dq [T, H, D]``, ``dk, dv [S, H_kv,
    D]`` in the compute dtype: the contribution of these keys only."""
    num_q, num_heads, dim = q.shape
    num_k, num_kv, _ = k.shape
    group = num_heads // num_kv
    ct = compute_dtype(q.dtype)
    qc = q.to(ct).view(num_q, num_kv, group, dim)
    kc, vc = k.to(ct), v.to(ct)
    do = dout.to(ct).view(num_q, num_kv, group, dim)
    delta = (do * out.to(ct).view_as(do)).sum(-1)  # (T, H_kv, G): rowsum(dO * O)
    lse = lse.to(ct).view(num_kv, group, num_q)
    dq = torch.empty(num_q, num_kv, group, dim, dtype=ct, device=q.device)
    dk = torch.zeros(num_k, num_kv, dim, dtype=ct, device=q.device)
    dv = torch.zeros_like(dk)
    for a, b in _chunks(num_q, num_k, num_heads):
        keys = _keys_for(doc_q[a:b], pos_q[a:b], doc_k, pos_k)  # (S',)
        if keys.numel() == 0:
            dq[a:b] = 0.0
            continue
        kk, vk = kc[keys], vc[keys]
        scores = torch.einsum("thgd,shd->hgts", qc[a:b], kk) * scale
        mask = _visible(doc_q[a:b], pos_q[a:b], doc_k[keys], pos_k[keys])
        # A visible entry implies a finite lse; masked entries are zeroed whatever exp gives.
        p = torch.where(mask, torch.exp(scores - lse[:, :, a:b, None]), torch.zeros_like(scores))
        dv.index_add_(0, keys, torch.einsum("hgts,thgd->shd", p, do[a:b]))
        dp = torch.einsum("thgd,shd->hgts", do[a:b], vk)
        ds = p * (dp - delta[a:b].permute(1, 2, 0)[..., None]) * scale
        dq[a:b] = torch.einsum("hgts,shd->thgd", ds, kk)
        dk.index_add_(0, keys, torch.einsum("hgts,thgd->shd", ds, qc[a:b]))
    return dq.view(num_q, num_heads, dim), dk, dv


def merge_partials(out, lse, out_b, lse_b):
    """Merge two partial attention results over disjoint key sets with their log-sum-exp.

    ``out, out_b [T, H, D]`` and ``lse, lse_b [H, T]``, both in the accumulation dtype (fp32);
    a row that saw nothing in one part has ``lse = -inf`` there and ``out = 0``. Returns the
    merged ``(out, lse)``.
    """
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))  # both parts empty
    w = torch.exp(lse - safe).t()[..., None]  # (T, H, 1)
    w_b = torch.exp(lse_b - safe).t()[..., None]
    return out * w + out_b.to(out.dtype) * w_b, new
