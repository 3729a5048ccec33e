"""Encode text with a released tokenizer folder exactly as transformers' ``AutoTokenizer`` does.

:class:`HFTokenizer` loads ``AutoTokenizer.from_pretrained(folder)`` once and encodes with its
Rust tokenizer (``backend_tokenizer``, the ``tokenizers`` library): the same ids as
``AutoTokenizer(text)["input_ids"]`` (special tokens added as the tokenizer adds them, e.g.
Llama's bos), at the Rust library's batch speed. transformers is imported here and only here
(and in ``mpcore.data.chat``): training reads prepared ids and never needs it.

:func:`prepare_text` streams documents (``mpcore.data.tokenizer.iter_documents``) into
``<prefix>.bin/.idx/.meta.json`` in chunks of about ``CHUNK_BYTES``: one thread batch-encodes
the next chunk (the Rust library spreads a batch over all cores and releases the GIL) while
the caller's thread writes the previous one, so memory stays at two chunks whatever the input
size. Each document is followed by the tokenizer's eos in training (``separator_id``), not
here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from mpcore.data.hf_folder import TokenizerFolder
from mpcore.data.indexed import IndexedWriter
from mpcore.data.tokenizer import iter_documents
from mpcore.progress import ProgressBar

CHUNK_BYTES = 4 << 20  # about 4 MB of text per batch: enough work for every core


class HFTokenizer:
    """A tokenizer folder (or its ``tokenizer.json``) loaded through transformers.

    Attributes: ``folder``, ``info`` (:class:`TokenizerFolder`: special ids, fingerprint,
    chat template), ``hf`` (the transformers tokenizer), ``vocab_size``, ``bos_id``,
    ``eos_id``, ``pad_id``, ``separator_id``. ``ValueError`` naming the folder when it has no
    tokenizer.json or transformers cannot load it.
    """

    def __init__(self, path: str | Path):
        self.info = TokenizerFolder(path)
        self.folder = self.info.folder
        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.folder))
        except Exception as e:  # transformers raises many types for a bad folder
            raise ValueError(f"transformers cannot load the tokenizer in {self.folder} ({e}); "
                             f"restore the release's tokenizer files there") from None
        self.backend = self.hf.backend_tokenizer
        if len(self.hf) > self.info.vocab_size:
            raise ValueError(f"transformers loads {len(self.hf)} tokens from {self.folder} but "
                             f"its tokenizer.json holds {self.info.vocab_size} ids (tokens added "
                             f"by tokenizer_config.json only); add them to tokenizer.json "
                             f"(tokenizer.save_pretrained does) so training sees the same ids")
        self.vocab_size = self.info.vocab_size
        self.bos_id, self.eos_id, self.pad_id = self.info.bos_id, self.info.eos_id, self.info.pad_id
        self.separator_id = self.info.separator_id

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as ``AutoTokenizer(text)["input_ids"]`` gives them."""
        return self.backend.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text (:meth:`encode`), the batch spread over all cores."""
        return [e.ids for e in self.backend.encode_batch_fast(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens written out."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)


def _chunks(docs: Iterator[str], size: int) -> Iterator[tuple[list[str], int]]:
    """``(documents, their characters + 1 each)`` of about ``size`` characters each (the
    progress bar counts characters against the files' bytes: close enough, and free)."""
    batch, nbytes = [], 0
    for doc in docs:
        batch.append(doc)
        nbytes += len(doc) + 1  # characters: a cheap, close enough measure for the bar
        if nbytes >= size:
            yield batch, nbytes
            batch, nbytes = [], 0
    if batch:
        yield batch, nbytes


def _flat(encodings) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [N], lengths [docs])`` of a batch of encodings."""
    ids = [e.ids for e in encodings]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64,
                       count=int(lengths.sum()))
    return flat, lengths


def text_meta(tok: HFTokenizer, paths: list[Path]) -> dict:
    """The ``.meta.json`` of a text dataset prepared with ``tok``."""
    return {"kind": "text", "masked": False, "sources": [str(p) for p in paths],
            "tokenizer": {"folder": str(tok.folder), **tok.info.fingerprint}}


def prepare_text(tok: HFTokenizer, paths: list[Path], prefix: Path, text_key: str = "text",
                 progress: bool = True) -> int:
    """Encode every document of ``paths`` into ``<prefix>.bin/.idx/.meta.json`` (module
    docstring); returns the number of documents. Nothing is left at ``prefix`` on an error."""
    size = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    bar = ProgressBar(f"tokenizing -> {prefix}", size, "MB") if progress else None
    done = 0
    with IndexedWriter(prefix, tok.vocab_size, progress=False, meta=text_meta(tok, paths)
                       ) as writer, ThreadPoolExecutor(1) as pool:
        pending = None
        for batch, nbytes in _chunks(iter_documents(paths, text_key), CHUNK_BYTES):
            job = pool.submit(tok.backend.encode_batch_fast, batch)
            if pending is not None:
                writer.add_flat(*_flat(pending[0].result()))
                done += pending[1]
                if bar is not None:
                    bar.update(done)
            pending = (job, nbytes)
        if pending is not None:
            writer.add_flat(*_flat(pending[0].result()))
    if bar is not None:
        bar.close()
    return writer.num_docs
