"""Which kernel runs each call of the attention primitive: backend names and the choice.

Names (``model.attention_backend``; ``AttentionPlan(backend=...)``):
    auto        per kernel call, the fastest backend that takes it (``AUTO_SDPA_MIN_LEN`` and
                ``AUTO_TE_RAGGED_*`` below, from ``tests/perf/results/attention_h200.json``); the
                exact reference where no kernel takes q (CPU, fp32/fp64, odd head dims). Logs
                its choice once.
    flash       PyTorch's flash varlen kernels (``flash.py``): packed segments of any lengths.
                CUDA, fp16/bf16, head dim a multiple of 8 up to 256.
    sdpa_cudnn  dense cuDNN SDPA ``[B, H, L, D]`` (``sdpa_cudnn.py``) for calls whose segments
                all have one length: fixed-length batches (every document of the local stream
                equally long), at cp=1, under Ulysses and in every ring step (it returns the
                lse the ring merge needs, and its backward takes the merged out/lse). A causal
                call needs equal query and key lengths (SDPA's causal mask is top-left
                aligned, flash's bottom-right). CUDA, fp16/bf16, head dim a multiple of 8 up to
                128, compute capability >= 8.0.
    te_fused    TransformerEngine's fused attention (``te_fused.py``): cuDNN on the packed THD
                stream, segments of any lengths (causal bottom-right, as flash), GQA in the
                kernel, the lse the ring needs. Needs TransformerEngine (``mpcore.parallel.te``),
                CUDA, fp16/bf16, head dim a multiple of 8 up to 128, compute capability >= 9.0
                and cuDNN >= 9.6 (what TE's THD path takes). ``auto`` picks it for calls of
                different segment lengths where it measured faster (``AUTO_TE_RAGGED_*``).
    reference   the exact masked attention in PyTorch (``reference.py``), any device and dtype.
A named backend that cannot run a call raises ``ValueError`` saying why; only ``auto`` falls
back. Not offered: the ragged cuDNN path of PyTorch (``aten._cudnn_attention_forward`` with
cu_seqlens), 60 ms per forward in torch 2.11 against 1 ms for flash.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from mpcore.parallel.attention import te_fused
from mpcore.parallel.attention.flash import FLASH_DTYPES, FlashCall

log = logging.getLogger(__name__)

BACKENDS = ("auto", "flash", "sdpa_cudnn", "te_fused", "reference")
KERNEL_BACKENDS = ("flash", "sdpa_cudnn", "te_fused")  # planned as kernel calls (FlashCall)

# auto: dense cuDNN for uniform calls whose longer side has at least this many tokens, flash
# below it. Measured on one H200 (tests/perf/bench_attention.py -> results/attention_h200.json;
# tests/unit/test_attention_backends.py checks this constant against that file), fwd+bwd of
# 16k tokens, 32 q / 8 kv heads, d 64: cuDNN won every uniform case, from 0.97 vs 1.13 ms
# (64 x 256 causal) to 9.30 vs 13.90 ms (1 x 16384), 1.43 vs 2.18 ms on a ring's full block.
# 256 is the shortest length measured; shorter segments stay on flash until measured.
AUTO_SDPA_MIN_LEN = 256
# auto: te_fused instead of flash for calls whose segments have different lengths (packed
# documents, a ring block of them), where TE is usable: every full (non-causal) one, and causal
# ones whose longest segment has at most AUTO_TE_RAGGED_CAUSAL_MAX_LEN tokens. Measured on one
# H200 (TE 2.20.2, cuDNN 9.14; results/attention_h200.json, checked against it by
# tests/unit/test_attention_backends.py), fwd+bwd ms flash vs te_fused: packed 64 documents of
# 196-315 tokens 1.39 vs 1.14; 8 documents of 300-4634 tokens 3.50 vs 3.58; their full ring
# block 3.08 vs 2.30. By length (the uniform causal rows): 1.85 vs 1.61 at 1024, 2.61 vs 2.64
# at 2048, 4.19 vs 4.71 at 4096: te_fused wins up to 1024 tokens, flash from 2048.
AUTO_TE_RAGGED_FULL = True
AUTO_TE_RAGGED_CAUSAL_MAX_LEN = 1024
_logged: set[str] = set()
_TE_USABLE: dict[tuple, bool] = {}  # te_usable's answers


def check_name(name: str) -> str:
    """Return ``name`` when it is a backend name, else raise ``ValueError``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {list(BACKENDS)}")
    return name


