"""Data pipeline: text -> SentencePiece ids -> indexed binary dataset -> packed samples -> loader.

tokenizer.py  train / load a SentencePiece model; read text and JSONL documents
indexed.py    ``<prefix>.bin`` + ``<prefix>.idx``: streaming writer, memory-mapped reader
packing.py    fixed-length samples with cu_seqlens and position_ids (no labels)
blend.py      weighted blend of several sample datasets
loader.py     seeded shuffle, dp-rank split, micro-batches as one packed stream, resumable
corpus.py     the default corpus shipped with the repo, prepared on first use

Released tokenizers (a checkpoint's tokenizer.json folder) and chat SFT:
hf_folder.py     read a tokenizer folder (special ids, fingerprint) with ``tokenizers`` only
hf_encode.py     encode as transformers' AutoTokenizer; stream text into a dataset
chat.py          render conversations with the chat template; the assistant-only mask
sft_packing.py   whole conversations into seq_len samples with their loss masks

Vision-language (image-text) data:
vl_tokenizer.py  a SentencePiece model plus the four VL special ids after its vocab
vl_manifest.py   the JSONL manifest schema, checked with file:line errors; image settings
vl_dataset.py    prepare a manifest into a memory-mapped folder (ids, masks, pixels, grids)
videos.py        a video's frames -> rows and grid, as the family's transformers video processor
vl_packing.py    whole samples into seq_len budgets; collate_vl; VLDataLoader; TextAsVL
vl_default.py    the shipped 15-image caption set, prepared on first use
vl_release.py    a released checkpoint's tokenizer with its own vision ids (VL conversations)
vl_chat.py       VL conversations (messages with images) -> release ids, assistant-only mask
"""

from mpcore.data.blend import BlendedDataset
from mpcore.data.corpus import prepare_default
from mpcore.data.indexed import IndexedDataset, IndexedWriter
from mpcore.data.loader import DataLoader, collate
from mpcore.data.packing import PackedDataset, PackedSample
from mpcore.data.summary import DataSummary
from mpcore.data.tokenizer import Tokenizer, iter_documents, train_tokenizer
from mpcore.data.vl_dataset import VLDataset, VLSample, prepare_vl_dataset
from mpcore.data.vl_default import prepare_vl_default
from mpcore.data.vl_manifest import ImageSettings, iter_manifest, scan_manifest
from mpcore.data.vl_packing import (
    TextAsVL,
    VLDataLoader,
    VLPackedDataset,
    VLPackedSample,
    collate_vl,
)
from mpcore.data.vl_tokenizer import VLTokenizer

__all__ = [
    "DataSummary",
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
    "ImageSettings",
    "TextAsVL",
    "VLDataLoader",
    "VLDataset",
    "VLPackedDataset",
    "VLPackedSample",
    "VLSample",
    "VLTokenizer",
    "collate_vl",
    "iter_manifest",
    "prepare_vl_dataset",
    "prepare_vl_default",
    "scan_manifest",
]
