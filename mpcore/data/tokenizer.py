"""SentencePiece tokenizer: train one deterministically, load an existing ``.model``, and read text.

Training settings are fixed (BPE, byte fallback so any text encodes without ``<unk>``, identity
normalisation and whitespace kept so code and indentation survive, ``\\n`` as its own piece,
digits split) and the random generator is seeded, so the same files in the same order give the
same model bytes on every run. Special ids: ``<unk>`` 0, ``<s>`` (bos) 1, ``</s>`` (eos) 2, no pad.

Text sources (:func:`iter_documents`), one document each:
    ``*.jsonl`` / ``*.json``   one JSON object per line, the text under ``text_key``
    anything else            plain text; one document per blank-line-separated paragraph
Paragraphs (not whole files) keep a document small however large the file, so a text file
larger than RAM streams.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from mpcore import atomic
from mpcore.data.hf_tokenizer import write_hf_tokenizer
from mpcore.data.jsonl import json_lines

TRAIN_COMMAND = (
    "python launch/prepare_data.py --input CORPUS.jsonl --output-prefix PREFIX "
    "--train-tokenizer {path} --vocab-size N"
)
# Changing any of these changes every trained tokenizer: bump the version with them.
SETTINGS_VERSION = 1
_TRAIN_SETTINGS = dict(
    model_type="bpe",
    character_coverage=0.9995,  # the rarest characters fall back to bytes
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    split_digits=True,
    allow_whitespace_only_pieces=True,
    user_defined_symbols=["\n"],
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    # The thread count is stored in the model file; fixed so the bytes are the same everywhere.
    num_threads=4,
    input_sentence_size=2_000_000,
    shuffle_input_sentence=True,
    max_sentence_length=16384,
    minloglevel=2,
)


def iter_documents(paths: Iterable[str | Path], text_key: str = "text") -> Iterator[str]:
    """Yield the documents of ``paths`` in order (see the module docstring), skipping empty ones.
    ``ValueError`` when none of them holds a document (raised as the last one ends, so a writer
    fed from here commits nothing), or a file is not UTF-8 (naming its line)."""
    paths, count = [Path(p) for p in paths], 0
    for path in paths:
        if not path.is_file():
            raise ValueError(f"input file {path} does not exist")
        docs = _iter_jsonl(path, text_key) if path.suffix in (".jsonl", ".json") else (
            _iter_paragraphs(path))
        for doc in docs:
            count += 1
            yield doc
    if not count:
        names = ", ".join(map(str, paths)) or "(no input files)"
        raise ValueError(f"no documents in {names}: empty, or only blank lines / empty "
                         f"{text_key!r} values; nothing was written. Check the input paths "
                         f"(and --text-key for JSONL)")


def _iter_jsonl(path: Path, text_key: str) -> Iterator[str]:
    for _, where, obj, problem in json_lines(path):
        text = obj.get(text_key) if isinstance(obj, dict) else None
        if problem:
            raise ValueError(f"{where}: {problem}; each line must be one JSON object in UTF-8")
        if text_key not in (obj if isinstance(obj, dict) else {}):
            raise ValueError(f"{where}: expected a JSON object with a {text_key!r} string (no "
                             f"such key); pass --text-key to name the field")
        if not isinstance(text, str):
            raise ValueError(f"{where}: {text_key!r} is not a string")
        if text:
            yield text


def _iter_paragraphs(path: Path) -> Iterator[str]:
    lines: list[str] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines).rstrip("\n")
                    lines = []
    except UnicodeDecodeError:
        raise ValueError(_not_utf8(path)) from None
    if lines:
        yield "".join(lines).rstrip("\n")


def _not_utf8(path: Path) -> str:
    """The message for a text file that is not UTF-8: its first bad line and byte."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"{path}:{number}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                        f"{e.start + 1}); convert the file to UTF-8 (e.g. iconv -f latin1 -t "
                        f"utf-8 {path.name}) or leave it out")
    return f"{path}: not UTF-8 text; convert the file to UTF-8 or leave it out"


class Tokenizer:
    """A loaded SentencePiece model.

    Attributes: ``path``, ``vocab_size`` (number of pieces; every id is below it), ``bos_id``,
    ``eos_id``. Raises ``ValueError`` naming the path and the command that creates it when
    the file is missing or is not a SentencePiece model.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(
                f"tokenizer model {self.path} does not exist; create it with: "
                + TRAIN_COMMAND.format(path=self.path)
            )
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.load(str(self.path))
        except (OSError, RuntimeError) as e:
            raise ValueError(
                f"{self.path} is not a SentencePiece model ({e}); recreate it with: "
                + TRAIN_COMMAND.format(path=self.path)
            ) from None
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added)."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no bos/eos added); faster than one call per text."""
        return self._sp.encode(texts)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; ``decode(encode(t)) == t`` for any text (byte fallback)."""
        return self._sp.decode([int(i) for i in ids])

    def write_hf_tokenizer(self, folder: str | Path) -> list[Path]:
        """Write this model as ``tokenizer.model`` plus the Hugging Face tokenizer files
        (``mpcore.data.hf_tokenizer``) into ``folder``, so ``AutoTokenizer.from_pretrained``
        gives :meth:`encode`'s ids; returns the paths. ``ValueError`` when the model's
        behaviour cannot be mirrored (then only ``tokenizer.model`` is written)."""
        return write_hf_files(self.path, Path(folder), self.bos_id, self.eos_id, ())


def write_hf_files(model: Path, folder: Path, bos_id: int, eos_id: int,
              extra_tokens: tuple[str, ...]) -> list[Path]:
    """``tokenizer.model`` (a copy of ``model``) and the HF files, all through mpcore.atomic."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "tokenizer.model"
    if not target.exists() or not target.samefile(model):
        atomic.write_bytes(target, model.read_bytes())
    return [target, *write_hf_tokenizer(model, folder, bos_id, eos_id, extra_tokens)]


def _training_sentences(documents: Iterable[str]) -> Iterator[str]:
    # SentencePiece learns from lines; "\n" is added back as a user-defined piece.
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line


def train_tokenizer(
    documents: Iterable[str],
    model_path: str | Path,
    vocab_size: int,
    seed: int = 1234,
    source: str = "the documents",
) -> Tokenizer:
    """Train a BPE SentencePiece model on ``documents`` and write it to ``model_path``.

    Deterministic: the same documents in the same order, ``vocab_size`` and ``seed`` give the
    same file. The file is written to a temporary name and renamed, so a crash leaves no
    half-written model. Returns the loaded :class:`Tokenizer`. ``source`` names the inputs in
    the error raised when they hold no text.
    """
    if vocab_size < 256 + 4:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: byte fallback needs 256 byte pieces plus "
            "4 specials; use --vocab-size 512 or more"
        )
    model_path = Path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    sentences = _training_sentences(documents)
    first = next(sentences, None)
    if first is None:
        raise ValueError(
            f"no text to train the tokenizer {model_path} on: {source} hold no non-empty "
            "document (JSONL: one object per line with a non-empty text field, see --text-key; "
            "plain text: paragraphs separated by blank lines); pass files that contain text"
        )
    spm.set_random_generator_seed(seed)
    with atomic.atomic_open(model_path, "wb") as f:
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=itertools.chain([first], sentences),
                model_writer=f,
                vocab_size=vocab_size,
                **_TRAIN_SETTINGS,
            )
        except RuntimeError as e:
            raise ValueError(
                f"SentencePiece training for {model_path} failed: {e} (a corpus too small for "
                "the vocabulary needs a smaller --vocab-size; one with many distinct "
                "characters a larger one)"
            ) from None
    return Tokenizer(model_path)
