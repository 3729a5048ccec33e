"""Packing image-text samples into fixed token budgets, and the micro-batches of a loader.

:class:`VLPackedDataset` puts WHOLE samples (a :class:`~mpcore.data.vl_dataset.VLDataset`, or
a ``BlendedDataset`` of them) into budgets of ``S = seq_len`` tokens, so no sample and no image
is ever split between budgets (an image's pixel rows and grid travel with its sample). Plan,
made once at construction, deterministic by ``seed``:

1. Samples longer than ``S``: a ``ValueError`` naming the first one (manifest line) and its
   length, or with ``drop_long=True`` left out and counted (``num_dropped``,
   ``num_dropped_tokens``: log them).
2. The rest in the order ``default_rng(seed).permutation``, placed first-fit into at most
   ``max_open`` open budgets (the oldest is closed when a new one is needed; a full one closes
   at once); budgets are numbered in the order they close. Every kept sample is in exactly one
   budget.
3. The tail of a budget is padding: ``pad_id`` (a text id) as its own segment, loss_mask 0.

Packed sample (:class:`VLPackedSample`, numpy), ``N`` pixel rows and ``I`` images in the order of
their placeholder runs:

    input_ids       int64 [S]
    cu_seqlens      int32 [segments + 1]   one segment per sample, plus one for the padding
    position_ids    int64 [S]              restart at 0 at every segment (text positions; the
                                           model's [3, S] M-RoPE ids come from vl_inputs)
    loss_mask       bool  [S]              true = the token is a target (LabelShifter)
    pixel_values    float32 [N, patch_dim]
    image_grid_thw  int64 [I, 3]
    pixel_values_videos  float32 [M, patch_dim]   the samples' videos (None: none)
    video_grid_thw       int64 [V, 3]              videos in the order of their runs
    second_per_grid      float64 [V]               each video's seconds per temporal patch
                                                   (Qwen2.5-VL's positions read it)

:class:`TextAsVL` turns a text ``PackedDataset`` into such samples (every token a target, no
images), so text corpora blend with image-text budgets in a ``BlendedDataset`` by weight.
:func:`collate_vl` concatenates ``B`` packed samples into ONE stream (cu_seqlens offset by
``b * S``, pixels and grids concatenated in order, the video keys only when a sample has a
video); :class:`VLDataLoader` is ``DataLoader`` (same
order, dp split and resumable position) yielding ``collate_vl`` micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mpcore.data.blend import BlendedDataset
from mpcore.data.loader import DataLoader, collate
from mpcore.data.packing import PackedDataset, positions_from_cu_seqlens


@dataclass(frozen=True)
class VLPackedSample:
    """One packed budget; shapes and dtypes in the module docstring."""

    input_ids: np.ndarray
    cu_seqlens: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    pixel_values_videos: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None
    second_per_grid: np.ndarray | None = None


def _videos(parts) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """``(rows, grids, seconds per temporal patch)`` of the videos of ``parts`` (VLSamples;
    tuples of four have none; a sample without recorded seconds: 1 per video), or ``(None,
    None, None)`` when there are none."""
    given = [p for p in parts if len(p) > 4 and p[5] is not None and len(p[5])]
    if not given:
        return None, None, None
    grids = [np.asarray(p[5], np.int64).reshape(-1, 3) for p in given]
    seconds = [np.ones(len(g)) if len(p) < 7 or p[6] is None else np.asarray(p[6], np.float64)
               for p, g in zip(given, grids, strict=True)]
    return (np.concatenate([np.asarray(p[4], np.float32) for p in given]),
            np.concatenate(grids), np.concatenate(seconds))


def sample_lengths(dataset) -> np.ndarray:
    """int64 [len(dataset)]: tokens per sample, without reading samples where the dataset
    knows them (``lengths``; a ``BlendedDataset`` from its parts)."""
    if hasattr(dataset, "lengths"):
        return np.asarray(dataset.lengths, dtype=np.int64)
    if isinstance(dataset, BlendedDataset):
        out = np.empty(len(dataset), dtype=np.int64)
        for k, part in enumerate(dataset.datasets):
            where = dataset.dataset_index == k
            out[where] = sample_lengths(part)[dataset.sample_index[where]]
        return out
    return np.array([len(dataset[i][0]) for i in range(len(dataset))], dtype=np.int64)


def describe(dataset, i: int) -> str:
    """Where sample ``i`` comes from, for messages (its manifest line when known)."""
    if hasattr(dataset, "describe"):
        return dataset.describe(i)
    if isinstance(dataset, BlendedDataset):
        k = int(dataset.dataset_index[i])
        return f"blend sample {i} = dataset {k} " + describe(
            dataset.datasets[k], int(dataset.sample_index[i])
        )
    return f"sample {i}"


def _first_fit(
    order: np.ndarray, lengths: np.ndarray, seq_len: int, max_open: int
) -> list[list[int]]:
    """Budgets (lists of sample indices, in placement order), first-fit over ``max_open``."""
    done: list[list[int]] = []
    open_bins: list[list[int]] = []
    room: list[int] = []
    for i in order.tolist():
        n = int(lengths[i])
        b = next((b for b, r in enumerate(room) if r >= n), None)
        if b is None:
            if len(open_bins) == max_open:
                done.append(open_bins.pop(0))
                room.pop(0)
            open_bins.append([])
            room.append(seq_len)
            b = len(open_bins) - 1
        open_bins[b].append(i)
        room[b] -= n
        if room[b] == 0:
            done.append(open_bins.pop(b))
            room.pop(b)
    return done + open_bins


class VLPackedDataset:
    """Budgets of ``seq_len`` tokens of whole samples of ``dataset`` (see the module docstring).

    ``dataset``: VLDataset, or any sequence of ``(input_ids, loss_mask, pixel_values,
    grid_thw[, pixel_values_videos, video_grid_thw])``. ``pad_id``: a text id (not a placeholder) filling each budget's tail.
    ``samples=(lo, hi)``: pack only samples ``lo .. hi-1`` (a held-out split). ``len(self)``
    budgets; ``self[b]`` a :class:`VLPackedSample`. Counts: ``num_docs`` (samples packed),
    ``num_tokens`` (their tokens), ``num_pad_tokens``, ``num_dropped``, ``num_dropped_tokens``.
    """

    def __init__(
        self,
        dataset,
        seq_len: int,
        seed: int,
        pad_id: int,
        drop_long: bool = False,
        samples: tuple[int, int] | None = None,
        max_open: int = 16,
    ):
        if seq_len < 1 or max_open < 1:
            raise ValueError(f"seq_len and max_open must be >= 1, got {seq_len}, {max_open}")
        tok = getattr(dataset, "tokenizer", None)
        bound = tok.text_vocab_size if tok is not None else None
        if (
            isinstance(pad_id, bool)
            or not isinstance(pad_id, int)
            or pad_id < 0
            or (bound is not None and pad_id >= bound)
        ):
            raise ValueError(
                f"pad_id {pad_id!r} must be a text id (0 <= id < "
                f"{bound or 'the text vocab'}); use the tokenizer's eos_id"
            )
        self.dataset, self.seq_len, self.pad_id, self.seed = dataset, seq_len, pad_id, seed
        lo, hi = samples if samples is not None else (0, len(dataset))
        if not 0 <= lo <= hi <= len(dataset):
            raise ValueError(f"sample range {(lo, hi)} is outside [0, {len(dataset)}]")
        lengths = sample_lengths(dataset)
        index = np.arange(lo, hi)
        long = index[lengths[index] > seq_len]
        if len(long) and not drop_long:
            i = int(long[0])
            raise ValueError(
                f"{describe(dataset, i)} has {int(lengths[i])} tokens, more than "
                f"seq_len={seq_len} ({len(long)} such samples); a sample (and "
                f"its images) is never split: raise data.seq_len, lower the "
                f"images' max_pixels, or drop them with drop_long=True"
            )
        self.num_dropped = len(long)
        self.num_dropped_tokens = int(lengths[long].sum())
        kept = index[lengths[index] <= seq_len]
        if len(kept) == 0:
            raise ValueError(f"no sample of {len(index)} fits seq_len={seq_len}; raise it")
        order = np.random.default_rng(seed).permutation(kept)
        bins = _first_fit(order, lengths, seq_len, max_open)
        self.budget_offsets = np.cumsum([0] + [len(b) for b in bins]).astype(np.int64)
        self.budget_samples = np.concatenate([np.asarray(b, np.int64) for b in bins])
        self.num_docs = len(kept)
        self.num_tokens = int(lengths[kept].sum())
        self.num_pad_tokens = len(bins) * seq_len - self.num_tokens

    def __len__(self) -> int:
        return len(self.budget_offsets) - 1

    def members(self, b: int) -> np.ndarray:
        """int64: the dataset indices packed into budget ``b``, in stream order."""
        return self.budget_samples[self.budget_offsets[b] : self.budget_offsets[b + 1]]

    def __getitem__(self, b: int) -> VLPackedSample:
        if not 0 <= b < len(self):
            raise IndexError(f"budget {b} out of range for {len(self)} budgets")
        parts = [self.dataset[int(i)] for i in self.members(b)]
        lengths = [len(p[0]) for p in parts]
        pad = self.seq_len - sum(lengths)
        ids = [np.asarray(p[0], np.int64) for p in parts]
        mask = [np.asarray(p[1], bool) for p in parts]
        if pad:
            ids.append(np.full(pad, self.pad_id, np.int64))
            mask.append(np.zeros(pad, bool))
            lengths.append(pad)
        cu = np.cumsum([0, *lengths]).astype(np.int32)
        return VLPackedSample(
            np.concatenate(ids),
            cu,
            positions_from_cu_seqlens(cu),
            np.concatenate(mask),
            np.concatenate([np.asarray(p[2], np.float32) for p in parts]),
            np.concatenate([np.asarray(p[3], np.int64).reshape(-1, 3) for p in parts]),
            *_videos(parts),
        )


class TextAsVL:
    """A text :class:`~mpcore.data.packing.PackedDataset` as VL packed samples: every token a
    target (``LabelShifter`` still ignores each segment's last), or for chat data
    (``SFTPackedDataset``) its own loss mask, no images (``pixel_values
    [0, patch_dim]``, ``image_grid_thw [0, 3]``). Its ids must come from the VL tokenizer's
    SentencePiece model (they are then valid VL ids)."""

    def __init__(self, packed: PackedDataset, patch_dim: int):
        self.packed, self.patch_dim = packed, patch_dim
        self.num_docs, self.num_tokens = packed.num_docs, packed.num_tokens

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, i: int) -> VLPackedSample:
        s = self.packed[i]
        mask = getattr(s, "loss_mask", None)  # chat data: its assistant-only mask
        return VLPackedSample(
            s.input_ids,
            s.cu_seqlens,
            s.position_ids,
            np.ones(len(s.input_ids), bool) if mask is None else mask.astype(bool),
            np.zeros((0, self.patch_dim), np.float32),
            np.zeros((0, 3), np.int64),
        )


def collate_vl(samples: Sequence[VLPackedSample]) -> dict[str, torch.Tensor]:
    """One packed stream of ``B`` samples of ``S`` tokens: ``input_ids`` int64 [B*S],
    ``cu_seqlens`` int32 [segments+1], ``position_ids`` int64 [B*S] (as ``loader.collate``),
    ``loss_mask`` bool [B*S], ``pixel_values`` float32 [N, patch_dim], ``image_grid_thw``
    int64 [I, 3] (images in stream order), and when any sample has a video
    ``pixel_values_videos`` float32 [M, patch_dim], ``video_grid_thw`` int64 [V, 3] and
    ``second_per_grid`` float64 [V]."""
    videos = [s for s in samples if s.video_grid_thw is not None]
    widths = {s.pixel_values.shape[1] for s in samples}
    widths |= {s.pixel_values_videos.shape[1] for s in videos}
    if len(widths) > 1:
        raise ValueError(
            f"samples with different pixel row widths {sorted(widths)} in one "
            f"micro-batch; blend only datasets prepared with the same patch size"
        )
    batch = collate(samples)
    batch["loss_mask"] = torch.from_numpy(np.concatenate([s.loss_mask for s in samples]))
    batch["pixel_values"] = torch.from_numpy(np.concatenate([s.pixel_values for s in samples]))
    batch["image_grid_thw"] = torch.from_numpy(
        np.concatenate([s.image_grid_thw for s in samples]).astype(np.int64)
    )
    if videos:
        batch["pixel_values_videos"] = torch.from_numpy(
            np.concatenate([s.pixel_values_videos for s in videos]))
        batch["video_grid_thw"] = torch.from_numpy(
            np.concatenate([s.video_grid_thw for s in videos]).astype(np.int64))
        batch["second_per_grid"] = torch.from_numpy(np.concatenate(
            [np.ones(len(s.video_grid_thw)) if s.second_per_grid is None
             else s.second_per_grid for s in videos]).astype(np.float64))
    return batch


class VLDataLoader(DataLoader):
    """``DataLoader`` over VL packed samples: the same order, dp split, ``state_dict`` and
    resume; each micro-batch is :func:`collate_vl`'s dict."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, collate_fn=collate_vl, **kwargs)
