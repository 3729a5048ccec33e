"""Hugging Face tokenizer files for a SentencePiece model: ``AutoTokenizer`` gives our ids.

``write_hf_tokenizer(model_path, folder)`` writes ``tokenizer.json`` (the ``tokenizers``
library's format), ``tokenizer_config.json`` and ``special_tokens_map.json`` beside an
exported model, each through ``mpcore.atomic``. Nothing here imports transformers or
tokenizers: the model file is read with a small protobuf reader and the JSON is built by hand,
so export needs neither package.

Why these settings (each one mirrors what SentencePiece does for the models
``mpcore.data.tokenizer`` trains: BPE, byte fallback, identity normalisation, whitespace kept):
- normaliser ``Prepend("\u2581")`` then ``Replace(" ", "\u2581")``, no pre-tokenizer: SentencePiece
  adds ONE dummy prefix to the whole text, also when it starts with a space or a newline
  (``" a"`` -> ``"\u2581\u2581a"``). transformers' Metaspace pre-tokenizer skips the prefix when the
  text already starts with a space, which is why LlamaTokenizer's own rebuild differs there.
- merges ranked by the id of the piece they make: SentencePiece BPE merges the pair whose piece
  scores highest, and its scores fall with the id.
- single-character user pieces (``"\\n"``) stay plain vocabulary entries: no merge makes or
  crosses them, as in SentencePiece; as added tokens they would split the text and move the
  dummy prefix.
- ``split_special_tokens``: our tokenizer reads ``"</s>"`` in text as characters, never as eos;
  ``add_bos_token`` / ``add_eos_token`` false: ``encode`` adds neither (training appends eos
  after each document, which is also the padding id, hence ``pad_token``).
- ``extra_tokens`` (the VL placeholders) are added tokens, matched in text, with the ids after
  the vocabulary that ``VLTokenizer`` gives them; not "special", so ``split_special_tokens``
  leaves them matchable (the Qwen2-VL processor writes them into the text).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from mpcore import atomic

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return out, i


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """``(field number, value)`` of a protobuf message (varints as int, the rest as bytes)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield key >> 3, value


def read_sp_model(path: str | Path) -> tuple[list[tuple[str, float, int]], dict, dict]:
    """``(pieces, trainer_spec, normalizer_spec)`` of a SentencePiece ``.model``: each piece
    ``(text, score, type)``; the specs as ``{field number: value}`` (sentencepiece_model.proto)."""
    pieces, trainer, normalizer = [], {}, {}
    for num, value in _fields(Path(path).read_bytes()):
        if num == 1:
            d = dict(_fields(value))
            score = struct.unpack("<f", d[2])[0] if 2 in d else 0.0
            pieces.append((d.get(1, b"").decode("utf-8"), score, d.get(3, NORMAL)))
        elif num in (2, 3):
            (trainer if num == 2 else normalizer).update(_fields(value))
    return pieces, trainer, normalizer


def unsupported_reason(path: str | Path) -> str | None:
    """Why ``path`` cannot be written as an exact ``tokenizer.json``; None when it can."""
    pieces, trainer, norm = read_sp_model(path)
    if trainer.get(3, 1) != 2:
        return "it is not a BPE model"
    if not trainer.get(35, 0):
        return "it has no byte fallback"
    if norm.get(1, b"nmt_nfkc") != b"identity" or norm.get(2, b""):
        return "it normalises text (only the identity rule is mirrored)"
    if norm.get(4, 1) or not norm.get(5, 1):
        return "it removes extra whitespace or does not escape it"
    if any(t == USER_DEFINED and len(p) != 1 for p, _, t in pieces):
        return "it has user-defined pieces longer than one character"
    return None


def _merges(pieces: list[tuple[str, float, int]]) -> list[list[str]]:
    """Every split of a normal piece into two pieces, in the order SentencePiece merges."""
    vocab = {p for p, _, t in pieces if t in (NORMAL, USER_DEFINED)}
    ranked = sorted(((-score, i, p) for i, (p, score, t) in enumerate(pieces) if t == NORMAL))
    return [[p[:k], p[k:]] for _, _, p in ranked for k in range(1, len(p))
            if p[:k] in vocab and p[k:] in vocab]


def _added(content: str, i: int, special: bool) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": special}


def tokenizer_json(path: str | Path, extra_tokens: Sequence[str] = ()) -> dict:
    """The ``tokenizers`` JSON of the SentencePiece model at ``path`` (module docstring);
    ``extra_tokens`` get the ids after its vocabulary. ``ValueError`` when unsupported."""
    reason = unsupported_reason(path)
    if reason is not None:
        raise ValueError(f"{path}: cannot write an exact tokenizer.json: {reason}")
    pieces, _, norm = read_sp_model(path)
    prefix = [{"type": "Prepend", "prepend": SPACE}] if norm.get(3, 1) else []
    unk = next((i for i, (_, _, t) in enumerate(pieces) if t == UNKNOWN), None)
    added = [_added(p, i, True) for i, (p, _, t) in enumerate(pieces) if t in (UNKNOWN, CONTROL)]
    added += [_added(text, len(pieces) + k, False) for k, text in enumerate(extra_tokens)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            *prefix, {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])]},
        "model": {"type": "BPE", "dropout": None,
                  "unk_token": pieces[unk][0] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {p: i for i, (p, _, _) in enumerate(pieces)},
                  "merges": _merges(pieces)},
    }


def write_hf_tokenizer(path: str | Path, folder: str | Path, bos_id: int, eos_id: int,
                       extra_tokens: Sequence[str] = ()) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` for
    the SentencePiece model ``path`` into ``folder``; returns their paths. The ``.model``
    itself is the caller's to copy. ``ValueError`` (with the reason) when the model's
    behaviour cannot be mirrored exactly; nothing is written then."""
    spec = tokenizer_json(path, extra_tokens)
    pieces = list(spec["model"]["vocab"])
    unk = spec["model"]["unk_token"]
    special = {"bos_token": pieces[bos_id], "eos_token": pieces[eos_id],
               "pad_token": pieces[eos_id], **({"unk_token": unk} if unk else {})}
    config = {
        # The generic class loads tokenizer.json as it is; a model class (LlamaTokenizer)
        # would rebuild the pre-tokenizer with its own, different whitespace rule.
        "tokenizer_class": "PreTrainedTokenizerFast", **special,
        "add_bos_token": False, "add_eos_token": False, "split_special_tokens": True,
        "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30,
        "added_tokens_decoder": {
            str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in spec["added_tokens"]},
    }
    folder = Path(folder)
    out = []
    for name, obj in (("tokenizer.json", spec), ("tokenizer_config.json", config),
                      ("special_tokens_map.json", special)):
        out.append(folder / name)
        atomic.write_text(out[-1], json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
    return out
