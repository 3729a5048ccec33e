"""What a run's loaders read (``mpcore.batches``, ``mpcore.vl_data``), for the start report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSummary:
    """What the loaders read: documents, tokens (without EOS) and packed samples."""

    num_docs: int
    num_tokens: int
    num_samples: int
    valid_docs: int = 0
    valid_tokens: int = 0
    valid_samples: int = 0
    pixel_geometry: dict | None = None
    """VL data: the pixel rows' ``patch_size``, ``temporal_patch_size``, ``merge_size``,
    ``patch_dim`` and ``source`` (a folder), which the run checks against its vision tower
    before any batch (``mpcore.vl_data.check_tower``); None for text data."""
