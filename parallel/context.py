"""Context-parallel split of a packed stream: padding, each rank's tokens, gather back.

The global packed stream has T tokens in D documents (``cu_seqlens [D+1]``, see
``parallel/labels.py``). A :class:`ContextPlan` pads it and assigns every padded position to one
of ``cp`` ranks; every per-token tensor (ids, shifted labels, position ids ``[T]`` or M-RoPE
``[3, T]``, loss weights, hidden states ``[T, H]`` with ``dim=0``) is split by the same plan, so
tokens and their labels never part. Labels are shifted BEFORE the split (``LabelShifter``).

Padding. Document d of length n_d gets a padded length p_d >= n_d:
  - ``zigzag``: p_d is n_d rounded up to a multiple of 2*cp; the last document's padding then
    grows until the padded total P is a multiple of cp * lcm(2, pad_multiple).
  - ``contiguous``: p_d = n_d except for the last document, whose padding makes P a multiple of
    cp * pad_multiple.
  So each rank holds L = P / cp tokens, a multiple of ``pad_multiple`` (pass tp when sequence
  parallelism splits the local tokens again). The padded stream is: doc 0's real tokens, doc
  0's padding, doc 1's real tokens, ... A padding run is its own attention segment (it never
  meets a real token), its labels are ``ignore_index`` and :meth:`ContextPlan.gather` drops it.

Ownership, in padded positions; each rank keeps its tokens in padded-stream order:
  - ``contiguous``: rank r holds padded positions [r*L, (r+1)*L).
  - ``zigzag``: padded document d is cut into 2*cp chunks of c_d = p_d / (2*cp) tokens; rank r
    holds chunk r and chunk 2*cp-1-r of EVERY document. Local stream: doc 0 chunk r, doc 0
    chunk 2cp-1-r, doc 1 chunk r, ... Causal work per rank is then equal on padded documents.

Per rank, :meth:`ContextPlan.rank_layout` gives a :class:`RankLayout` of L local tokens:
  - ``global_index [L]`` int64: index in the unpadded stream, -1 for padding.
  - ``doc_id [L]`` int64: document 0..D-1 of a real token; padding of document d has id D + d.
  - ``positions_in_doc [L]`` int64: position inside its segment (real: in the document;
    padding: in its padding run, from 0).
  - ``cu_seqlens [S+1]`` int32 and ``max_seqlen``: local attention segments, the maximal runs of
    equal ``doc_id``. A document's two zigzag chunks form one local segment: chunk r precedes
    chunk 2cp-1-r in the document, so causal attention on local keys is right.
  - ``chunks``: ``Chunk(doc, local_start, doc_start, length)``, in local order; ``doc_start``
    is the offset inside padded document ``doc`` (offsets < n_d are real tokens). Zigzag: exactly
    two per document, chunk r then chunk 2cp-1-r, c_d tokens each (kept apart even where they
    touch, at r = cp-1). Contiguous: the maximal local runs inside one padded document.
  The mask between any query i and key j, on any ranks: j is visible to i iff
  ``doc_id[j] == doc_id[i]`` and (causal) ``positions_in_doc[j] <= positions_in_doc[i]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import NamedTuple

import torch

from mpcore.parallel.collectives import gather_along
from mpcore.parallel.labels import check_cu_seqlens
from mpcore.parallel.state import ProcessGroup, group_size

__all__ = ["LAYOUTS", "Chunk", "ContextPlan", "RankLayout", "split_batch"]

LAYOUTS = ("contiguous", "zigzag")


class Chunk(NamedTuple):
    doc: int  # document index 0..D-1
    local_start: int  # first local position of the chunk
    doc_start: int  # offset of its first token inside the padded document
    length: int


@dataclass(frozen=True)
class RankLayout:
    """One cp rank's tokens; shapes ``[L]`` with L = ``ContextPlan.local_length``."""

    rank: int
    global_index: torch.Tensor  # (L,) int64, -1 for padding
    doc_id: torch.Tensor  # (L,) int64, D + d for the padding of document d
    positions_in_doc: torch.Tensor  # (L,) int64, position inside the segment
    cu_seqlens: torch.Tensor  # (S+1,) int32, local attention segments
    max_seqlen: int
    _make_chunks: Callable[[], tuple[Chunk, ...]] = field(repr=False, compare=False)

    @cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        """Runs of local tokens contiguous in one document chunk (made on first use: a batch
        of short documents has thousands, and training never reads them)."""
        return self._make_chunks()


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _token_dim(tensor, dim: int, name: str) -> int:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0 or not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, which has no dim {dim}; pass "
                         f"dim= naming its token dimension (-1 for [T] / [3, T], 0 for [T, H])")
    return dim % tensor.dim()


