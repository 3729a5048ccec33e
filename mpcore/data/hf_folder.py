"""A released checkpoint's tokenizer folder, read without transformers (training reads this).

A folder holds ``tokenizer.json`` (the ``tokenizers`` library's format) and usually
``tokenizer_config.json`` (special tokens, ``chat_template``), sometimes
``special_tokens_map.json`` and ``chat_template.jinja`` / ``chat_template.json``. This module
reads what training needs from them, with the ``tokenizers`` library only:

    vocab_size     number of ids (the model vocabulary plus added tokens); every id is below it
    bos/eos/pad    ids of ``bos_token`` / ``eos_token`` / ``pad_token`` as the config names
                   them (None where it names none); never a hard-coded id
    separator_id   what ends each document of a pretraining stream: the eos token
    pad_fill_id    what fills a sample's unused tail (SFT packing): pad, else eos
    fingerprint    the tokenizer by content: sha256 of its vocabulary (every token -> id,
                   added tokens included) and the special ids; prepared datasets record it and
                   a run compares it with ``model.init_from``'s

Encoding is NOT done here: ``mpcore.data.hf_encode`` encodes with the Rust tokenizer that
transformers' ``AutoTokenizer`` builds from the folder (transformers 5 rebuilds some classes'
pre-tokenizers, so the raw ``tokenizer.json`` can give other ids than ``AutoTokenizer``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer

SPECIAL_NAMES = ("bos", "eos", "pad")


def folder_of(path: str | Path) -> Path:
    """The tokenizer folder named by ``path`` (a folder, or its ``tokenizer.json``).
    ``ValueError`` naming the fix when there is no ``tokenizer.json``."""
    path = Path(path)
    folder = path.parent if path.name == "tokenizer.json" else path
    if not (folder / "tokenizer.json").is_file():
        what = "does not exist" if not path.exists() else "has no tokenizer.json"
        raise ValueError(f"tokenizer folder {folder} {what}; pass a released checkpoint's folder "
                         f"(tokenizer.json + tokenizer_config.json, as on the Hugging Face Hub), "
                         f"or a SentencePiece .model (train one with launch/prepare_data.py "
                         f"--train-tokenizer NEW.model --vocab-size N)")
    return folder


def has_tokenizer(folder: str | Path | None) -> bool:
    """True when ``folder`` holds a ``tokenizer.json``."""
    return folder is not None and (Path(folder) / "tokenizer.json").is_file()


def _token_text(value) -> str | None:
    """A special token as configs write it: a string, or ``{"content": ...}``, or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}); restore it from the release") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object; restore it from the release")
    return value


def read_chat_template(folder: Path, config: dict) -> str | None:
    """The chat template as transformers finds it: ``chat_template.jinja``, then
    ``chat_template.json``, then ``tokenizer_config.json``'s ``chat_template`` (a string, or
    a list of named templates of which ``default`` is used)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        config = {"chat_template": _read_json(folder / "chat_template.json").get("chat_template")}
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class TokenizerFolder:
    """What training needs of a tokenizer folder (module docstring); ``path`` may also be the
    folder's ``tokenizer.json``. ``ValueError`` naming the file for a missing folder or file,
    unreadable JSON, or a special token that is not in the vocabulary."""

    def __init__(self, path: str | Path):
        self.folder = folder_of(path)
        try:
            self.rust = RustTokenizer.from_file(str(self.folder / "tokenizer.json"))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"{self.folder / 'tokenizer.json'} is not a tokenizers file ({e}); "
                             f"restore it from the release") from None
        config_path = self.folder / "tokenizer_config.json"
        self.config = _read_json(config_path) if config_path.is_file() else {}
        specials_path = self.folder / "special_tokens_map.json"
        specials = _read_json(specials_path) if specials_path.is_file() else {}
        self.vocab = self.rust.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self.vocab.values()) + 1
        self.special_tokens: dict[str, str | None] = {}
        for name in SPECIAL_NAMES:
            key = f"{name}_token"
            text = _token_text(self.config.get(key, specials.get(key)))
            if text is not None and text not in self.vocab:
                raise ValueError(f"{config_path}: {key} {text!r} is not in the vocabulary of "
                                 f"{self.folder / 'tokenizer.json'}; fix the config or restore "
                                 f"the release's files")
            self.special_tokens[name] = text
        self.bos_id, self.eos_id, self.pad_id = (
            None if self.special_tokens[n] is None else self.vocab[self.special_tokens[n]]
            for n in SPECIAL_NAMES)
        if self.eos_id is None:
            raise ValueError(f"{config_path} names no eos_token; documents need a separator: set "
                             f"eos_token in the tokenizer config to the release's end token")
        self.separator_id = self.eos_id
        self.pad_fill_id = self.pad_id if self.pad_id is not None else self.eos_id
        self.chat_template = read_chat_template(self.folder, self.config)

    def special_ids(self) -> dict[str, int | None]:
        """``{"bos": id, "eos": id, "pad": id}`` (None where the config names none)."""
        return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}

    @property
    def fingerprint(self) -> dict:
        """The tokenizer by content: ``{"vocab_sha256", "vocab_size", "special_ids"}``."""
        h = hashlib.sha256()
        for token, i in sorted(self.vocab.items(), key=lambda kv: kv[1]):
            h.update(f"{i}\t{token}\n".encode())
        return {"vocab_sha256": h.hexdigest(), "vocab_size": self.vocab_size,
                "special_ids": self.special_ids()}


def fingerprint_problem(ours: dict, theirs: dict, ours_name: str, theirs_name: str) -> str | None:
    """Why two fingerprints differ, in words (None when they are the same tokenizer)."""
    if ours.get("vocab_size") != theirs.get("vocab_size"):
        return (f"{ours_name} has {ours.get('vocab_size')} token ids, {theirs_name} "
                f"{theirs.get('vocab_size')}")
    if ours.get("vocab_sha256") != theirs.get("vocab_sha256"):
        return f"{ours_name} and {theirs_name} map tokens to other ids (the vocabularies differ)"
    if ours.get("special_ids") != theirs.get("special_ids"):
        return (f"{ours_name} has special ids {ours.get('special_ids')}, {theirs_name} "
                f"{theirs.get('special_ids')}")
    return None
