"""Next-token labels, computed once on the GLOBAL packed stream, before any split.

Layout: a packed stream ``input_ids [T]`` holds documents end to end; ``cu_seqlens [D+1]``
(int32 or int64) gives their offsets, document d being ``input_ids[cu_seqlens[d]:cu_seqlens[d+1]]``;
``None`` means one document. The labels are ``[T]`` int64:

    labels[t] = input_ids[t+1]   if t+1 is in the same document as t,
                                 loss_mask[t+1] is true (or no mask is given), and
                                 input_ids[t+1] is not in ignore_token_ids
                ignore_index     otherwise; so the last token of every document is ignored.

Why only here: rolling ``input_ids`` by -1 after the context/sequence split gives the last token
of every shard the first token of its own shard as target, and a roll over a packed stream
makes the last token of a document predict the first token of the next. Both train silently.
Shift here, then split the labels together with every other per-token tensor
(``parallel/context.py``).

Multi-token prediction shifts further, by the same rule. The depth-k block (k = 1..D) sees at
position t the token k places ahead and predicts the one k+1 places ahead:

    mtp_ids_k[t]    = input_ids[t+k]     if t+k is in t's document,    fill_id otherwise
    mtp_labels_k[t] = input_ids[t+k+1]   under the three conditions above with t+1 -> t+k+1,
                                         ignore_index otherwise

so the last k+1 tokens of every document have no depth-k target, and a document of k+1 tokens
or fewer gives none. ``labels`` is the case ``shift=1`` (:meth:`LabelShifter.__call__`), bit for
bit what it always was. A ``fill_id`` input never reaches a target: it sits only at positions
whose own label is ignored, and attention never crosses into the next document. The shift must
be taken here, on the global stream, for the same two reasons as above, only worse: at depth k
a shift after the split gets k+1 wrong targets at every shard's end.

Documents are non-empty: ``cu_seqlens`` must start at 0, be strictly increasing and end at T.
An empty document (a repeated offset) is rejected; drop it when packing.

A padded batch ``[B, S]`` with an ``attention_mask`` (1 = real token) is accepted by
:meth:`LabelShifter.from_padded`; each row's real tokens must form one contiguous run (right,
left, or both-sided padding); holes inside a row are rejected. :func:`pack_padded` turns such a
batch into the packed form. :func:`position_ids` gives positions that restart at 0 in every
document.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from mpcore.kernels import host_checked

__all__ = ["LabelShifter", "MtpTargets", "PackedBatch", "check_cu_seqlens", "pack_padded",
           "position_ids"]

IGNORE_INDEX = -100  # the label of positions without a target (LabelShifter's default)


def _check_ids(ids, name: str, ndim: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of token ids, got "
                         f"{type(ids).__name__}; wrap it with torch.tensor(..., dtype=torch.long)")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}; convert "
                         f"with .long() once you know the values are whole token ids")
    if ids.dim() != ndim:
        hint = ("a packed stream [T]; for a padded [B, S] batch call "
                "LabelShifter.from_padded(input_ids, attention_mask) or pack_padded(...)"
                if ndim == 1 else "a padded batch [B, S]; for a packed stream [T] call the "
                "shifter directly with cu_seqlens")
        raise ValueError(f"{name} must be {ndim}-D, {hint}; got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty; pass at least one token")
    return ids


def _check_nonnegative(real_ids: torch.Tensor) -> None:
    if bool((real_ids < 0).any()):
        raise ValueError(f"input_ids holds a negative id ({int(real_ids[real_ids < 0][0])}) at a "
                         f"real token; token ids are >= 0 (mark padding with an attention_mask "
                         f"and use from_padded / pack_padded, or drop it)")


def _check_mask(mask, shape: torch.Size, name: str) -> torch.Tensor | None:
    """A 0/1 mask of exactly ``shape`` as a bool tensor (``None`` passes through)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but input_ids has shape "
                         f"{tuple(shape)}; give one mask entry per token (never broadcast or "
                         f"truncated)")
    if mask.dtype != torch.bool:
        if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{name} must be boolean or hold only 0 and 1 (dtype {mask.dtype} "
                             f"given with other values); per-token weights are not a mask, "
                             f"pass (weights > 0) as the mask and apply weights in the loss")
        mask = mask != 0
    return mask


