"""Gated DeltaNet under context parallelism: an all-to-all from "tokens split" to "heads split".

Layout in: each cp rank holds its L local tokens (``mpcore.parallel.context``: zigzag per document, or
contiguous) for ALL of this tp rank's DeltaNet heads: the conv input ``[L, C]`` (channels
``[q | k | v]``, heads in order) and the gates ``g, beta [L, Hv]``. One all-to-all over the cp
group (``mpcore.parallel.collectives.all_to_all_tokens_to_heads``) turns that into every token of the
group, rank-major (``[cp * L, ...]``), for 1/cp of the heads: cp rank j takes key heads
``[j Hk/cp, (j+1) Hk/cp)`` of q and k and the value heads grouped on them. The tokens are then
put in stream order, documents whole (sorted by ``(doc_id, position)`` from the gathered
``AttentionPlan`` metadata: that is the ContextPlan's global order, each padding run a segment
of its own after the documents), so the convolution and the recurrence run each document from
its first token with no state from anywhere else. The output goes back the same way (inverse
permutation, inverse all-to-all): ``[L, Hv, Dv]`` on this rank's tokens.

Why heads and not the state: the recurrence is sequential along a document, so a split of one
document over ranks would have to pass each chunk boundary's state ``[H, Dk, Dv]`` (and the conv
window) from rank to rank, serialising the ranks along the document (or a two-pass scan that
first propagates the decays), and do it again backwards; under zigzag every document has 2 cp
boundaries. Heads are independent, so after one all-to-all each rank runs whole documents with
the same kernel as cp = 1, and the cost is two all-to-alls of the layer's activations, like
Ulysses attention. It needs the heads to divide by tp x cp (``Qwen35Config.check_parallel``).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from mpcore.kernels import host_checked
from mpcore.parallel.attention import AttentionPlan
from mpcore.parallel.attention.comm import gather_metadata
from mpcore.parallel.collectives import all_to_all_heads_to_tokens, all_to_all_tokens_to_heads
from mpcore.parallel.state import group_rank, group_size


class Sequence(NamedTuple):
    """The tokens a DeltaNet layer runs, in the order it runs them."""

    order: torch.Tensor | None  # (N,) int64: run order -> gathered position; None: as is
    inverse: torch.Tensor | None  # (N,) int64: gathered position -> run order
    positions: torch.Tensor  # (N,) int64, position inside its segment (run order)
    cu_seqlens: torch.Tensor  # (S+1,) int64 segments in run order
    cu_host: torch.Tensor | None = None  # the same on the host when known there without a sync


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _segments(doc_id: torch.Tensor) -> torch.Tensor:
    _, counts = torch.unique_consecutive(doc_id, return_counts=True)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def sequence_of(plan: AttentionPlan, device) -> Sequence:
    """The run order of ``plan``'s tokens (module docstring): the local stream when cp = 1,
    the gathered stream sorted into documents when cp > 1 (a collective over ``plan.group``
    on the first call; cached per plan, so every layer and a checkpointed recompute reuse it)."""
    if plan in _CACHE:
        return _CACHE[plan]
    if plan.cp == 1:
        # The local stream is contiguous per segment: positions restart at each segment. The
        # segments on the host too (the batch's kept copy, or found there: a sync when doc_id
        # is on the device), so fla's kernels plan their chunks without asking the device.
        cu = plan.cu_seqlens
        host = _segments(plan.doc_id.cpu()) if cu is None else host_checked.host_copy(cu)
        seq = Sequence(None, None, plan.pos.to(device),
                       (host if cu is None else cu).to(device, torch.int64),
                       None if host is None else host.to(torch.int64))
    else:
        docs, poss = gather_metadata(plan.doc_id, plan.pos, plan.group, device)  # (cp, L)
        doc, pos = docs.reshape(-1), poss.reshape(-1)
        key = doc * (int(pos.max()) + 1) + pos  # stream order: documents, then positions
        order = torch.sort(key, stable=True).indices
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        seq = Sequence(order.to(device), inverse.to(device), pos[order].to(device),
                       _segments(doc[order]).to(device))
    _CACHE[plan] = seq
    return seq


def _by_rank(t: torch.Tensor, cp: int) -> torch.Tensor:
    """``[L, H, ...] -> [L, cp, H/cp * ...]``: heads grouped by the cp rank that runs them."""
    return t.reshape(t.shape[0], cp, -1)


def heads_split(conv_in: list[torch.Tensor], gates: torch.Tensor, plan: AttentionPlan,
                seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens-split -> heads-split: ``conv_in`` = ``[q [L, Hk, Dk], k, v [L, Hv, Dv]]`` and
    ``gates [L, Hv, 2]`` (fp32: g, beta) -> ``([N, C / cp], [N, Hv / cp, 2])`` in run order,
    N = cp * L. Identity but for the order at cp = 1."""
    cp = plan.cp
    x = torch.cat([_by_rank(t, cp) for t in conv_in], dim=-1)  # (L, cp, C/cp)
    y = _by_rank(gates, cp)
    if cp > 1:
        x = all_to_all_tokens_to_heads(x.contiguous(), plan.group)  # (cp L, 1, C/cp)
        y = all_to_all_tokens_to_heads(y.contiguous(), plan.group)
    x, y = x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1, 2)
    if seq.order is not None:
        x, y = x.index_select(0, seq.order), y.index_select(0, seq.order)
    return x, y


def tokens_split(out: torch.Tensor, plan: AttentionPlan, seq: Sequence) -> torch.Tensor:
    """Heads-split -> tokens-split: ``[N, Hv / cp, Dv]`` in run order -> ``[L, Hv, Dv]``."""
    if seq.inverse is not None:
        out = out.index_select(0, seq.inverse)
    heads, dv = out.shape[1:]
    if plan.cp > 1:
        out = all_to_all_heads_to_tokens(out.reshape(out.shape[0], 1, -1).contiguous(),
                                         plan.group)  # (L, cp, Hv/cp * Dv)
    return out.reshape(out.shape[0], group_size(plan.group) * heads, dv)


def rank_channels(weight: torch.Tensor, sizes: list[int], plan: AttentionPlan) -> torch.Tensor:
    """The conv weight rows ``[C / cp, K]`` of the heads this cp rank runs (``sizes``: the q, k,
    v channel counts of ``weight [C, K]``)."""
    if plan.cp == 1:
        return weight
    rank = group_rank(plan.group)
    return torch.cat([part.reshape(plan.cp, -1, part.shape[-1])[rank]
                      for part in weight.split(sizes)])
