"""An export after ``model.init_from`` keeps the release's tokenizer, chat template and
generation settings: the files are copied byte for byte beside our weights.

A run fine-tuned from a released checkpoint tokenized its data with the release's own
tokenizer folder (``data.tokenizer``, by default ``model.init_from``; ``mpcore.batches``
checked that they are the same tokenizer by content). Writing a tokenizer of our own there
would change bos / pad ids and drop the chat template: the folder would look complete and
tokenize wrongly. So :func:`copy_release` copies, unchanged, every file of ``RELEASE_FILES``
that the tokenizer folder holds, ``generation_config.json`` (and a VL release's processor
configs, ``PROCESSOR_FILES``) from ``model.init_from``, and sets
the special ids of our ``config.json`` (``bos_token_id``, ``eos_token_id``, ``pad_token_id``,
at the top and in ``text_config``) to the release config's own values (keys the release's
config lacks are removed from ours, so transformers reads the same defaults as from the
release). Every write goes through ``mpcore.atomic``.
"""

from __future__ import annotations

import json
from pathlib import Path

from mpcore import atomic
from mpcore.data.vl_release import FORMAT as RELEASE_FORMAT

RELEASE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "chat_template.json", "added_tokens.json",
                 "tokenizer.model", "vocab.json", "merges.txt")
SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# A VL release's processor files (the image settings its VL data was prepared with)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")


def release_tokenizer(config: dict) -> Path | None:
    """The tokenizer folder a text run read (``data.tokenizer`` when it names a folder, else
    ``model.init_from`` with a tokenizer.json), or the first VL dataset of a VL run when it was
    prepared with a release's tokenizer (VL conversations: the folder holds the release's
    tokenizer files, copied unchanged), from its saved config; None otherwise."""
    data, model = config.get("data") or {}, config.get("model") or {}
    if data.get("vl_paths"):
        first = Path(data["vl_paths"][0])
        meta = first / "meta.json"
        record = json.loads(meta.read_text()).get("tokenizer") or {} if meta.is_file() else {}
        return first if record.get("format") == RELEASE_FORMAT else None
    if not data.get("paths"):
        return None
    named = data.get("tokenizer") or model.get("init_from")
    if not named or Path(named).suffix == ".model":
        return None
    folder = Path(named)
    folder = folder.parent if folder.name == "tokenizer.json" else folder
    return folder if (folder / "tokenizer.json").is_file() else None


def _special_ids(source: dict, target: dict) -> None:
    for key in SPECIAL_ID_KEYS:
        if key in source:
            target[key] = source[key]
        else:
            target.pop(key, None)


def copy_release(tokenizer: Path, init_from: str | None, output: Path) -> list[str]:
    """Copy the release's files into ``output`` (module docstring); returns their names."""
    copied = []
    for name in RELEASE_FILES:
        if (tokenizer / name).is_file():
            atomic.write_bytes(output / name, (tokenizer / name).read_bytes())
            copied.append(name)
    release = Path(init_from) if init_from else tokenizer
    for name in ("generation_config.json", *PROCESSOR_FILES):
        if (release / name).is_file():
            atomic.write_bytes(output / name, (release / name).read_bytes())
            copied.append(name)
    if (release / "config.json").is_file() and (output / "config.json").is_file():
        theirs = json.loads((release / "config.json").read_text())
        ours = json.loads((output / "config.json").read_text())
        _special_ids(theirs, ours)
        if isinstance(ours.get("text_config"), dict):
            _special_ids(theirs.get("text_config", theirs), ours["text_config"])
        atomic.write_text(output / "config.json", json.dumps(ours, indent=2) + "\n")
    return copied
