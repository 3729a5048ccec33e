"""TransformerEngine's fused attention (cuDNN, THD layout) as a kernel of the attention primitive.

Layout: the packed stream of one kernel call (``flash.FlashCall``): ``q [Tq, H, D]``, ``k``/``v``
``[Tk, H_kv, D]``, segments ``cu_q``/``cu_k`` (int32 on the device; segment i of q pairs with
segment i of k). Same signature and results as ``flash.flash_forward`` / ``flash_backward``:
``out [Tq, H, D]`` in q's dtype, ``lse [H, Tq]`` fp32 (natural log of the sum of
``exp(scale * q.k)`` over the visible keys), and a backward that takes the FINAL out/lse of each
query row (the ring merges partial results with the lse, then runs each block's backward).

The calls (``transformer_engine.pytorch.cpp_extensions.fused_attn``): ``fused_attn_fwd`` /
``fused_attn_bwd`` with ``qkv_layout="thd_thd_thd"`` (``o_format``/``do_format`` ``thd``), the
``F16_arbitrary_seqlen`` (cuDNN) sub-backend, no bias, no dropout, ``cu_seqlens_*_padded`` equal
to ``cu_seqlens_*`` (no gaps between segments), mask ``padding_causal_bottom_right`` with window
(-1, 0) for causal (flash's alignment: query row j of m sees key rows <= j + n - m of n) and
``padding`` with window (-1, -1) for full: the values TE's own ``DotProductAttention`` passes
(``utils.check_set_window_size``). GQA is inside the kernel: THD takes fewer kv heads from cuDNN
9.6 on, and dk/dv come back per kv head.

Softmax stats. TE returns ``aux_ctx_tensors = [stats, rng_state]``; ``stats`` (fp32) is cuDNN's
log-sum-exp of the scaled scores per row, natural log (TE's context-parallel code merges it with
flash's lse by the same formulas). Its layout is chosen at run time in TE's C++
(``fused_attn_arbitrary_seqlen_fwd``): ``[Tq, H, 1]`` ("packed", row t at ``t * H + h``) for THD
on cuDNN >= 9.6 except compute capability 12.0, else ``[B, H, max_q, 1]`` padded per segment.
:func:`packed_stats` decides it the same way (TE's ``context_parallel.py``:
``softmax_lse_in_packed_format``); the forward checks the returned shape against that decision
and raises on any other, and the backward builds that layout from the merged lse.

Rows that see no key (flash gives them lse -inf and out 0) never reach this kernel: a causal
call of ``flash.plan_flash`` pairs queries ``[max(a, b), hi)`` with keys ``[b, hi)``, so every
segment has at most as many queries as keys and each row sees its diagonal key; a full call's
segments all have keys (tests/unit/test_attention_backends.py checks both on random plans).
That also gives ``max_q <= max_k`` for causal calls, which TE's bottom-right mask requires
(``nvte_get_fused_attn_backend``).

Random state: without dropout nothing random is read, but each forward still takes a philox
offset from the generator it is given (``init_philox_state``); a private generator per device
leaves the default CUDA generator where the other backends leave it. The backward gets a zero
``[2]`` int64 state (the forward's own dtype and shape).

TE is imported on the first call, never at import: CI has no TE (``mpcore.parallel.te`` detects it).
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import NamedTuple

import torch


class _TE(NamedTuple):
    fwd: object  # fused_attn_fwd
    bwd: object  # fused_attn_bwd
    backend: object  # FusedAttnBackend["F16_arbitrary_seqlen"]
    cudnn_version: tuple[int, int, int]


@lru_cache(maxsize=1)
def _te() -> _TE:
    from mpcore.parallel.te import TE_INSTALL, transformer_engine

    if transformer_engine() is None:
        raise RuntimeError(f"te_fused needs TransformerEngine, and transformer_engine.pytorch "
                           f"cannot be imported; install it ({TE_INSTALL})")
    fused = importlib.import_module("transformer_engine.pytorch.cpp_extensions.fused_attn")
    utils = importlib.import_module("transformer_engine.pytorch.utils")
    # A dict before TE 2.19, an IntEnum since; both are indexed by name.
    backend = fused.FusedAttnBackend["F16_arbitrary_seqlen"]
    return _TE(fused.fused_attn_fwd, fused.fused_attn_bwd, backend,
               tuple(utils.get_cudnn_version()))


def runtime_refusal(device: torch.device) -> str | None:
    """Why TE's THD fused attention cannot run on ``device`` (compute capability, cuDNN), or
    None when it can. TE must be importable (``mpcore.parallel.te.te_available``)."""
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        # nvte_get_fused_attn_backend: the THD layouts need sm >= 90
        return f"TE's THD fused attention needs compute capability >= 9.0, got {capability}"
    version = _te().cudnn_version
    if version < (9, 6, 0):
        # THD with GQA and padding_causal_bottom_right: cuDNN >= 9.6 (same function)
        return (f"TE's THD fused attention with GQA and a bottom-right causal mask needs "
                f"cuDNN >= 9.6, TE sees {'.'.join(map(str, version))}")
    return None


def packed_stats(device: torch.device) -> bool:
    """True when TE's softmax stats of a THD call are ``[Tq, H, 1]``, False when
    ``[B, H, max_q, 1]`` (module docstring)."""
    capability = torch.cuda.get_device_capability(device)
    return _te().cudnn_version >= (9, 6, 0) and capability != (12, 0)


_GENERATORS: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    if device not in _GENERATORS:
        _GENERATORS[device] = torch.Generator(device=device)
    return _GENERATORS[device]


def _mask(causal: bool) -> dict:
    if causal:
        return {"attn_mask_type": "padding_causal_bottom_right", "window_size": (-1, 0)}
    return {"attn_mask_type": "padding", "window_size": (-1, -1)}


def _segments(cu_q: torch.Tensor, num_q: int):
    """Segment and position in it of each of the ``num_q`` query rows (int64, on the device)."""
    cu = cu_q.long()
    rows = torch.arange(num_q, device=cu.device)
    seg = torch.searchsorted(cu[1:], rows, right=True)  # ends <= row: empty segments skipped
    return seg, rows - cu[seg]


def _lse_from_stats(stats: torch.Tensor, cu_q, num_q: int, num_heads: int, max_q: int,
                    packed: bool) -> torch.Tensor:
    """TE's softmax stats -> ``lse [H, Tq]`` fp32."""
    batch = cu_q.numel() - 1
    want = (num_q, num_heads, 1) if packed else (batch, num_heads, max_q, 1)
    if tuple(stats.shape) != want or stats.dtype != torch.float32:
        raise RuntimeError(
            f"TransformerEngine's fused attention returned softmax stats {tuple(stats.shape)} "
            f"{stats.dtype}, expected {want} float32 (the {'packed' if packed else 'padded'} "
            f"layout TE uses with cuDNN {'.'.join(map(str, _te().cudnn_version))} on this GPU); "
            "te_fused does not know this TE version's layout")
    if packed:
        return stats.view(num_q, num_heads).t().contiguous()
    seg, pos = _segments(cu_q, num_q)
    return stats.squeeze(-1)[seg, :, pos].t().contiguous()  # (Tq, H) -> (H, Tq)


