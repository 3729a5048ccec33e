"""Indexed binary token dataset: ``<prefix>.bin`` (tokens) and ``<prefix>.idx`` (index).

``<prefix>.bin``: every document's token ids, back to back, no separators; uint16 when
``vocab_size <= 65536`` (ids fit in 16 bits), else uint32. Little-endian.

``<prefix>.idx``: a 48-byte header, then ``offsets`` int64 [num_docs + 1]:
    magic        8 bytes  b"MPCIDX\\0\\0"
    version      uint32   1
    dtype_code   uint32   2 (uint16) or 4 (uint32): bytes per token
    vocab_size   uint64   vocabulary of the tokenizer that wrote it
    num_docs     uint64
    num_tokens   uint64   == offsets[-1]
    max_token_id int64    largest id in the file (-1 when empty)
Document ``d`` is ``bin[offsets[d]:offsets[d + 1]]``.

Optional sidecars (written by the same writer, renamed before the ``.idx``):
    ``<prefix>.mask``       uint8 [num_tokens]: 1 where the token is a training target (chat
                          SFT: assistant turns and their end-of-turn token), 0 elsewhere
    ``<prefix>.meta.json``  what wrote it: the tokenizer (folder and fingerprint, see
                          ``mpcore.data.hf_folder``), the kind (``text`` / ``chat``), the
                          source files and, for chat data, each document's source line; with
                          ``num_docs`` / ``num_tokens``, so a sidecar of another dataset is
                          refused instead of read

:class:`IndexedWriter` streams: tokens go straight to disk, offsets too (the header is filled in
at the end), so corpora larger than RAM work. Both files are written under temporary names
(``mpcore.atomic``) and renamed when complete and synced, ``.bin`` first and ``.idx`` last,
after the old ``.idx`` is removed: a dataset exists once its ``.idx`` does, so a preparation
killed while writing leaves the previous dataset as it was, and one killed between the two
renames leaves none (never a new ``.bin`` read through an old ``.idx``).
:class:`IndexedDataset` memory-maps both files with numpy and validates them.
"""

from __future__ import annotations

import contextlib
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

from mpcore import atomic

MAGIC = b"MPCIDX\0\0"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQq")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id (< vocab_size) fits in 16 bits, else uint32."""
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


class Progress:
    """A one-line progress report on stderr, at most every ``interval`` seconds."""

    def __init__(self, label: str, interval: float = 1.0, stream=None):
        self.label, self.interval = label, interval
        self.stream = stream if stream is not None else sys.stderr
        self.start = self.last = time.monotonic()

    def update(self, num_docs: int, num_tokens: int, force: bool = False) -> None:
        self.show(f"{num_docs:,} docs", num_tokens, force)

    def show(self, counts: str, num_tokens: int, force: bool = False) -> None:
        """``label: <counts>, <num_tokens> tokens, <rate> tokens/s`` (the final one on ``force``)."""
        now = time.monotonic()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        rate = num_tokens / max(now - self.start, 1e-9)
        end = "\n" if force else "\r"
        self.stream.write(f"{self.label}: {counts}, {num_tokens:,} tokens, {rate:,.0f} tokens/s{end}")
        self.stream.flush()


