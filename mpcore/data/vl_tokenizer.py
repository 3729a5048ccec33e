"""The vision-language tokenizer: a SentencePiece model plus four special ids after its vocab.

Decision: the text side is any SentencePiece model (the default corpus's, from
``prepare_default``, or the one a real dataset was tokenized with), unchanged, so text-only
datasets prepared with ``launch/prepare_data.py`` and the same model blend with image-text ones
id for id. The ids the Qwen2-VL model needs are appended after its ``V`` pieces rather than
trained into it (SentencePiece user symbols would change every id after them):

    image_pad     V       one per merged image patch (``image_token_id``; never a target)
    video_pad     V + 1   one per merged video patch (``video_token_id``; never a target)
    vision_start  V + 2   before every placeholder run (``vision_start_token_id``)
    vision_end    V + 3   after every placeholder run (``vision_end_token_id``)

so the model's vocabulary is ``V + 4``. ``encode`` never produces them (they are not pieces);
``decode`` renders them as ``<|image_pad|>`` etc.

Saved beside a prepared dataset as ``tokenizer.json`` (with the ``.model`` copied next to it,
so the folder is self-contained), which training and export read::

    {"format": "mpcore.vl_tokenizer", "version": 1, "sp_model": "tokenizer.model",
     "sp_sha256": "...", "text_vocab_size": V, "vocab_size": V + 4, "bos_id": 1, "eos_id": 2,
     "image_token_id": V, "video_token_id": V + 1, "vision_start_token_id": V + 2,
     "vision_end_token_id": V + 3}

The four ``*_token_id`` keys are ``mpcore.models.qwen2_vl.config.VLConfig``'s field names.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from mpcore.data.tokenizer import Tokenizer, write_hf_files
from mpcore.manifest import file_entry

FORMAT, VERSION = "mpcore.vl_tokenizer", 1
SPECIAL_NAMES = ("image_pad", "video_pad", "vision_start", "vision_end")
TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def file_sha256(path: str | Path) -> str:
    """The sha256 of the file's bytes (``mpcore.manifest``'s streaming hash)."""
    return file_entry(Path(path), sync=False)["sha256"]


class VLTokenizer:
    """A SentencePiece :class:`Tokenizer` with the VL special ids appended (module docstring).

    ``VLTokenizer(model_path)`` wraps a ``.model``; ``VLTokenizer.load(json_path)`` reads a
    saved ``tokenizer.json``. Attributes: ``text_vocab_size`` (V), ``vocab_size`` (V + 4),
    ``bos_id``, ``eos_id``, ``image_pad_id``, ``video_pad_id``, ``vision_start_id``,
    ``vision_end_id``.
    """

    def __init__(self, model_path: str | Path):
        self.text = Tokenizer(model_path)
        self.path = self.text.path
        self.text_vocab_size = self.text.vocab_size
        self.bos_id, self.eos_id = self.text.bos_id, self.text.eos_id

    @property
    def image_pad_id(self) -> int:
        return self.text_vocab_size

    @property
    def video_pad_id(self) -> int:
        return self.text_vocab_size + 1

    @property
    def vision_start_id(self) -> int:
        return self.text_vocab_size + 2

    @property
    def vision_end_id(self) -> int:
        return self.text_vocab_size + 3

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: every text piece and the four special ids."""
        return self.text_vocab_size + len(SPECIAL_NAMES)

    @property
    def placeholder_ids(self) -> tuple[int, int]:
        """``(image_pad_id, video_pad_id)``: never targets, never padding."""
        return self.image_pad_id, self.video_pad_id

    def token_ids(self) -> dict[str, int]:
        """The four ids under ``VLConfig``'s field names (``image_token_id``, ...)."""
        ids = (self.image_pad_id, self.video_pad_id, self.vision_start_id, self.vision_end_id)
        return dict(zip(TOKEN_KEYS, ids, strict=True))

    def encode(self, text: str) -> list[int]:
        """Text ids of ``text`` (no bos/eos); all below ``text_vocab_size``."""
        return self.text.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special ids rendered as ``<|image_pad|>`` etc."""
        out, run = [], []
        for i in map(int, ids):
            if i < self.text_vocab_size:
                run.append(i)
                continue
            out.append(self.text.decode(run))
            run = []
            k = i - self.text_vocab_size
            if k >= len(SPECIAL_NAMES):
                raise ValueError(f"id {i} is outside the VL vocabulary [0, {self.vocab_size})")
            out.append(f"<|{SPECIAL_NAMES[k]}|>")
        out.append(self.text.decode(run))
        return "".join(out)

    def write_hf_tokenizer(self, folder: str | Path) -> list[Path]:
        """The Hugging Face tokenizer files (``Tokenizer.write_hf_tokenizer``) with the four
        special ids as added tokens ``<|image_pad|>`` etc. at the ids above; returns the
        paths. Qwen2-VL's processor writes these names into the text it tokenizes."""
        extra = tuple(f"<|{name}|>" for name in SPECIAL_NAMES)
        return write_hf_files(self.path, Path(folder), self.bos_id, self.eos_id, extra)

    def to_json(self, sp_model: str = "tokenizer.model") -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "sp_model": sp_model,
            "sp_sha256": file_sha256(self.path),
            "text_vocab_size": self.text_vocab_size,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            **self.token_ids(),
        }

    def save(self, folder: str | Path) -> Path:
        """Copy the ``.model`` into ``folder`` as ``tokenizer.model`` and write
        ``tokenizer.json``; returns the json's path."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        model = folder / "tokenizer.model"
        if model.resolve() != self.path.resolve():
            shutil.copyfile(self.path, model)
        path = folder / "tokenizer.json"
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> VLTokenizer:
        """A saved ``tokenizer.json`` (or a folder holding one); ``ValueError`` naming the
        file when it is missing, foreign, or its ``.model`` is not the one it names."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            spec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{path}: cannot read a VL tokenizer json ({e}); it is written by "
                f"launch/prepare_vl_data.py beside the dataset"
            ) from None
        if (
            not isinstance(spec, dict)
            or spec.get("format") != FORMAT
            or spec.get("version") != VERSION
        ):
            raise ValueError(
                f"{path} is not an {FORMAT} version {VERSION} file; re-prepare "
                f"the dataset with launch/prepare_vl_data.py"
            )
        tok = cls(path.parent / spec["sp_model"])
        if file_sha256(tok.path) != spec["sp_sha256"] or tok.to_json(spec["sp_model"]) != spec:
            raise ValueError(
                f"{path}: the SentencePiece model {tok.path} is not the one this "
                f"json was written for (its hash or ids differ); re-prepare the "
                f"dataset"
            )
        return tok


def as_vl_tokenizer(tokenizer: str | Path | VLTokenizer) -> VLTokenizer:
    """A :class:`VLTokenizer` from itself, a ``.model`` path, or a ``tokenizer.json`` (or its
    folder)."""
    if isinstance(tokenizer, VLTokenizer):
        return tokenizer
    path = Path(tokenizer)
    if path.is_dir() or path.suffix == ".json":
        return VLTokenizer.load(path)
    return VLTokenizer(path)
