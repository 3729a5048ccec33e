"""Data pipeline: text -> SentencePiece ids -> indexed binary dataset -> packed samples -> loader.

tokenizer.py  train / load a SentencePiece model; read text and JSONL documents
indexed.py    ``<prefix>.bin`` + ``<prefix>.idx``: streaming writer, memory-mapped reader
packing.py    fixed-length samples with cu_seqlens and position_ids (no labels)
blend.py      weighted blend of several sample datasets
loader.py     seeded shuffle, dp-rank split, micro-batches as one packed stream, resumable
corpus.py     the default corpus shipped with the repo, prepared on first use
"""

from mpcore.data.blend import BlendedDataset
from mpcore.data.corpus import prepare_default
from mpcore.data.indexed import IndexedDataset, IndexedWriter
from mpcore.data.loader import DataLoader, collate
from mpcore.data.packing import PackedDataset, PackedSample
from mpcore.data.tokenizer import Tokenizer, iter_documents, train_tokenizer

__all__ = [
    "BlendedDataset",
    "DataLoader",
    "IndexedDataset",
    "IndexedWriter",
    "PackedDataset",
    "PackedSample",
    "Tokenizer",
    "collate",
    "iter_documents",
    "prepare_default",
    "train_tokenizer",
]
