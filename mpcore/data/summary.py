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