def check_cu_seqlens(cu_seqlens, total: int) -> torch.Tensor:
    """Validate document offsets for a stream of ``total`` tokens; return them as int64.

    ``cu_seqlens``: ``[D+1]`` integer tensor (or sequence of ints), or ``None`` for one document.
    Returns an int64 tensor on the device of ``cu_seqlens`` (CPU when it was ``None`` or a list).
    Raises ``ValueError`` unless it is 1-D, starts at 0, is strictly increasing (no empty
    document) and ends at ``total``. Reads the values on the host (a sync point on GPU).
    """
    if cu_seqlens is None:
        return torch.tensor([0, total], dtype=torch.int64)
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if cu_seqlens.dtype == torch.bool or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(f"cu_seqlens must be an integer tensor (int32 or int64), got dtype "
                         f"{cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [num_docs + 1] = [0, len0, len0 + len1, ..., T] "
                         f"with at least 2 entries, got shape {tuple(cu_seqlens.shape)}; pass "
                         f"None for a single document")
    # No sync when moved by mpcore.batches; a CPU-GPU sync point when on GPU otherwise.
    values = host_checked.host_values(cu_seqlens).to(torch.int64)
    first, last = int(values[0]), int(values[-1])
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {first}; prepend 0 "
                         f"(cu_seqlens = [0, len0, len0 + len1, ...])")
    bad = (values[1:] <= values[:-1]).nonzero().view(-1)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"cu_seqlens must be strictly increasing (every document "
                         f"non-empty), but entries {i} and {i + 1} are {int(values[i])} and "
                         f"{int(values[i + 1])}; drop empty documents and make sure the "
                         f"entries are cumulative offsets, not lengths")
    if last != total:
        raise ValueError(f"cu_seqlens ends at {last} but the stream has {total} tokens; "
                         f"the last entry must equal the total length T")
    return cu_seqlens.to(torch.int64)


def position_ids(cu_seqlens, total: int) -> torch.Tensor:
    """Positions ``[T]`` int64 that restart at 0 at each document (``cu_seqlens`` as above)."""
    cu = check_cu_seqlens(cu_seqlens, total)
    # (T,) offset of its own document; output_size spares a CUDA cu_seqlens a host sync
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=cu.device) - starts


def _document_ends(cu: torch.Tensor, total: int) -> torch.Tensor:
    """``[T]`` int64: the offset one past the end of each token's document."""
    return torch.repeat_interleave(cu[1:], cu[1:] - cu[:-1], output_size=total)


def _check_shift(shift, name: str) -> int:
    if isinstance(shift, bool) or not isinstance(shift, int) or shift < 1:
        raise ValueError(f"{name} must be a positive int (1 = the next token), got {shift!r}")
    return shift


class MtpTargets(NamedTuple):
    """The depth-k inputs and targets of multi-token prediction (module docstring)."""

    depth: int
    input_ids: torch.Tensor  # (T,) ids k ahead, fill_id past the document's end
    labels: torch.Tensor  # (T,) int64, the token k+1 ahead or ignore_index


class PackedBatch(NamedTuple):
    """The canonical packed form of a batch (DESIGN.md, Batches)."""

    input_ids: torch.Tensor  # (T,) as given dtype
    cu_seqlens: torch.Tensor  # (D+1,) int32
    position_ids: torch.Tensor  # (T,) int64, restarting at 0 per document
    loss_mask: torch.Tensor | None  # (T,) bool, or None when none was given


def _check_rows(attention_mask: torch.Tensor) -> None:
    """Each row's real tokens must form one contiguous run."""
    starts = attention_mask[:, 0].long() + (attention_mask[:, 1:] & ~attention_mask[:, :-1]).sum(1)
    bad = (starts > 1).nonzero()
    if bad.numel():
        raise ValueError(f"attention_mask row {int(bad[0])} has padding between real tokens; "
                         f"only right, left or both-sided padding is supported (one contiguous "
                         f"run of real tokens per row); pack such rows as several documents "
                         f"with cu_seqlens instead")


