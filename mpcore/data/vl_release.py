"""A released checkpoint's tokenizer as the tokenizer of VL data: its own vision token ids.

A released VL checkpoint (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Qwen3.5) keeps its vision
tokens INSIDE its vocabulary, as added special tokens (``<|image_pad|>``, ``<|vision_start|>``,
GLM's ``<|image|>``, ``<|begin_of_image|>``, ...), and its ``config.json`` names their ids under
the family config's field names (``image_token_id``, ``video_token_id``,
``vision_start_token_id`` / ``image_start_token_id``, ...). Data prepared for a release uses
exactly those ids, so the release's embedding rows are the ones that train; the model's
vocabulary is the release's (nothing is appended after it, unlike ``VLTokenizer``).

:class:`ReleaseVLTokenizer` is what training reads (no transformers): the tokenizer folder
(:class:`~mpcore.data.hf_folder.TokenizerFolder`, the ``tokenizers`` library) and the ids,
``token_ids`` (family field name -> id). A prepared dataset folder holds a copy of the
release's tokenizer files (``RELEASE_FILES``) and records the ids and the tokenizer's
fingerprint (by content) in ``meta.json``; :meth:`ReleaseVLTokenizer.load` reads them back and
refuses files that are not the recorded tokenizer.

It offers what the VL data path asks of a tokenizer (``mpcore.vl_data``, ``VLPackedDataset``):
``vocab_size`` = ``text_vocab_size`` (text data prepared with the same folder blends id for
id), ``eos_id`` (the separator: a text id), ``token_ids()``, ``placeholder_ids``,
``image_pad_id``, ``video_pad_id``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mpcore.data.hf_folder import TokenizerFolder, fingerprint_problem

FORMAT = "hf_release"
RELEASE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "chat_template.json", "added_tokens.json")
NOT_VISION = ("bos_token_id", "eos_token_id", "pad_token_id")


def is_release_tokenizer(path: str | Path) -> bool:
    """True when ``path`` (a folder or its ``tokenizer.json``) is a ``tokenizers`` file, not
    mpcore's own VL tokenizer json (``"format": "mpcore.vl_tokenizer"``)."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.name != "tokenizer.json" or not file.is_file():
        return False
    with open(file, "rb") as f:
        head = f.read(4096)
    return b'"mpcore.vl_tokenizer"' not in head


class ReleaseVLTokenizer:
    """A release's tokenizer folder with its vision token ids (module docstring).

    ``folder``: the tokenizer folder (or its ``tokenizer.json``); ``token_ids``: the release
    config's ``*_token_id`` fields of its family (``image_token_id`` and ``video_token_id``
    required). ``ValueError`` naming the file when an id is not one of the folder's special
    tokens (a config of another release beside this tokenizer)."""

    def __init__(self, folder: str | Path, token_ids: dict[str, int]):
        self.info = TokenizerFolder(folder)
        self.folder = self.info.folder
        for key in ("image_token_id", "video_token_id"):
            if key not in token_ids:
                raise ValueError(f"the release's config names no {key}; pass the folder of a "
                                 f"vision-language release (its config.json names the vision "
                                 f"token ids)")
        added = set(self.info.rust.get_added_tokens_decoder())
        for key, i in token_ids.items():
            if not isinstance(i, int) or i not in added:
                raise ValueError(f"{key} = {i!r} is not an added token of {self.folder / 'tokenizer.json'}"
                                 f"; the config.json and the tokenizer are of different "
                                 f"releases: restore the release's files")
        self._ids = dict(token_ids)
        self.vocab_size = self.text_vocab_size = self.info.vocab_size
        self.bos_id, self.eos_id, self.pad_id = self.info.bos_id, self.info.eos_id, self.info.pad_id
        self.pad_fill_id = self.info.pad_fill_id  # fills the tail of a chat sample

    @property
    def image_pad_id(self) -> int:
        return self._ids["image_token_id"]

    @property
    def video_pad_id(self) -> int:
        return self._ids["video_token_id"]

    @property
    def placeholder_ids(self) -> tuple[int, int]:
        """``(image_pad_id, video_pad_id)``: never targets, never padding."""
        return self.image_pad_id, self.video_pad_id

    def token_ids(self) -> dict[str, int]:
        """The vision ids under the family config's field names (``mpcore.build`` compares
        them with ``model.init_from``'s config)."""
        return dict(self._ids)

    @property
    def fingerprint(self) -> dict:
        return self.info.fingerprint

    def token_text(self, i: int) -> str:
        return self.info.rust.id_to_token(int(i))

    def decode(self, ids) -> str:
        """Text of ``ids``, special tokens (``<|image_pad|>``, ...) written out."""
        return self.info.rust.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> dict:
        """What ``meta.json`` records: the format, the source folder, the fingerprint (by
        content) and the vision ids."""
        return {"format": FORMAT, "folder": str(self.folder), **self.fingerprint,
                "vocab_size": self.vocab_size, "token_ids": self.token_ids()}

    def save(self, folder: str | Path) -> Path:
        """Copy the release's tokenizer files into ``folder``; returns its ``tokenizer.json``."""
        folder = Path(folder)
        for name in RELEASE_FILES:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, folder / name)
        return folder / "tokenizer.json"

    @classmethod
    def load(cls, folder: str | Path, record: dict) -> ReleaseVLTokenizer:
        """The tokenizer a dataset folder holds, checked against its ``meta.json`` record;
        ``ValueError`` naming the folder when the files are not the recorded tokenizer."""
        tok = cls(folder, {k: int(v) for k, v in record["token_ids"].items()})
        problem = fingerprint_problem(tok.fingerprint, record, f"{tok.folder}/tokenizer.json",
                                      "the tokenizer meta.json records")
        if problem:
            raise ValueError(f"{problem}; the dataset's files were changed: prepare it again "
                             f"with launch/prepare_vl_data.py")
        return tok