def kernel_refusal(backend: str, q: torch.Tensor) -> str | None:
    """Why ``backend``'s kernels cannot take ``q [T, H, D]`` (installed packages, device,
    dtype, head dim, GPU), or None when they can."""
    if backend == "te_fused":
        from mpcore.parallel import (
            te,  # here: mpcore.parallel.te imports the TP layers, attention need not
        )

        if not te.te_available():
            return (f"it needs TransformerEngine and transformer_engine.pytorch cannot be "
                    f"imported; install it ({te.TE_INSTALL})")
    if not q.is_cuda:
        return f"it needs CUDA tensors, got q on {q.device}"
    if q.dtype not in FLASH_DTYPES:
        return f"it takes float16/bfloat16, got {q.dtype}"
    max_dim = 256 if backend == "flash" else 128
    if q.shape[-1] % 8 or q.shape[-1] > max_dim:
        return f"it needs head_dim a multiple of 8 up to {max_dim}, got {q.shape[-1]}"
    if backend == "sdpa_cudnn" and torch.cuda.get_device_capability(q.device) < (8, 0):
        return "cuDNN SDPA needs compute capability >= 8.0"
    if backend == "te_fused":
        return te_fused.runtime_refusal(q.device)
    return None


def uses_kernels(name: str, q: torch.Tensor) -> bool:
    """True when backend ``name`` runs ``q`` through kernel calls (flash planning), False for
    the reference path. Raises ``ValueError`` when a named kernel backend cannot take q."""
    check_name(name)
    if name == "reference":
        return False
    if name == "auto":
        return kernel_refusal("flash", q) is None
    why = kernel_refusal(name, q)
    if why is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {why}; use "
                         f"attention_backend=auto (the exact reference runs where no kernel "
                         f"does) or reference")
    return True


def sdpa_refusal(call: FlashCall) -> str | None:
    """Why dense SDPA cannot run ``call`` (its segments), or None when it can."""
    if not call.uniform:
        return ("its segments have different lengths (documents of different lengths in the "
                "local stream, or pieces of them); dense [B, H, L, D] needs one length")
    if call.causal and call.max_q != call.max_k:
        return (f"it is causal with {call.max_q} queries over {call.max_k} keys per segment; "
                "SDPA's causal mask is top-left aligned, the plan needs bottom-right")
    return None


def te_usable(q: torch.Tensor) -> bool:
    """Whether te_fused takes ``q`` (``kernel_refusal``), for ``auto``: asked only for a call
    ``te_pays`` gives it, and cached per (device, dtype, head dim), so a missing TE is looked
    for once, not at every call."""
    key = (q.device, q.dtype, q.shape[-1])
    if key not in _TE_USABLE:
        _TE_USABLE[key] = kernel_refusal("te_fused", q) is None
    return _TE_USABLE[key]


def te_pays(call: FlashCall) -> bool:
    """Whether te_fused measured faster than flash for ``call``: segments of different lengths,
    full, or causal with the longest at most ``AUTO_TE_RAGGED_CAUSAL_MAX_LEN`` tokens."""
    if call.uniform:
        return False
    if not call.causal:
        return AUTO_TE_RAGGED_FULL
    return max(call.max_q, call.max_k) <= AUTO_TE_RAGGED_CAUSAL_MAX_LEN


def auto_choice(call: FlashCall, sdpa_available: bool, te_available: bool = False) -> str:
    """``auto``'s backend for ``call``: dense cuDNN where it runs the call (uniform segments,
    cuDNN usable for q) and the longer side has at least ``AUTO_SDPA_MIN_LEN`` tokens, where
    it measured faster than flash; te_fused for calls of different segment lengths where it
    measured faster (``te_pays``) and TE is usable (``te_available``); flash otherwise."""
    if (sdpa_available and sdpa_refusal(call) is None
            and max(call.max_q, call.max_k) >= AUTO_SDPA_MIN_LEN):
        return "sdpa_cudnn"
    if te_available and te_pays(call):
        return "te_fused"
    return "flash"


def assign(name: str, call: FlashCall, q: torch.Tensor) -> FlashCall:
    """``call`` with its ``backend`` set for backend ``name`` (a kernel backend or auto; q
    already accepted by :func:`uses_kernels`). Raises ``ValueError`` when the named backend
    cannot run this call. te_fused runs every planned call (any segment lengths; the planner
    gives no causal segment more queries than keys, ``te_fused.py``)."""
    if name in ("flash", "te_fused"):
        return replace(call, backend=name)
    if name == "sdpa_cudnn":
        why = sdpa_refusal(call)
        if why is not None:
            raise ValueError(f"attention backend 'sdpa_cudnn' cannot run this attention call: "
                             f"{why}; use attention_backend=auto or flash")
        return replace(call, backend="sdpa_cudnn")
    te_ok = te_pays(call) and te_usable(q)
    chosen = auto_choice(call, kernel_refusal("sdpa_cudnn", q) is None, te_ok)
    if chosen not in _logged:
        _logged.add(chosen)
        log.info("attention_backend=auto: %s for %s calls (segments %d x %d)", chosen,
                 "causal" if call.causal else "full", call.max_q, call.max_k)
    return replace(call, backend=chosen)
