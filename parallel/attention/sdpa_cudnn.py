"""Dense cuDNN attention (``aten._scaled_dot_product_cudnn_attention``) for uniform segments.

Layout: the packed stream of one kernel call, ``q [B * Lq, H, D]``, ``k``/``v``
``[B * Lk, H_kv, D]``: B segments, every query segment of length ``Lq`` and every key segment
of length ``Lk`` (a fixed-length batch: all documents of the local stream equally long, or a
ring step's pieces of such documents). Viewed without a copy as SDPA's ``[B, H, L, D]``
(strides of ``[B, L, H, D]``, the layout SDPA callers usually pass).

Same signature and results as ``flash.flash_forward`` / ``flash_backward``: ``out`` in q's
dtype, ``lse [H, B * Lq]`` fp32, and a backward that takes the FINAL ``out``/``lse`` of each
query row (so the ring can merge partial results with the log-sum-exp and run this backward
per block). Causal means aligned at the top left in SDPA, at the bottom right in flash; they
agree only for ``Lq == Lk``, so the planner (``backends.py``) gives a causal call here only
then. GQA: cuDNN reads fewer kv heads than query heads itself (PyTorch passes the head counts
through since 2.7), so k/v go in as they are and dk/dv come out per kv head; a torch whose
cuDNN call refuses that (probed once, ``_native_gqa``) gets the kv heads repeated to the query
heads and dk/dv summed back, as on the flash path.

Why not the ragged cuDNN path (``aten._cudnn_attention_forward`` with cu_seqlens): it takes
packed documents but its forward ran 60-66 ms per call in torch 2.11 against ~1 ms for flash
(measured on an H200; ``tests/perf/bench_attention.py`` measures it again).
"""

from __future__ import annotations

import torch

_LSE_4D: dict[str, bool] = {}  # does this torch return the lse as [B, H, L, 1] (or [B, H, L])?
_GQA: dict[str, bool] = {}  # does this torch's cuDNN call take fewer kv heads (probed once)?


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    group = num_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]


def _native_gqa(device: torch.device) -> bool:
    """Whether cuDNN attention here takes 4 query heads over 2 kv heads as they are (one tiny
    forward and backward, compared with the repeated-kv call; cached)."""
    if "native" not in _GQA:
        q, k, v = (torch.randn(1, h, 64, 64, device=device, dtype=torch.bfloat16)
                   for h in (4, 2, 2))
        try:
            out = _cudnn_forward(q, k, v, True, 0.125)[0]
            ref = _cudnn_forward(q, _repeat_kv(k, 4), _repeat_kv(v, 4), True, 0.125)[0]
            # a wrong head mapping would be off by O(0.1) on these inputs, not bf16 rounding
            _GQA["native"] = out.shape == ref.shape and bool(
                torch.allclose(out.float(), ref.float(), rtol=0, atol=2e-2))
        except RuntimeError:
            _GQA["native"] = False
    return _GQA["native"]


def _kv_for_call(k: torch.Tensor, v: torch.Tensor, num_heads: int):
    if k.shape[1] != num_heads and not _native_gqa(k.device):
        k, v = _repeat_kv(k, num_heads), _repeat_kv(v, num_heads)
    return k.contiguous(), v.contiguous()


def _dense(x: torch.Tensor, length: int) -> torch.Tensor:
    """``[B * L, H, D]`` (contiguous) -> ``[B, H, L, D]`` view."""
    return x.view(x.shape[0] // length, length, *x.shape[1:]).transpose(1, 2)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D]`` -> ``[B * L, H, D]`` (free when x has ``[B, L, H, D]`` strides)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def sdpa_cudnn_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
                       scale: float):
    """``out [B * Lq, H, D]`` (q's dtype) and ``lse [H, B * Lq]`` fp32 of one uniform call
    (``max_q``/``max_k`` are the segment lengths; ``cu_q``/``cu_k`` are not read)."""
    num_heads = q.shape[1]
    k, v = _kv_for_call(k, v, num_heads)
    out, lse = _cudnn_forward(_dense(q.contiguous(), max_q), _dense(k, max_k), _dense(v, max_k),
                              causal, scale)
    _LSE_4D["4d"] = lse.dim() == 4
    batch = q.shape[0] // max_q
    lse = lse.reshape(batch, num_heads, max_q).transpose(0, 1).reshape(num_heads, -1)
    return _packed(out), lse.float()


def sdpa_cudnn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int,
                        causal: bool, scale: float):
    """Gradients of one uniform call given the FINAL ``out [B * Lq, H, D]`` and ``lse [H,
    B * Lq]``; returns ``dq [B * Lq, H, D]``, ``dk, dv [B * Lk, H_kv, D]``."""
    num_heads, num_kv = q.shape[1], k.shape[1]
    batch = q.shape[0] // max_q
    k, v = _kv_for_call(k, v, num_heads)
    lse = lse.float().reshape(num_heads, batch, max_q).transpose(0, 1).contiguous()
    if _LSE_4D.get("4d", True):
        lse = lse.unsqueeze(-1)  # (B, H, Lq, 1): cuDNN's softmax-stats layout
    # No dropout: the philox seed and offset are never read.
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _dense(dout.contiguous(), max_q), _dense(q.contiguous(), max_q), _dense(k, max_k),
        _dense(v, max_k), _dense(out.contiguous(), max_q), lse, seed, offset, None, None,
        None, max_q, max_k, 0.0, causal, scale=scale)
    dq, dk, dv = _packed(dq), _packed(dk), _packed(dv)
    if dk.shape[1] != num_kv:  # kv heads were repeated for the call: sum them back
        dk = dk.unflatten(1, (num_kv, -1)).sum(2)
        dv = dv.unflatten(1, (num_kv, -1)).sum(2)
    return dq, dk, dv