def pack_padded(input_ids, attention_mask=None, loss_mask=None) -> PackedBatch:
    """Pack a padded ``[B, S]`` batch (right or left padding) into one stream, a document per row.

    ``attention_mask [B, S]`` (bool or 0/1; ``None`` = no padding) marks real tokens; pad tokens
    are dropped. Rows keep their order. A row without real tokens raises ``ValueError``.
    """
    ids = _check_ids(input_ids, "input_ids", 2)
    mask = _check_mask(attention_mask, ids.shape, "attention_mask")
    if mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    _check_rows(mask)
    lengths = mask.sum(1)
    empty = (lengths == 0).nonzero()
    if empty.numel():
        raise ValueError(f"row {int(empty[0])} of attention_mask has no real token; drop empty "
                         f"rows before packing (a document must be non-empty)")
    _check_nonnegative(ids[mask])
    lm = _check_mask(loss_mask, ids.shape, "loss_mask")
    cu = torch.zeros(ids.shape[0] + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = torch.cumsum(lengths, 0)
    packed = ids[mask]
    return PackedBatch(packed, cu, position_ids(cu, packed.numel()),
                       None if lm is None else lm[mask])


class LabelShifter:
    """Shift next-token labels on the global stream; the one place labels are made.

    ``ignore_index``: label of positions without a target (int, default -100).
    ``ignore_token_ids``: token ids never used as targets (image placeholders, pad ids).
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX, ignore_token_ids: Iterable[int] = ()):
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
        ids = tuple(ignore_token_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise ValueError(f"ignore_token_ids must be ints, got {i!r}; pass e.g. "
                                 f"(image_token_id,)")
        self.ignore_index = ignore_index
        self.ignore_token_ids = ids

    def __repr__(self) -> str:
        return (f"LabelShifter(ignore_index={self.ignore_index}, "
                f"ignore_token_ids={self.ignore_token_ids})")

    def _labels(self, nxt: torch.Tensor, keep: torch.Tensor, target_mask) -> torch.Tensor:
        """``labels[..., :-1]`` from next tokens ``nxt`` where ``keep``; validates targets."""
        nxt = nxt.long()
        if target_mask is not None:
            keep = keep & target_mask
        if self.ignore_token_ids:
            ignored = torch.tensor(self.ignore_token_ids, dtype=torch.long, device=nxt.device)
            keep = keep & ~torch.isin(nxt, ignored)
        if bool((keep & (nxt == self.ignore_index)).any()):
            raise ValueError(f"token id {self.ignore_index} is a target but equals ignore_index; "
                             f"use a negative ignore_index (the default is -100)")
        return torch.where(keep, nxt, torch.full_like(nxt, self.ignore_index))

    def __call__(self, input_ids, cu_seqlens=None, loss_mask=None, shift: int = 1
                 ) -> torch.Tensor:
        """Labels ``[T]`` int64 for the packed stream ``input_ids [T]`` (module docstring).

        ``cu_seqlens [D+1]`` or ``None`` (one document); ``loss_mask [T]`` bool or 0/1, where
        ``loss_mask[t]`` says whether token t is a target. ``shift``: how far ahead the target
        is (1, the next token, for the model's own head; k+1 for the depth-k MTP block). Every
        split happens after this.
        """
        ids = _check_ids(input_ids, "input_ids", 1)
        shift = _check_shift(shift, "shift")
        total = ids.numel()
        cu = check_cu_seqlens(cu_seqlens, total).to(ids.device)
        mask = _check_mask(loss_mask, ids.shape, "loss_mask")
        _check_nonnegative(ids)
        labels = torch.full((total,), self.ignore_index, dtype=torch.long, device=ids.device)
        if shift >= total:
            return labels
        # t's target t+shift exists in t's document (for shift 1: t is not a document's last)
        inside = torch.arange(shift, total, device=ids.device) < _document_ends(cu, total)[:-shift]
        labels[:-shift] = self._labels(ids[shift:], inside,
                                       None if mask is None else mask[shift:])
        return labels

    def mtp(self, input_ids, cu_seqlens=None, loss_mask=None, depth: int = 1,
            fill_id: int = 0) -> list[MtpTargets]:
        """Inputs and labels ``[T]`` of the multi-token-prediction blocks of depth 1..``depth``.

        Block k gets ``input_ids`` shifted by k inside each document (``fill_id`` past its end)
        and the labels shifted by k+1 (:meth:`__call__` with ``shift=k+1``); both are per-token
        tensors of the global stream, to be split with everything else. ``fill_id`` must be a
        valid id of the embedding (it is looked up, never a target).
        """
        depth = _check_shift(depth, "depth")
        if isinstance(fill_id, bool) or not isinstance(fill_id, int) or fill_id < 0:
            raise ValueError(f"fill_id must be a token id >= 0 (an id the embedding holds), "
                             f"got {fill_id!r}")
        ids = _check_ids(input_ids, "input_ids", 1)
        total = ids.numel()
        cu = check_cu_seqlens(cu_seqlens, total).to(ids.device)
        ends = _document_ends(cu, total)
        out = []
        for k in range(1, depth + 1):
            ahead = torch.full_like(ids, fill_id)
            if k < total:
                inside = torch.arange(k, total, device=ids.device) < ends[:-k]
                ahead[:-k] = torch.where(inside, ids[k:], ahead[:-k])
            out.append(MtpTargets(k, ahead, self(ids, cu, loss_mask, shift=k + 1)))
        return out

    def from_padded(self, input_ids, attention_mask=None, loss_mask=None) -> torch.Tensor:
        """Labels ``[B, S]`` int64 for a padded batch ``input_ids [B, S]``, one document per row.

        ``attention_mask [B, S]`` (1 = real, ``None`` = no padding): pad tokens and the last real
        token of each row get ``ignore_index``. Right, left or both-sided padding; a row with a
        hole raises ``ValueError``; a row without real tokens gets only ``ignore_index``.
        ``loss_mask [B, S]`` as in ``__call__``.
        """
        ids = _check_ids(input_ids, "input_ids", 2)
        real = _check_mask(attention_mask, ids.shape, "attention_mask")
        if real is None:
            real = torch.ones_like(ids, dtype=torch.bool)
        _check_rows(real)
        _check_nonnegative(ids[real])
        mask = _check_mask(loss_mask, ids.shape, "loss_mask")
        labels = torch.full(ids.shape, self.ignore_index, dtype=torch.long, device=ids.device)
        # Both t and t+1 real means same document: a row's real tokens are one run.
        keep = real[:, :-1] & real[:, 1:]
        labels[:, :-1] = self._labels(ids[:, 1:], keep, None if mask is None else mask[:, 1:])
        return labels
