"""Document-aware packing of an indexed dataset into fixed-length samples.

The documents, in stored order, each followed by one EOS, form a virtual stream of
``num_tokens + num_docs`` tokens. Sample ``i`` is ``stream[i * S : (i + 1) * S]`` with
``S = seq_len``; the tail shorter than ``S`` is dropped. Per sample:

    input_ids     int64 [S]
    cu_seqlens    int32 [segments + 1]   0, the document boundaries inside the sample, S
    position_ids  int64 [S]              0, 1, ... restarting at every segment start

A segment is the part of one document (with its EOS) that lies in the sample; a document cut
at a sample boundary continues as a new segment (positions from 0) in the next sample, so
attention never crosses documents. There are no labels here: the training loop derives them
from ``input_ids`` and ``cu_seqlens`` with ``mpcore.parallel.LabelShifter``, which ignores the last
token of each segment (an EOS, or the cut point of a document).

Nothing is precomputed but the int64 [num_docs] cumulative stream ends, so a sample costs one
binary search and one contiguous read of the memory-mapped token file.

``docs=(lo, hi)`` packs only documents ``lo .. hi-1`` (a contiguous range, so reads stay
contiguous): the training and the held-out validation split of one dataset are two disjoint
ranges, and no sample of one holds a token of the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpcore.data.indexed import IndexedDataset


@dataclass(frozen=True)
class PackedSample:
    """One packed sample; shapes and dtypes as in the module docstring. ``loss_mask`` uint8
    [S] (1 = a training target) for chat data (``mpcore.data.sft_packing``); None: every
    token is one."""

    input_ids: np.ndarray
    cu_seqlens: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray | None = None


def positions_from_cu_seqlens(cu_seqlens: np.ndarray) -> np.ndarray:
    """int64 [cu_seqlens[-1]]: position of each token within its segment."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    return np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], lengths)


class PackedDataset:
    """Fixed-length samples of ``seq_len`` tokens packed from ``dataset`` (an IndexedDataset).

    ``eos_id`` is appended to every document; it must be below the dataset's vocab_size.
    ``docs``: the range ``(lo, hi)`` of documents to pack (default: all).
    ``len(self)`` samples; ``self[i]`` is a :class:`PackedSample`; ``num_docs`` and
    ``num_tokens`` (without EOS) count what is packed.
    """

    def __init__(self, dataset: IndexedDataset, seq_len: int, eos_id: int,
                 docs: tuple[int, int] | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0 <= eos_id < dataset.vocab_size:
            raise ValueError(
                f"eos_id {eos_id} is outside the vocabulary [0, {dataset.vocab_size}) of "
                f"{dataset.idx_path}; use the eos id of the tokenizer that wrote it"
            )
        self.dataset, self.seq_len, self.eos_id = dataset, seq_len, eos_id
        lo, hi = docs if docs is not None else (0, len(dataset))
        if not 0 <= lo <= hi <= len(dataset):
            raise ValueError(f"document range {(lo, hi)} is outside [0, {len(dataset)}]")
        offsets = np.asarray(dataset.offsets[lo : hi + 1], dtype=np.int64)
        self.first_token, self.end_token = int(offsets[0]), int(offsets[-1])
        self.num_docs, self.num_tokens = hi - lo, self.end_token - self.first_token
        # stream_ends[d]: exclusive end of document lo + d (with its EOS) in the stream.
        self.stream_ends = offsets[1:] - self.first_token + np.arange(1, self.num_docs + 1)
        total = int(self.stream_ends[-1]) if self.num_docs else 0
        self.num_samples = total // seq_len
        if self.num_samples == 0:
            part = "" if docs is None else f" (documents {lo} to {hi - 1})"
            raise ValueError(
                f"{dataset.idx_path}{part} has {total} tokens with EOS, fewer than one sample "
                f"of seq_len={seq_len}; use a larger corpus or a smaller seq_len"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> PackedSample:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        S = self.seq_len
        start, end = i * S, (i + 1) * S
        ends = self.stream_ends
        first = int(np.searchsorted(ends, start, side="right"))  # doc holding stream[start]
        last = int(np.searchsorted(ends, end - 1, side="right"))  # doc holding stream[end - 1]
        inner = ends[first:last] - start  # boundaries strictly inside (0, S)
        cu = np.concatenate(([0], inner, [S])).astype(np.int32)
        seg_lengths = np.diff(cu)
        doc_of = np.repeat(np.arange(first, last + 1), seg_lengths)  # (S,)
        pos = np.arange(start, end)
        is_eos = pos + 1 == ends[doc_of]
        # Documents are contiguous in the token file, so stream position p of document d is
        # token p - d; one contiguous read covers the sample.
        tok = pos - doc_of + self.first_token
        lo = int(tok[0])
        hi = min(int(tok[-1]) + 1, self.end_token)
        window = np.asarray(self.dataset.tokens[lo:hi], dtype=np.int64)
        ids = np.full(S, self.eos_id, dtype=np.int64)
        ids[~is_eos] = window[tok[~is_eos] - lo]
        return PackedSample(ids, cu, positions_from_cu_seqlens(cu))
