"""Ring attention over the cp group: K/V blocks travel around the ring, queries stay.

Layout: per rank, ``q [T, H, D]``, ``k``/``v`` ``[T, H_kv, D]`` for its ``T`` local tokens (any
split: contiguous or zigzag, any local order) with metadata ``doc_id``/``pos`` ``[T]``.
Group: ``group`` (cp), ``cp`` ranks, equal ``T`` on every rank.

Forward, step s = 0 .. cp-1: this rank holds the K/V of rank ``src = (rank - s) % cp``. It posts
the transfer of that block to rank + 1 (receiving rank - 1's) BEFORE computing on it, so on GPU
the NCCL transfer overlaps the attention kernel; it then computes its queries against the block
(skipped when no query sees any key of it: under the contiguous layout every block from a
later rank; under zigzag no block is empty, but only the visible chunk pairs are computed, see
``flash.py``) and merges the partial output with the fp32 log-sum-exp (``merge_partials``).

Backward (custom, also a ring): the same K/V rotation; at step s the block's dK/dV accumulator
(fp32) arrives from rank - 1 with the block, this rank adds its contribution and passes it on.
After the last step one more shift brings every accumulator home (cp transfers of dK/dV in
all). dQ accumulates locally in fp32. Memory: O(T) activations per rank (two K/V blocks, two
dK/dV accumulators); the int metadata of all ranks (``[cp, T]``) is gathered once per call so
every step's mask (or flash plan) is known up front.

Documents are respected through ``doc_id``/``pos`` (``primitive.plan_block``), so packed
streams, padding and both layouts need nothing else.
"""

from __future__ import annotations

import torch

from mpcore.parallel.attention.comm import gather_metadata, ring_shift, wait
from mpcore.parallel.attention.primitive import Block, block_backward, block_forward, plan_block
from mpcore.parallel.attention.reference import compute_dtype, merge_partials
from mpcore.parallel.state import ProcessGroup, group_rank, group_size


class _RingAttention(torch.autograd.Function):
    """forward: ring attention (out in q's dtype, lse fp32 [H, T]); backward: ring of dK/dV
    accumulators travelling with the K/V blocks."""

    @staticmethod
    def forward(ctx, q, k, v, blocks: list[Block], scale: float, group: ProcessGroup):
        acc = compute_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # (2, T, H_kv, D): one message per step
        for step, block in enumerate(blocks):
            last = step == len(blocks) - 1
            if not last:  # post the next block's transfer before computing on this one
                kv_next, works = ring_shift(kv, group)
            if not block.empty:
                out, lse = merge_partials(out, lse, *block_forward(q, kv[0], kv[1], block, scale))
            if not last:
                wait(works)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale, ctx.group = blocks, scale, group
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        blocks, scale, group = ctx.blocks, ctx.scale, ctx.group
        dout = dout.contiguous()
        acc = compute_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv, dkv_works = None, []
        for step, block in enumerate(blocks):
            last = step == len(blocks) - 1
            if not last:
                kv_next, works = ring_shift(kv, group)
            part = None
            if not block.empty:
                dq_b, dk_b, dv_b = block_backward(dout, q, kv[0], kv[1], out, lse, block, scale)
                dq += dq_b
                part = torch.stack([dk_b, dv_b]).to(acc)
            # The accumulator of the block held now arrives from rank - 1 (posted last step).
            wait(dkv_works)
            if dkv is None:
                dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            if part is not None:
                dkv = dkv + part  # a new tensor: the one in flight must stay untouched
            dkv, dkv_works = ring_shift(dkv, group)
            if not last:
                wait(works)
                kv = kv_next
        wait(dkv_works)  # after cp shifts each accumulator is back on its owner
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None)


def plan_ring(q: torch.Tensor, doc_id: torch.Tensor, pos: torch.Tensor,
              group: ProcessGroup | None, cu_seqlens: torch.Tensor | None = None,
              backend: str = "auto") -> list[Block]:
    """The ``cp`` blocks of the ring for ``q``'s path under attention ``backend`` (step s: this
    rank's queries over the keys of rank ``rank - s``). All-gathers the metadata: a collective
    over ``group``."""
    cp, rank = group_size(group), group_rank(group)
    docs, poss = gather_metadata(doc_id, pos, group, q.device)  # (cp, T) each, on the CPU
    me = (docs[rank], poss[rank])
    blocks = [plan_block(q, *me, *me, cu_seqlens, backend)]
    blocks += [plan_block(q, *me, docs[(rank - s) % cp], poss[(rank - s) % cp], None, backend)
               for s in range(1, cp)]
    return blocks


def ring_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[Block],
                scale: float, group: ProcessGroup | None):
    """Ring attention over planned ``blocks`` (:func:`plan_ring`); ``(out, lse)``."""
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), blocks, scale, group)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, doc_id: torch.Tensor,
                   pos: torch.Tensor, group: ProcessGroup | None,
                   cu_seqlens: torch.Tensor | None = None, softmax_scale: float | None = None,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within documents over the whole cp group's stream; returns this rank's
    ``out [T, H, D]`` (q's dtype) and ``lse [H, T]`` (fp32, no gradient).

    ``q [T, H, D]``, ``k``/``v`` ``[T, H_kv, D]``, ``doc_id``/``pos`` ``[T]`` are this rank's
    tokens; ``(doc_id, pos)`` must identify tokens uniquely across the group. ``cu_seqlens``
    (optional, flash path only): local segments whose in-order causal attention is the
    own-block mask (see ``context_attention``); the own-block step then skips its plan. Shapes
    are validated by ``context_attention``.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    blocks = plan_ring(q, doc_id, pos, group, cu_seqlens, backend)
    return ring_attend(q, k, v, blocks, scale, group)
