"""Chat SFT packing: whole conversations into ``seq_len`` samples, with their loss masks.

A chat dataset (``<prefix>.mask`` beside the ids, ``mpcore.data.chat``) is packed greedily in
stored order: a sample takes the next conversations while they fit in ``S = seq_len`` tokens;
the rest of the sample is one padding segment (``pad_id``, mask 0). A conversation is never
cut across samples (its tail would train without its context), so one longer than ``S`` is an
error naming its source line, or, with ``truncate=True`` (``data.sft_truncate``), cut to its
first ``S`` tokens and counted in ``num_truncated``. No separator is appended: a
conversation's own template ends it. Per sample:

    input_ids     int64 [S]
    cu_seqlens    int32 [segments + 1]   one segment per conversation, then the padding
    position_ids  int64 [S]              restart at 0 in every segment
    loss_mask     uint8 [S]              1 on assistant tokens and their end-of-turn token

The mask travels with the ids: ``LabelShifter`` reads ``loss_mask[t + 1]`` for the label of
``t`` on the global stream, before any split, so masked tokens are never targets.
"""

from __future__ import annotations

import numpy as np

from mpcore.data.indexed import IndexedDataset
from mpcore.data.packing import PackedSample, positions_from_cu_seqlens


def doc_source(ds: IndexedDataset, d: int) -> str:
    """``path:line`` that document ``d`` of a chat dataset came from (its index otherwise)."""
    meta = ds.meta or {}
    try:
        file_index, line = meta["doc_sources"][d]
        return f"{meta['sources'][file_index]}:{line}"
    except (KeyError, IndexError, TypeError, ValueError):
        return f"document {d} of {ds.idx_path}"


class SFTPackedDataset:
    """Samples of whole conversations (module docstring) from ``dataset`` (with masks).

    ``docs=(lo, hi)``: the documents packed (default all). ``len(self)`` samples;
    ``self[i]`` a :class:`PackedSample` with ``loss_mask``; ``num_docs``, ``num_tokens``,
    ``num_truncated`` count what is packed.
    """

    def __init__(self, dataset: IndexedDataset, seq_len: int, pad_id: int,
                 docs: tuple[int, int] | None = None, truncate: bool = False):
        if dataset.loss_mask is None:
            raise ValueError(f"{dataset.idx_path} has no loss mask (not chat data); prepare it "
                             f"with launch/prepare_data.py --chat")
        if not 0 <= pad_id < dataset.vocab_size:
            raise ValueError(f"pad id {pad_id} is outside the vocabulary [0, "
                             f"{dataset.vocab_size}) of {dataset.idx_path}")
        self.dataset, self.seq_len, self.pad_id = dataset, seq_len, pad_id
        lo, hi = docs if docs is not None else (0, len(dataset))
        lengths = dataset.doc_lengths[lo:hi]
        long = np.flatnonzero(lengths > seq_len)
        if len(long) and not truncate:
            d = lo + int(long[0])
            raise ValueError(f"{doc_source(dataset, d)}: the conversation has {lengths[long[0]]} "
                             f"tokens, more than data.seq_len={seq_len} ({len(long)} such in "
                             f"{dataset.idx_path}); raise data.seq_len, shorten or drop them, or "
                             f"set data.sft_truncate=true to cut them to seq_len")
        self.num_truncated = len(long)
        lengths = np.minimum(lengths, seq_len)
        self.num_docs, self.num_tokens = hi - lo, int(lengths.sum())
        starts, used = [lo], 0
        for d, n in enumerate(lengths.tolist(), lo):  # greedy, in order
            if used + n > seq_len:
                starts.append(d)
                used = 0
            used += n
        starts.append(hi)
        self.bounds = np.asarray(starts, dtype=np.int64)  # sample i: docs bounds[i]..bounds[i+1]
        if hi == lo:
            raise ValueError(f"{dataset.idx_path} has no conversation to pack")

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i: int) -> PackedSample:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        S, ds = self.seq_len, self.dataset
        ids = np.full(S, self.pad_id, dtype=np.int64)
        mask = np.zeros(S, dtype=np.uint8)
        cu, at = [0], 0
        for d in range(int(self.bounds[i]), int(self.bounds[i + 1])):
            n = min(int(ds.offsets[d + 1] - ds.offsets[d]), S)
            ids[at : at + n] = ds[d][:n]
            mask[at : at + n] = ds.mask(d)[:n]
            at += n
            cu.append(at)
        if at < S:
            cu.append(S)  # the padding, its own segment
        cu = np.asarray(cu, dtype=np.int32)
        return PackedSample(ids, cu, positions_from_cu_seqlens(cu), mask)