class ContextPlan:
    """How a packed stream of ``total`` tokens is padded and split over ``cp`` ranks.

    ``cu_seqlens [D+1]`` (``None`` = one document of ``total`` tokens); ``total`` may be ``None``
    when ``cu_seqlens`` is given. ``layout`` is ``"contiguous"`` or ``"zigzag"``;
    ``pad_multiple`` makes each rank's local length a multiple of it (tp under SP). The plan is
    host-side metadata (int64 CPU tensors), built once per batch on every cp rank.
    """

    def __init__(self, cu_seqlens, total: int | None, cp: int, layout: str,
                 pad_multiple: int = 1):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown context-parallel layout {layout!r}; use one of {LAYOUTS}")
        self.cp = _positive_int(cp, "cp")
        self.pad_multiple = _positive_int(pad_multiple, "pad_multiple")
        self.layout = layout
        if total is None:
            if cu_seqlens is None:
                raise ValueError("pass total (the stream length) or cu_seqlens, or both")
            ends = torch.as_tensor(cu_seqlens)
            total = int(ends[-1]) if ends.dim() == 1 and ends.numel() >= 2 else 0
            check_cu_seqlens(ends, total)  # shape and order errors name the real problem
        self.total = _positive_int(total, "total")
        cu = check_cu_seqlens(cu_seqlens, self.total).cpu()
        self.cu_seqlens = cu  # (D+1,) int64
        self.num_docs = cu.numel() - 1
        self.doc_lengths = cu[1:] - cu[:-1]  # (D,)
        cp2 = 2 * self.cp
        if layout == "zigzag":
            padded = (self.doc_lengths + cp2 - 1) // cp2 * cp2
            unit = self.cp * math.lcm(2, self.pad_multiple)
        else:
            padded = self.doc_lengths.clone()
            unit = self.cp * self.pad_multiple
        padded[-1] += -int(padded.sum()) % unit  # extra padding joins the last document's
        self.padded_doc_lengths = padded  # (D,)
        self.padded_cu_seqlens = torch.cat([cu.new_zeros(1), padded.cumsum(0)])  # (D+1,)
        self.padded_total = int(self.padded_cu_seqlens[-1])
        self.local_length = self.padded_total // self.cp
        self._build_index()
        self._layouts: dict[int, RankLayout] = {}

    def _build_index(self) -> None:
        """Per padded position: document, offset, real index and owner; per rank: positions."""
        num_padded = self.padded_total
        doc = torch.repeat_interleave(torch.arange(self.num_docs), self.padded_doc_lengths)
        offset = torch.arange(num_padded) - self.padded_cu_seqlens[doc]  # in the padded doc
        length = self.doc_lengths[doc]
        real = offset < length
        self._doc = doc  # (P,)
        self._offset = offset  # (P,)
        self._global = torch.where(real, self.cu_seqlens[doc] + offset, -1)  # (P,)
        self._doc_id = torch.where(real, doc, doc + self.num_docs)  # (P,)
        self._position = torch.where(real, offset, offset - length)  # (P,)
        if self.layout == "zigzag":
            chunk = offset // (self.padded_doc_lengths[doc] // (2 * self.cp))
            owner = torch.minimum(chunk, 2 * self.cp - 1 - chunk)
        else:
            owner = torch.arange(num_padded) // self.local_length
            chunk = owner
        self._chunk = chunk  # (P,) zigzag chunk index in its document; the owner if contiguous
        # Stable sort by owner keeps padded-stream order inside each rank.
        order = torch.sort(owner, stable=True).indices
        self._local = order.view(self.cp, self.local_length)  # (cp, L) padded positions
        assert bool((owner[self._local] == torch.arange(self.cp)[:, None]).all())
        # Position of each global token in the rank-major concatenation of all local shards.
        flat = self._global[self._local.reshape(-1)]
        keep = flat >= 0
        self._gather_order = torch.empty(self.total, dtype=torch.int64)
        self._gather_order[flat[keep]] = torch.arange(flat.numel())[keep]

    def __repr__(self) -> str:
        return (f"ContextPlan(total={self.total}, docs={self.num_docs}, cp={self.cp}, "
                f"layout={self.layout!r}, pad_multiple={self.pad_multiple}, "
                f"padded_total={self.padded_total}, local_length={self.local_length})")

    def _check_rank(self, rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.cp:
            raise ValueError(f"rank must be an int in [0, {self.cp}) for cp={self.cp}, got "
                             f"{rank!r}; pass the cp rank (ParallelState.cp_rank)")
        return rank

    def rank_layout(self, rank: int) -> RankLayout:
        """Local tokens of cp rank ``rank`` (module docstring); cached."""
        rank = self._check_rank(rank)
        if rank not in self._layouts:
            self._layouts[rank] = self._make_layout(rank)
        return self._layouts[rank]

    def _make_layout(self, rank: int) -> RankLayout:
        local = self._local[rank]  # (L,) padded positions
        doc_id = self._doc_id[local]
        starts = torch.ones_like(doc_id, dtype=torch.bool)
        starts[1:] = doc_id[1:] != doc_id[:-1]
        bounds = torch.cat([starts.nonzero().view(-1), torch.tensor([local.numel()])])
        assert torch.unique(doc_id).numel() == bounds.numel() - 1, "a segment split locally"
        return RankLayout(rank=rank, global_index=self._global[local], doc_id=doc_id,
                          positions_in_doc=self._position[local],
                          cu_seqlens=bounds.to(torch.int32),
                          max_seqlen=int((bounds[1:] - bounds[:-1]).max()),
                          _make_chunks=partial(self._chunks, local))

    def _chunks(self, local: torch.Tensor) -> tuple[Chunk, ...]:
        """Runs of ``local`` (padded positions) that are contiguous in one (zigzag) chunk."""
        doc, chunk = self._doc[local], self._chunk[local]
        firsts = torch.ones_like(local, dtype=torch.bool)
        firsts[1:] = ((local[1:] != local[:-1] + 1) | (doc[1:] != doc[:-1])
                      | (chunk[1:] != chunk[:-1]))
        first = firsts.nonzero().view(-1)
        # Python ints in three lists: indexing a tensor per chunk costs microseconds each, and
        # a batch of short documents has thousands of chunks.
        starts, docs = first.tolist(), doc[first].tolist()
        offsets = self._offset[local[first]].tolist()
        ends = [*starts[1:], local.numel()]
        return tuple(Chunk(d, s, o, e - s)
                     for d, s, o, e in zip(docs, starts, offsets, ends, strict=True))

    def split(self, tensor: torch.Tensor, rank: int, dim: int = -1, pad_value=0,
              name: str = "tensor") -> torch.Tensor:
        """This rank's part of a per-token ``tensor`` (T along ``dim``), L along ``dim``.

        Padding is filled with ``pad_value`` (``ignore_index`` for labels). Differentiable.
        Raises ``ValueError`` if ``tensor`` does not have exactly T tokens along ``dim``.
        """
        dim = _token_dim(tensor, dim, name)
        if tensor.shape[dim] != self.total:
            raise ValueError(f"{name} has {tensor.shape[dim]} tokens along dim {dim} (shape "
                             f"{tuple(tensor.shape)}) but the plan is for T={self.total}; split "
                             f"the global (unsplit, unpadded) stream, and give dim= for [T, H]")
        index = self.rank_layout(rank).global_index.to(tensor.device)
        out = tensor.index_select(dim, index.clamp(min=0))
        pad = (index < 0).view([-1 if d == dim else 1 for d in range(tensor.dim())])
        return out.masked_fill(pad, pad_value)

    def _check_local(self, tensor, dim: int, name: str) -> int:
        dim = _token_dim(tensor, dim, name)
        if tensor.shape[dim] != self.local_length:
            raise ValueError(f"{name} has {tensor.shape[dim]} tokens along dim {dim} but each "
                             f"rank holds L={self.local_length} under this plan; pass the local "
                             f"tensor made by ContextPlan.split with the same plan")
        return dim

    def gather_from_shards(self, shards, dim: int = -1) -> torch.Tensor:
        """Global tensor (T along ``dim``, padding removed) from all ranks' local tensors.

        ``shards``: the ``cp`` local tensors in rank order. Single-process; for tests and tools.
        """
        if len(shards) != self.cp:
            raise ValueError(f"got {len(shards)} shards for cp={self.cp}; pass one per rank, "
                             f"in rank order")
        dims = {self._check_local(s, dim, f"shards[{i}]") for i, s in enumerate(shards)}
        if len({s.shape for s in shards}) != 1:
            raise ValueError(f"shards have different shapes {[tuple(s.shape) for s in shards]}; "
                             f"every rank's local tensor must have the same shape")
        (dim,) = dims
        return self._reorder(torch.cat(list(shards), dim), dim)

    def _reorder(self, stacked: torch.Tensor, dim: int) -> torch.Tensor:
        return stacked.index_select(dim, self._gather_order.to(stacked.device))

    def gather(self, local: torch.Tensor, group: ProcessGroup | None,
               dim: int = -1) -> torch.Tensor:
        """All-gather ``local`` (L along ``dim``) over the cp ``group``; T along ``dim``, in order.

        Padding is removed. Backward returns this rank's slice of the incoming gradient (not a
        sum over ranks): right when every cp rank uses the gathered tensor identically, the
        usual case (e.g. all ranks compute the same global scores).
        """
        if group_size(group) != self.cp:
            raise ValueError(f"group has {group_size(group)} ranks but the plan is for "
                             f"cp={self.cp}; pass the cp group (ParallelState.cp_group)")
        dim = self._check_local(local, dim, "local")
        if self.cp == 1:
            return self._reorder(local, dim)
        stacked = gather_along(local, dim, group)
        return self._reorder(stacked, dim)


def _pad_value(key: str, tensor: torch.Tensor, ignore_index: int, pad_id: int, pad_values):
    if key in pad_values:
        return pad_values[key]
    if key == "labels" or key.startswith("mtp_labels"):  # LabelShifter.mtp's, per depth
        return ignore_index
    if key == "input_ids" or key.startswith("mtp_input_ids"):
        return pad_id
    return False if tensor.dtype == torch.bool else 0


def split_batch(batch: dict, plan: ContextPlan, rank: int, *, ignore_index: int = -100,
                pad_id: int = 0, pad_values: dict | None = None, replicate=(),
                token_dims: dict | None = None) -> dict:
    """Split every per-token tensor of a packed ``batch`` for cp rank ``rank``, together.

    Every tensor value must have exactly T = ``plan.total`` tokens along its token dim (last by
    default; ``token_dims={"key": 0}`` for e.g. ``[T, H]``); keys listed in ``replicate`` pass
    through unchanged; ``cu_seqlens``, if present, must match the plan. Anything else raises
    ``ValueError``: nothing is passed on unsplit by accident. Padding gets ``ignore_index`` for
    ``labels`` (and ``mtp_labels*``), ``pad_id`` for ``input_ids`` (and ``mtp_input_ids*``),
    False/0 otherwise, or ``pad_values[key]``.
    The result has the same keys, plus ``cu_seqlens``: this rank's local segments (int32).
    """
    pad_values = dict(pad_values or {})
    token_dims = dict(token_dims or {})
    replicate = set(replicate)
    out, device = {}, None
    for key, value in batch.items():
        if key in replicate:
            out[key] = value
        elif key == "cu_seqlens":
            cu = check_cu_seqlens(value, plan.total).cpu()
            if not torch.equal(cu, plan.cu_seqlens):
                raise ValueError("batch['cu_seqlens'] differs from the plan's; build the plan "
                                 "from this batch's cu_seqlens")
            device = value.device if isinstance(value, torch.Tensor) else device
        elif isinstance(value, torch.Tensor):
            dim = token_dims.get(key, -1)
            out[key] = plan.split(value, rank, dim,
                                  _pad_value(key, value, ignore_index, pad_id, pad_values),
                                  name=f"batch[{key!r}]")
            device = value.device if device is None else device
        else:
            raise ValueError(f"batch[{key!r}] is a {type(value).__name__}, not a per-token "
                             f"tensor; convert per-token data to a tensor with T={plan.total} "
                             f"tokens, or list the key in replicate= to pass it through")
    out["cu_seqlens"] = plan.rank_layout(rank).cu_seqlens.to(device or "cpu")
    return out
