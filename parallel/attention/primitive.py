"""The attention primitive: varlen causal attention that also returns the log-sum-exp.

Layout: packed streams. ``q [T, H, D]``, ``k``/``v`` ``[S, H_kv, D]`` with ``H % H_kv == 0``
(GQA), per-token integer metadata ``doc [T]``/``[S]`` (opaque document labels) and ``pos``
(position inside the document). Query t sees key s iff ``doc_k[s] == doc_q[t]`` and
``pos_k[s] <= pos_q[t]``. Outputs: ``out [T, H, D]`` (q's dtype) and ``lse [H, T]`` fp32
(float64 for float64 inputs), ``lse = log sum_s exp(scale * q.k_s)`` over the visible keys.

The backend (``backends.py``: ``auto``, ``flash``, ``sdpa_cudnn``, ``te_fused``, ``reference``)
selects the path: the kernel backends plan the metadata on the host into at most one causal and
one non-causal segment call (``flash.py``), each run by PyTorch's flash varlen kernels, by
TransformerEngine's THD fused attention (``te_fused.py``) or, when its segments all have one
length, dense cuDNN SDPA (``sdpa_cudnn.py``); the reference path is
the exact masked attention (``reference.py``), which ``auto`` takes where no kernel takes q
(CPU, fp32). All expose the same block interface used by the ring: ``plan_block`` once per
(query side, key side), then ``block_forward``/``block_backward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpcore.parallel.attention import backends, flash
from mpcore.parallel.attention.reference import any_visible, reference_backward, reference_forward


def use_flash(q: torch.Tensor, backend: str = "auto") -> bool:
    """True when ``q`` (and its k/v) go to the kernel path (flash planning; flash or dense
    cuDNN calls) under ``backend``, False for the exact reference. ``auto``: CUDA, fp16/bf16,
    head dim a multiple of 8 up to 256. Raises ``ValueError`` when a named kernel backend
    cannot take q."""
    return backends.uses_kernels(backend, q)


@dataclass(frozen=True)
class Block:
    """How the attention of one query side over one key side is computed.

    ``calls``: kernel calls (kernel path, each with its backend) or None; ``meta``: ``(doc_q, pos_q, doc_k,
    pos_k)`` on the tensors' device (reference path) or None; ``empty``: no query sees any key.
    """

    calls: list[flash.FlashCall] | None
    meta: tuple[torch.Tensor, ...] | None
    empty: bool


def plan_block(q: torch.Tensor, doc_q, pos_q, doc_k, pos_k,
               cu_seqlens: torch.Tensor | None = None, backend: str = "auto") -> Block:
    """Plan queries ``(doc_q, pos_q) [T]`` over keys ``(doc_k, pos_k) [S]`` for ``q``'s path
    under attention ``backend`` (``backends.BACKENDS``).

    ``cu_seqlens`` (kernel path only): the query and key sides are the same tokens, in order,
    documents cut at ``cu_seqlens``; it skips the host-side plan. The metadata may live on the
    CPU (no CPU-GPU sync on the kernel path) or on q's device. Raises ``ValueError`` when a
    named backend cannot run q or one of the calls (``backends.py`` says why).
    """
    if use_flash(q, backend):
        if cu_seqlens is not None:
            calls = flash.plan_cu_seqlens(cu_seqlens, q.device)
        else:
            calls = flash.plan_flash(doc_q, pos_q, doc_k, pos_k, q.device)
        calls = [backends.assign(backend, c, q) for c in calls]
        return Block(calls, None, not calls)
    meta = tuple(t.to(q.device) for t in (doc_q, pos_q, doc_k, pos_k))
    return Block(None, meta, not any_visible(*meta))


def block_forward(q, k, v, block: Block, scale: float):
    """``out [T, H, D]`` and ``lse [H, T]`` for one block (lse in the accumulation dtype, fp32;
    out too, or in q's dtype where ``flash.run_forward`` says so); rows that see nothing get
    0 and -inf. No autograd."""
    if block.calls is not None:
        return flash.run_forward(q, k, v, block.calls, scale)
    return reference_forward(q, k, v, *block.meta, scale)


def block_backward(dout, q, k, v, out, lse, block: Block, scale: float):
    """``dq [T, H, D]``, ``dk, dv [S, H_kv, D]`` of one block (accumulation dtype, or the
    inputs' where ``flash.run_backward`` says so), given the final ``out`` and ``lse`` of every
    query row over all blocks. No autograd."""
    if block.calls is not None:
        return flash.run_backward(dout, q, k, v, out, lse, block.calls, scale)
    return reference_backward(dout, q, k, v, out, lse, *block.meta, scale)


class _Attention(torch.autograd.Function):
    """forward: masked attention of one block (out in q's dtype, lse); backward: the block's
    gradients. ``lse`` is an output without gradient."""

    @staticmethod
    def forward(ctx, q, k, v, block, scale):
        out, lse = block_forward(q, k, v, block, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block, ctx.scale = block, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout.contiguous(), q, k, v, out, lse, ctx.block, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       doc_q: torch.Tensor, pos_q: torch.Tensor,
                       doc_k: torch.Tensor | None = None, pos_k: torch.Tensor | None = None,
                       cu_seqlens: torch.Tensor | None = None,
                       softmax_scale: float | None = None, backend: str = "auto"):
    """Causal attention within documents, with autograd. Returns ``(out [T, H, D], lse [H, T])``.

    ``doc_k``/``pos_k`` default to the query metadata (self-attention, ``S == T``). Shapes are
    the caller's to check (``mpcore.parallel.attention.context_attention`` validates them).
    ``backend``: see ``backends.py``.
    """
    if doc_k is None or pos_k is None:
        doc_k, pos_k = doc_q, pos_q
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    block = plan_block(q, doc_q, pos_q, doc_k, pos_k, cu_seqlens, backend)
    return attend_block(q, k, v, block, scale)


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block,
                 scale: float):
    """:func:`attention_with_lse` with the block already planned (``plan_block``)."""
    return _Attention.apply(q, k, v, block, scale)