def _stats_from_lse(lse: torch.Tensor, cu_q, max_q: int, packed: bool) -> torch.Tensor:
    """``lse [H, Tq]`` -> the softmax stats layout TE's backward reads (fp32, contiguous)."""
    num_heads, num_q = lse.shape
    rows = lse.float().t()  # (Tq, H)
    if packed:
        return rows.contiguous().unsqueeze(-1)  # (Tq, H, 1)
    seg, pos = _segments(cu_q, num_q)
    # Padding slots are masked out by the kernel; zeros keep them finite.
    stats = torch.zeros(cu_q.numel() - 1, num_heads, max_q, dtype=torch.float32,
                        device=lse.device)
    stats[seg, :, pos] = rows
    return stats.unsqueeze(-1)  # (B, H, max_q, 1)


def _cu(cu: torch.Tensor) -> torch.Tensor:
    # TE reads cu_seqlens by pointer as int32: anything else would be misread, not converted.
    return cu.to(torch.int32).contiguous()


def _describe(q, k, max_q, max_k, causal) -> str:
    return (f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, segments {max_q} x {max_k} "
            f"at most, {'causal' if causal else 'full'}")


def te_fused_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """One THD fused-attention call: ``out [Tq, H, D]`` (q's dtype) and ``lse [H, Tq]`` fp32.
    Raises ``RuntimeError`` when TE refuses the call or returns stats of an unknown layout."""
    te = _te()
    num_q, num_heads = q.shape[:2]
    cu_q, cu_k = _cu(cu_q), _cu(cu_k)
    try:
        out, aux = te.fwd(
            is_training=True, max_seqlen_q=int(max_q), max_seqlen_kv=int(max_k),
            cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, q=q.contiguous(), k=k.contiguous(),
            v=v.contiguous(), fake_dtype=q.dtype, fused_attention_backend=te.backend,
            cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k, attn_scale=float(scale),
            dropout=0.0, qkv_layout="thd_thd_thd", o_format="thd", attn_bias_type="no_bias",
            rng_gen=_generator(q.device), **_mask(causal))
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(f"TransformerEngine's fused attention failed on "
                           f"{_describe(q, k, max_q, max_k, causal)}: {e}") from e
    if tuple(out.shape) != (num_q, num_heads, v.shape[-1]):
        raise RuntimeError(f"TransformerEngine's fused attention returned out "
                           f"{tuple(out.shape)}, expected {(num_q, num_heads, v.shape[-1])}")
    lse = _lse_from_stats(aux[0], cu_q, num_q, num_heads, int(max_q), packed_stats(q.device))
    return out, lse


def te_fused_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int,
                      causal: bool, scale: float):
    """Gradients of one THD fused-attention call given the FINAL ``out [Tq, H, D]`` and
    ``lse [H, Tq]``; returns ``dq [Tq, H, D]``, ``dk, dv [Tk, H_kv, D]`` (q's dtype)."""
    te = _te()
    cu_q, cu_k = _cu(cu_q), _cu(cu_k)
    stats = _stats_from_lse(lse, cu_q, int(max_q), packed_stats(q.device))
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: never read
    try:
        grads = te.bwd(
            max_seqlen_q=int(max_q), max_seqlen_kv=int(max_k), cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k, q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
            o=out.to(q.dtype).contiguous(), d_o=dout.to(q.dtype).contiguous(),
            fake_dtype=q.dtype, aux_ctx_tensors=[stats, rng_state],
            fused_attention_backend=te.backend, cu_seqlens_q_padded=cu_q,
            cu_seqlens_kv_padded=cu_k, attn_scale=float(scale), dropout=0.0,
            qkv_layout="thd_thd_thd", o_format="thd", do_format="thd",
            dqkv_layout="thd_thd_thd", attn_bias_type="no_bias", **_mask(causal))
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(f"TransformerEngine's fused attention backward failed on "
                           f"{_describe(q, k, max_q, max_k, causal)}: {e}") from e
    dq, dk, dv = grads[:3]
    return dq, dk, dv