class IndexedWriter:
    """Streams documents into ``<prefix>.bin`` / ``<prefix>.idx``; use as a context manager.

    ``add(ids)`` appends one document (any int sequence or array); every id must be in
    ``[0, vocab_size)``. On a clean exit the files are complete; on an exception the temporary
    files are removed and no dataset is left behind. ``masked``: also write ``<prefix>.mask``
    (``add(ids, mask)``); ``meta``: a JSON object written as ``<prefix>.meta.json`` with the
    counts added at the end (sidecars of an earlier dataset at ``prefix`` that this one does
    not write are removed with its old ``.idx``).
    """

    def __init__(self, prefix: str | Path, vocab_size: int, progress: bool = True,
                 masked: bool = False, meta: dict | None = None):
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self.num_docs = self.num_tokens = 0
        self.max_token_id = -1
        self.progress = Progress(f"writing {self.prefix}") if progress else None
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        # Exit order (last in, first out): .bin is renamed into place before .idx.
        self._files = contextlib.ExitStack()
        self._idx = self._files.enter_context(atomic.atomic_open(f"{self.prefix}.idx", "wb"))
        self.meta = meta
        self._meta = (self._files.enter_context(atomic.atomic_open(f"{self.prefix}.meta.json"))
                      if meta is not None else None)
        self._mask = (self._files.enter_context(atomic.atomic_open(f"{self.prefix}.mask", "wb"))
                      if masked else None)
        self._bin = self._files.enter_context(atomic.atomic_open(f"{self.prefix}.bin", "wb"))
        self._idx.write(b"\0" * _HEADER.size)
        self._idx.write(np.zeros(1, np.int64).tobytes())

    def add(self, ids, mask=None) -> None:
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of ids, got shape {arr.shape}")
        if (mask is None) != (self._mask is None):
            raise ValueError(f"{self.prefix}: give a loss mask with every document exactly when "
                             f"the writer was made with masked=True")
        if mask is not None:
            mask = np.asarray(mask, dtype=np.uint8)
            if mask.shape != arr.shape:
                raise ValueError(f"document {self.num_docs} for {self.prefix}: mask of shape "
                                 f"{mask.shape} for {arr.shape} ids; one entry per token")
            self._mask.write(mask.tobytes())
        if arr.size:
            low, high = int(arr.min()), int(arr.max())
            if low < 0 or high >= self.vocab_size:
                bad = high if high >= self.vocab_size else low
                raise ValueError(
                    f"document {self.num_docs} for {self.prefix} has token id {bad} outside "
                    f"[0, {self.vocab_size}); the vocab_size given to the writer must be the "
                    "tokenizer's"
                )
            self.max_token_id = max(self.max_token_id, high)
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self.num_docs += 1
        self.num_tokens += arr.size
        self._idx.write(struct.pack("<q", self.num_tokens))
        if self.progress:
            self.progress.update(self.num_docs, self.num_tokens)

    def add_flat(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` documents at once: ``ids`` [sum(lengths)] back to back
        (unmasked writers only; the fast path of text preparation)."""
        if self._mask is not None:
            raise ValueError(f"{self.prefix}: a masked writer takes documents one by one (add)")
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(ids):
            raise ValueError(f"add_flat: lengths sum to {int(lengths.sum())} but {len(ids)} ids")
        if len(ids):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"a document for {self.prefix} has token id "
                                 f"{high if low >= 0 else low} outside [0, {self.vocab_size}); "
                                 f"the vocab_size given to the writer must be the tokenizer's")
            self.max_token_id = max(self.max_token_id, high)
        self._bin.write(np.asarray(ids).astype(self.dtype, copy=False).tobytes())
        ends = self.num_tokens + np.cumsum(lengths)
        self._idx.write(ends.astype("<i8").tobytes())
        self.num_docs += len(lengths)
        self.num_tokens += len(ids)
        if self.progress:
            self.progress.update(self.num_docs, self.num_tokens)

    def close(self) -> None:
        self._idx.seek(0)
        self._idx.write(
            _HEADER.pack(
                MAGIC,
                VERSION,
                self.dtype.itemsize,
                self.vocab_size,
                self.num_docs,
                self.num_tokens,
                self.max_token_id,
            )
        )
        if self._meta is not None:
            counts = {"num_docs": self.num_docs, "num_tokens": self.num_tokens}
            json.dump({**self.meta, **counts}, self._meta, indent=1)
        # The old .idx goes first: between the renames there is no dataset, not a mixed one.
        Path(f"{self.prefix}.idx").unlink(missing_ok=True)
        for suffix, mine in ((".mask", self._mask), (".meta.json", self._meta)):
            if mine is None:  # an earlier dataset's sidecar must not describe this one
                Path(f"{self.prefix}{suffix}").unlink(missing_ok=True)
        self._files.close()  # sync and rename .bin, then .idx (mpcore.atomic)
        if self.progress:
            self.progress.update(self.num_docs, self.num_tokens, force=True)

    def abort(self, error: BaseException | None = None) -> None:
        """Remove the temporary files; the previous dataset (if any) stays."""
        error = error or RuntimeError("IndexedWriter aborted")
        with contextlib.suppress(type(error)):
            self._files.__exit__(type(error), error, error.__traceback__)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort(exc)


class IndexedDataset:
    """Read-only, memory-mapped view of ``<prefix>.bin`` / ``<prefix>.idx``.

    ``ds[d]`` is document ``d``'s ids (a numpy view, uint16/uint32, no copy); ``len(ds)`` is the
    number of documents; ``ds.tokens`` is the whole token array and ``ds.offsets`` int64
    [num_docs + 1]. A missing, truncated or foreign file raises ``ValueError`` naming it.
    ``ds.meta``: the ``.meta.json`` sidecar (None without one); ``ds.loss_mask``: uint8
    [num_tokens] memory-mapped (None without a ``.mask``); ``ds.mask(d)``: document ``d``'s.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        self.idx_path = Path(f"{self.prefix}.idx")
        self.bin_path = Path(f"{self.prefix}.bin")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise ValueError(
                    f"dataset file {path} does not exist; create it with: python "
                    f"launch/prepare_data.py --input CORPUS.jsonl --output-prefix {self.prefix} "
                    "--tokenizer CKPT_FOLDER (or TOKENIZER.model)"
                )
        self._read_header()
        self.offsets = np.memmap(
            self.idx_path, np.int64, "r", offset=_HEADER.size, shape=(self.num_docs + 1,)
        )
        if self.offsets[0] != 0 or self.offsets[-1] != self.num_tokens:
            raise ValueError(f"{self.idx_path} is corrupt: offsets do not span the token file")
        self.tokens = (
            np.memmap(self.bin_path, self.dtype, "r", shape=(self.num_tokens,))
            if self.num_tokens
            else np.zeros(0, self.dtype)
        )
        self.meta = self._read_meta()
        self.loss_mask = None
        if self.meta is not None and self.meta.get("masked"):
            self.loss_mask = self._read_mask()

    def _read_meta(self) -> dict | None:
        path = Path(f"{self.prefix}.meta.json")
        if not path.is_file():
            return None
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is not JSON ({e}); recreate the dataset with "
                             f"launch/prepare_data.py") from None
        counts = (meta.get("num_docs"), meta.get("num_tokens"))
        if counts != (self.num_docs, self.num_tokens):
            raise ValueError(f"{path} describes {counts[0]} documents / {counts[1]} tokens but "
                             f"{self.idx_path} holds {self.num_docs} / {self.num_tokens}: it "
                             f"belongs to another dataset; recreate it with "
                             f"launch/prepare_data.py")
        return meta

    def _read_mask(self) -> np.ndarray:
        path = Path(f"{self.prefix}.mask")
        if not path.is_file() or path.stat().st_size != self.num_tokens:
            raise ValueError(f"{path} is missing or not one byte per token of {self.bin_path}; "
                             f"recreate the dataset with launch/prepare_data.py")
        if not self.num_tokens:
            return np.zeros(0, np.uint8)
        return np.memmap(path, np.uint8, "r", shape=(self.num_tokens,))

    def mask(self, d: int) -> np.ndarray | None:
        """uint8 loss mask of document ``d`` (None for a dataset without masks)."""
        if self.loss_mask is None:
            return None
        return self.loss_mask[self.offsets[d] : self.offsets[d + 1]]

    def _read_header(self) -> None:
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:8] != MAGIC:
            raise ValueError(
                f"{self.idx_path} is not an mpcore indexed dataset (bad magic or truncated); "
                "recreate it with launch/prepare_data.py"
            )
        _, version, code, vocab, docs, toks, max_id = _HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(
                f"{self.idx_path} has format version {version}, this mpcore reads {VERSION}; "
                "recreate it with launch/prepare_data.py"
            )
        if code not in _DTYPES:
            raise ValueError(f"{self.idx_path} has an unknown token dtype code {code}")
        self.dtype, self.vocab_size = _DTYPES[code], vocab
        self.num_docs, self.num_tokens, self.max_token_id = docs, toks, max_id
        want_idx = _HEADER.size + 8 * (docs + 1)
        want_bin = toks * self.dtype.itemsize
        for path, want in ((self.idx_path, want_idx), (self.bin_path, want_bin)):
            size = path.stat().st_size
            if size != want:
                raise ValueError(
                    f"{path} is truncated or corrupt: {size} bytes, the header says {want}; "
                    "recreate the dataset with launch/prepare_data.py"
                )

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, d: int) -> np.ndarray:
        if not -self.num_docs <= d < self.num_docs:
            raise IndexError(f"document {d} out of range for {self.num_docs} documents")
        d %= self.num_docs
        return self.tokens[self.offsets[d] : self.offsets[d + 1]]

    @property
    def doc_lengths(self) -> np.ndarray:
        """int64 [num_docs]: tokens per document."""
        return np.diff(np.asarray(self.offsets))

    def check_vocab(self, model_vocab_size: int, scan: bool = False) -> None:
        """Raise ``ValueError`` when a token id is >= ``model_vocab_size``.

        Uses the max id stored in the header; ``scan=True`` also reads the whole token file
        in chunks (streaming) to verify it.
        """
        max_id = self.max_token_id
        if scan:
            chunk = 1 << 24
            for start in range(0, self.num_tokens, chunk):
                max_id = max(max_id, int(self.tokens[start : start + chunk].max()))
        if max_id >= model_vocab_size:
            raise ValueError(
                f"{self.bin_path} holds token id {max_id}, but the model's vocab_size is "
                f"{model_vocab_size} (ids must be < vocab_size); set model.vocab_size >= "
                f"{max_id + 1} or re-tokenize the corpus with the model's tokenizer "
                "(launch/prepare_data.py --tokenizer CKPT_FOLDER, or MODEL.model)"
            )
