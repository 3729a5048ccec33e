"""Ulysses attention: all-to-all tokens <-> heads over the cp group, full-sequence attention on
this rank's heads, all-to-all back.

Layout: per rank ``q [T, H, D]``, ``k``/``v`` ``[T, H_kv, D]``, ``doc_id``/``pos`` ``[T]``
(its local tokens, any split). Group: ``group`` (cp), equal ``T`` on every rank.

After ``all_to_all_tokens_to_heads`` a rank holds ``[cp * T, H / cp, D]``: every token of the
group, in rank-major order (rank 0's local tokens, then rank 1's, ...), for heads
``[rank * H / cp, (rank + 1) * H / cp)``. Rank-major is not the global order under zigzag;
the mask uses the all-gathered ``doc_id``/``pos``, not token order, so the reference path needs
nothing more, and the flash path's plan sorts the tokens into document order before its one
causal call and scatters the output back (``flash.py``).

Heads: ``H % cp == 0`` is required. KV heads are replicated (``repeat_interleave``) by
``r = cp / gcd(H_kv, cp)`` so that ``H_kv * r`` divides over cp ranks (e.g. ``H_kv < cp``);
kv head ``c`` of the replicated set is original head ``c // r``, which keeps every rank's
query heads paired with their own kv heads. Autograd sums the replicas' gradients.
"""

from __future__ import annotations

import math

import torch

from mpcore.parallel.attention.comm import gather_metadata
from mpcore.parallel.attention.primitive import Block, attend_block, plan_block
from mpcore.parallel.collectives import all_to_all_heads_to_tokens, all_to_all_tokens_to_heads
from mpcore.parallel.state import ProcessGroup, group_size


def check_ulysses_heads(num_heads: int, cp: int) -> None:
    """Raise ``ValueError`` when the query heads do not split over the cp group."""
    if num_heads % cp != 0:
        raise ValueError(f"ulysses attention needs heads % cp == 0, got heads={num_heads}, "
                         f"cp={cp}; choose cp dividing {num_heads} or use mode='ring'")


def plan_ulysses(q: torch.Tensor, doc_id: torch.Tensor, pos: torch.Tensor,
                 group: ProcessGroup | None, backend: str = "auto") -> Block:
    """The block of the gathered (rank-major) stream for ``q``'s path under attention
    ``backend``. All-gathers the metadata: a collective over ``group``."""
    docs, poss = gather_metadata(doc_id, pos, group, q.device)  # (cp, T): rank-major
    flat_doc, flat_pos = docs.reshape(-1), poss.reshape(-1)
    return plan_block(q, flat_doc, flat_pos, flat_doc, flat_pos, None, backend)


def ulysses_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block,
                   scale: float, group: ProcessGroup | None) -> torch.Tensor:
    """Ulysses attention with the gathered stream's block planned (:func:`plan_ulysses`)."""
    cp = group_size(group)
    check_ulysses_heads(q.shape[1], cp)
    repeat = cp // math.gcd(k.shape[1], cp)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q_h, k_h, v_h = (all_to_all_tokens_to_heads(t.contiguous(), group) for t in (q, k, v))
    out_h, _ = attend_block(q_h, k_h, v_h, block, scale)
    return all_to_all_heads_to_tokens(out_h, group)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      doc_id: torch.Tensor, pos: torch.Tensor, group: ProcessGroup | None,
                      softmax_scale: float | None = None,
                      backend: str = "auto") -> torch.Tensor:
    """Causal attention within documents over the cp group's whole stream; returns this rank's
    ``out [T, H, D]`` (q's dtype). Shapes are validated by ``context_attention``."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    block = plan_ulysses(q, doc_id, pos, group, backend)
    return ulysses_attend(q, k, v, block, scale, group)
