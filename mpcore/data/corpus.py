"""The default corpus that ships with mpcore, prepared on first use.

Source: ``launch/data/default_corpus.jsonl`` (Python standard library docstrings, PSF license;
see launch/data/README.md). :func:`prepare_default` trains a SentencePiece tokenizer on it and
writes the indexed dataset, into ``data_dir``:

    default_v<vocab>.model            the tokenizer
    default_v<vocab>.bin / .idx       the tokenized corpus (documents in file order)
    default_v<vocab>.fingerprint      JSON: sha256 of the corpus bytes and every setting, and the
                                      sha256 of each file above as written; written last

A later call reuses the files when the fingerprint matches AND each file still has the sha256
recorded for it (a few MB read, about 10 ms): a cache damaged since (a truncated .bin, a
tokenizer replaced by hand) is rebuilt, with a warning naming the file, instead of trained on.
A call that builds them prints one line saying so and how long it took. Deterministic: the same
corpus bytes
and settings give the same tokenizer and dataset on every machine. Ranks that call it at the
same time (torchrun) serialise on a file lock in ``data_dir``; the first prepares, the rest
find the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.resources
import json
import logging
import time
from pathlib import Path

from mpcore.atomic import write_text
from mpcore.data import indexed, tokenizer
from mpcore.data.indexed import IndexedWriter
from mpcore.data.tokenizer import Tokenizer, iter_documents, train_tokenizer
from mpcore.progress import ProgressBar

# The shipped data is package data of mpcore.launch (launch/data): found by where that package
# lies, in a checkout and in an installed wheel alike; no code of the launch layer is imported.
SHIPPED_DATA = Path(str(importlib.resources.files("mpcore.launch"))) / "data"
DEFAULT_CORPUS = SHIPPED_DATA / "default_corpus.jsonl"
TOKENIZER_SEED = 1234
_ENCODE_BATCH = 256
log = logging.getLogger(__name__)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_problem(stamp: Path, want: str, files: list[Path]) -> str | None:
    """Why the prepared files cannot be reused (None: they can). A stamp of another corpus or
    settings is not a problem to report (it is simply prepared again)."""
    try:
        record = json.loads(stamp.read_text())
        if record.get("fingerprint") != want:
            return ""
        hashes = record["files"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""  # no stamp, or one written by an mpcore that recorded no file hashes
    for path in files:
        if not path.is_file():
            return f"{path} is missing"
        if _sha256(path) != hashes.get(path.name):
            return f"{path} does not match the sha256 recorded when it was prepared"
    return None


def fingerprint(corpus: Path, vocab_size: int) -> str:
    """sha256 over the corpus bytes and every setting that changes the outputs."""
    h = hashlib.sha256()
    with open(corpus, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    settings = {
        "vocab_size": vocab_size,
        "tokenizer_settings": tokenizer.SETTINGS_VERSION,
        "tokenizer_seed": TOKENIZER_SEED,
        "index_version": indexed.VERSION,
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def tokenize_to_indexed(
    tok: Tokenizer, paths: list[Path], prefix: Path, text_key: str = "text", progress: bool = True
) -> int:
    """Encode every document of ``paths`` (streaming, in batches) into ``<prefix>.bin/.idx``.

    ``progress``: a bar on stderr over the input bytes. Returns the number of documents written.
    """
    size = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    bar = ProgressBar(f"tokenizing -> {prefix}", size, "MB") if progress else None
    with IndexedWriter(prefix, tok.vocab_size, progress=False) as writer:
        batch: list[str] = []
        for doc in iter_documents(paths, text_key):
            if bar is not None:
                bar.advance(len(doc.encode()) + 1)  # about its bytes in the file
            batch.append(doc)
            if len(batch) == _ENCODE_BATCH:
                for ids in tok.encode_batch(batch):
                    writer.add(ids)
                batch = []
        for ids in tok.encode_batch(batch):
            writer.add(ids)
    if bar is not None:
        bar.close()
    return writer.num_docs


def prepare_default(
    data_dir: str | Path, vocab_size: int = 2048, corpus: str | Path = DEFAULT_CORPUS
) -> tuple[Path, Path]:
    """Tokenizer and indexed dataset of the default corpus in ``data_dir``, built if needed.

    Returns ``(tokenizer_path, dataset_prefix)``. Takes about a second on 2 CPU cores.
    """
    corpus = Path(corpus)
    if not corpus.is_file():
        raise ValueError(
            f"the default corpus {corpus} is missing; it ships with the mpcore repository "
            "(run from a checkout) or can be rebuilt with python launch/make_default_corpus.py"
        )
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    stem = data_dir / f"default_v{vocab_size}"
    model_path, prefix = stem.with_suffix(".model"), stem
    stamp = stem.with_suffix(".fingerprint")
    want = fingerprint(corpus, vocab_size)
    with open(data_dir / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the with block closes the file
        files = [model_path, Path(f"{prefix}.bin"), Path(f"{prefix}.idx")]
        problem = _cache_problem(stamp, want, files)
        if problem is None:
            return model_path, prefix
        if problem:
            log.warning("the prepared default corpus in %s is damaged (%s); preparing it "
                        "again", data_dir, problem)
        why = "its cache there did not match, rebuilt" if stamp.is_file() else "first use"
        stamp.unlink(missing_ok=True)
        start = time.perf_counter()
        tok = train_tokenizer(iter_documents([corpus]), model_path, vocab_size, TOKENIZER_SEED)
        num_docs = tokenize_to_indexed(tok, [corpus], prefix, progress=False)
        write_text(stamp, json.dumps({"fingerprint": want,
                                      "files": {p.name: _sha256(p) for p in files}}))
        # One line, from the one process that prepared (the others found the cache).
        print(f"prepared the default corpus in {data_dir} ({why}): tokenizer "
              f"{model_path.name} and {num_docs} documents in "
              f"{time.perf_counter() - start:.1f} s; later runs reuse it", flush=True)
    return model_path, prefix
