"""Weighted blending of several sample datasets (for example :class:`PackedDataset`).

A blend of ``num_samples`` samples is built once, deterministically from ``seed``:

1. Counts: dataset ``k`` contributes ``round(w_k / sum(w) * num_samples)`` samples (largest
   remainder, so the counts add up exactly).
2. Interleaving: each dataset's samples are spread evenly over the blend (see
   :func:`interleave`), so every prefix of the blend also follows the weights, not only the
   whole.
3. Which samples: dataset ``k``'s samples in a seeded random order; when its count exceeds its
   size it wraps around with a fresh permutation (upsampling), each pass covering it once.

``self[j]`` returns the sample of the underlying dataset; ``self.dataset_index`` int64
[num_samples] and ``self.sample_index`` int64 [num_samples] say where it came from.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def blend_counts(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """int64 [len(weights)]: samples per dataset, proportional to weights, summing exactly."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(
            f"blend weights must be non-negative finite numbers with a positive sum, got {list(weights)}"
        )
    exact = w / w.sum() * num_samples
    counts = np.floor(exact).astype(np.int64)
    short = num_samples - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")  # largest remainders first
    counts[order[:short]] += 1
    return counts


def interleave(counts: np.ndarray) -> np.ndarray:
    """int64 [sum(counts)]: dataset index per position, spread evenly.

    Item ``i`` of dataset ``k`` is placed at its ideal time ``(i + 0.5) / counts[k]`` (a fraction
    of the blend); sorting by time (ties to the lower ``k``) makes every prefix of length ``j``
    hold about ``j * counts[k] / sum(counts)`` items of each dataset. O(N log N), no Python loop.
    """
    counts = np.asarray(counts, dtype=np.int64)
    ks = np.repeat(np.arange(len(counts)), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    i = np.arange(len(ks)) - starts
    times = (i + 0.5) / np.maximum(counts[ks], 1)
    return ks[np.lexsort((ks, times))]


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights``.

    ``datasets``: sequences of samples (``len`` and ``[]``), for example PackedDataset.
    ``num_samples`` defaults to the sum of the dataset sizes.
    """

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        seed: int,
        num_samples: int | None = None,
    ):
        if len(datasets) != len(weights):
            raise ValueError(f"got {len(datasets)} datasets but {len(weights)} blend weights")
        self.datasets = list(datasets)
        if num_samples is None:
            num_samples = sum(len(d) for d in self.datasets)
        counts = blend_counts(weights, num_samples)
        for k, (dataset, count) in enumerate(zip(self.datasets, counts, strict=True)):
            if count and len(dataset) == 0:
                raise ValueError(f"blend dataset {k} is empty but has weight {weights[k]}")
        self.counts = counts
        self.dataset_index = interleave(counts)
        self.sample_index = np.empty(num_samples, dtype=np.int64)
        for k, dataset in enumerate(self.datasets):
            where = np.flatnonzero(self.dataset_index == k)
            self.sample_index[where] = _seeded_cycle(len(dataset), len(where), seed, k)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, j: int):
        return self.datasets[self.dataset_index[j]][int(self.sample_index[j])]


def _seeded_cycle(size: int, count: int, seed: int, k: int) -> np.ndarray:
    """int64 [count]: passes over range(size), each a fresh permutation seeded by (seed, k, pass)."""
    passes = [
        np.random.default_rng([seed, k, p]).permutation(size) for p in range(-(-count // size))
    ]
    return np.concatenate(passes)[:count] if passes else np.zeros(0, dtype=np.int64)
