"""VL conversations -> a release's token ids, an assistant-only mask, and the images' rows.

Input, one JSON object per line (``path:line`` in every error), images by path (relative to
the file's folder unless absolute), as transformers' processors take them::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                               {"type": "text", "text": "What is it?"}]},
                  {"role": "assistant", "content": "A cat."}]}

A content is a string or a list of parts ``{"type": "text", "text": ...}`` /
``{"type": "image", "image": PATH}``; roles and the other rules are the text chat path's
(``mpcore.data.chat``: system, user, assistant, tool; an assistant turn required). Videos in
conversations are refused for now (prepare them as manifest lines, mpcore/data/vl_manifest.py).

Ids, as transformers' processor gives them (``processor.apply_chat_template(messages,
tokenize=True)``, the reference): the release's chat template renders the conversation (one
image placeholder token per image: Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``,
GLM's ``<|begin_of_image|><|image|><|end_of_image|>``), the text is tokenized without added
specials, then each image's ONE placeholder id (the release's ``image_token_id``) becomes
``t*h*w / merge^2`` of them, ``(t, h, w)`` the image's grid after the family's resize rule
(``ImageSettings``: the release's preprocessor_config.json or the family's defaults).

Mask (1 = the token is a target): the text chat path's (each assistant turn's content and its
end-of-turn token; not its role header, nor any system, user or tool token), computed on the
rendered text before the expansion; image placeholders are never targets. A template that
writes NO end token for an assistant turn (GLM-4V: ``<|assistant|>\n`` then the content, then
the next turn's role token; GLM's generation stops at ``<|user|>`` or at eos): the turn's end
token is the next turn's first token when it is special (``<|user|>``), and after the LAST
turn the tokenizer's eos is appended to the conversation and trained (else the model would
never learn to stop), so there the ids are the processor's plus that one eos.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mpcore.data.chat import ROLES, ChatRenderer
from mpcore.data.hf_encode import HFTokenizer
from mpcore.data.images import load_image, num_placeholders, process_image
from mpcore.data.jsonl import json_lines
from mpcore.data.vl_dataset import FORMAT, VERSION, EncodedSample, check_out_dir, write_vl_dataset
from mpcore.data.vl_manifest import (
    MAX_REPORTED,
    ImageSettings,
    ManifestSummary,
    VLProgress,
    image_header,
)
from mpcore.data.vl_release import ReleaseVLTokenizer

SCHEMA = "mpcore/data/vl_chat.py"


class Conversation(NamedTuple):
    """One checked line: ``messages`` for the template, ``images`` (paths, in order)."""

    line: int
    messages: list[dict]
    images: list[Path]


def _part(part, folder: Path, at: str, images: list[Path]) -> dict:
    if not isinstance(part, dict):
        raise ValueError(f"{at} must be an object like {{\"type\": \"text\", \"text\": ...}}")
    kind = part.get("type") or ("image" if "image" in part else "text" if "text" in part
                                else "video" if "video" in part else None)
    if kind == "text":
        if not isinstance(part.get("text"), str) or not part["text"].strip():
            raise ValueError(f"{at} is a text part without text; give a non-empty string")
        return part
    if kind == "image":
        path = part.get("image")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{at} is an image part without a path: give "
                             f"{{\"type\": \"image\", \"image\": \"a.jpg\"}}")
        images.append(folder / path)
        return part
    if kind == "video":
        raise ValueError(f"{at} is a video; videos in conversations are not supported yet: "
                         f"prepare them as manifest lines (mpcore/data/vl_manifest.py) or drop it")
    raise ValueError(f"{at} has type {part.get('type')!r}; use text or image parts (see "
                     f"{SCHEMA})")


def _message(m, folder: Path, where: str, k: int, images: list[Path]) -> dict:
    if not isinstance(m, dict):
        raise ValueError(f"{where}: message {k} is not an object with role and content")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ValueError(f"{where}: message {k} has role {role!r}; use one of {', '.join(ROLES)}")
    if isinstance(content, list):
        if not content:
            raise ValueError(f"{where}: message {k} ({role}) has an empty content list")
        parts = [_part(p, folder, f"{where}: message {k} part {j}", images)
                 for j, p in enumerate(content)]
        return {**m, "content": parts}
    if not isinstance(content, str) or not content.strip():
        if role == "assistant" and m.get("tool_calls"):
            return m
        raise ValueError(f"{where}: message {k} ({role}) has no content; give a string or a "
                         f"list of text / image parts, or drop the message")
    return m


def conversation_of(obj, folder: Path, where: str, line: int) -> Conversation:
    """The checked conversation of one JSON line (module docstring); ``ValueError`` naming
    ``where`` (``path:line``) and the fix. Image files are not opened here."""
    if not isinstance(obj, dict) or set(obj) != {"messages"}:
        found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{where}: expected {{\"messages\": [...]}} (a VL conversation), found "
                         f"{found}; see {SCHEMA}")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of "
                         f'{{"role": ..., "content": ...}} objects')
    images: list[Path] = []
    messages = [_message(m, folder, where, k, images) for k, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn, so nothing would train; add the "
                         f"assistant's answer or drop the line")
    return Conversation(line, messages, images)


def is_conversation_file(path: str | Path) -> bool:
    """True when the first non-blank line of ``path`` is an object with ``messages``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for text in f:
            if text.strip():
                try:
                    obj = json.loads(text)
                except ValueError:
                    return False
                return isinstance(obj, dict) and "messages" in obj
    return False


def iter_conversations(path: str | Path):
    """``(where, Conversation or None, problem or None)`` per line of ``path``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"conversation file {path} does not exist")
    folder = path.resolve().parent
    for line in json_lines(path):
        if line.problem:
            yield line.where, None, f"{line.where}: {line.problem}; each line is one JSON object"
            continue
        try:
            yield line.where, conversation_of(line.value, folder, line.where, line.number), None
        except ValueError as e:
            yield line.where, None, str(e)


def scan_conversations(path: str | Path, settings: ImageSettings, extra: dict,
                       progress: bool = True) -> ManifestSummary:
    """Check every line and image header of ``path``; one ``ValueError`` listing up to 20
    problems (``path:line: problem; fix``), nothing written. The fingerprint covers
    ``extra`` (settings, tokenizer), every image's bytes and the file."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    problems: list[str] = []
    samples = images = tokens = rows = 0
    meter = VLProgress(f"checking {path} (image tokens only)") if progress else None
    for where, conv, problem in iter_conversations(path):
        if len(problems) >= MAX_REPORTED:
            break
        if problem:
            problems.append(problem)
            continue
        samples += 1
        for image in conv.images:
            try:
                t, gh, gw = settings.grid(*image_header(image, where), None, where)
            except ValueError as e:
                problems.append(str(e) if str(e).startswith(where) else f"{where}: {e}")
                continue
            h.update(hashlib.sha256(image.read_bytes()).digest())
            images += 1
            rows += t * gh * gw
            tokens += t * gh * gw // settings.merge_size**2
        if meter:
            meter.update(samples, tokens, images)
    if problems:
        more = f" (stopped at the first {MAX_REPORTED})" if len(problems) >= MAX_REPORTED else ""
        raise ValueError(f"{path}: {len(problems)} problem(s){more}; nothing was written:\n  "
                         + "\n  ".join(problems))
    if samples == 0:
        raise ValueError(f"{path} holds no conversations; add lines (see {SCHEMA})")
    h.update(Path(path).read_bytes())
    return ManifestSummary(samples, images, tokens, rows, h.hexdigest())


class _Renderer(ChatRenderer):
    """The text chat renderer (``mpcore.data.chat``) with the folder's chat template passed
    explicitly (a VL release may keep it in chat_template.json, which only its processor
    reads), and the end-of-turn rule for templates that write no end token (module
    docstring: GLM-4V)."""

    def __init__(self, tok: HFTokenizer):
        super().__init__(tok)
        self.template = tok.info.chat_template

    def encode(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [n], mask uint8 [n])`` of one conversation (module docstring)."""
        text, spans = self.spans(messages, where)
        enc = self.tok.backend.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        starts = np.asarray([a for a, _ in enc.offsets], dtype=np.int64)
        ends = np.asarray([b for _, b in enc.offsets], dtype=np.int64)
        special = np.isin(ids, list(self.special))
        mask = np.zeros(len(ids), dtype=np.uint8)
        append_eos = False
        for turn, (lo, hi) in enumerate(spans):
            inside = (starts >= lo) & (ends <= hi) & (ends > starts)
            if (((starts < lo) & (ends > lo)) | ((starts < hi) & (ends > hi))).any():
                raise ValueError(f"{where}: a token straddles the edge of assistant turn {turn} "
                                 f"(the template glues its header or end to the content), so "
                                 f"the turn cannot be masked exactly")
            first = int(np.flatnonzero(inside)[0])
            ending = np.flatnonzero(inside & special)
            after = int(np.searchsorted(starts, hi))  # the first token after the turn
            if len(ending):
                mask[first : ending[-1] + 1] = 1
            elif after < len(ids) and special[after]:
                mask[first : after + 1] = 1  # the next turn's role token ends this one
            elif after == len(ids):
                mask[first:] = 1
                append_eos = True  # the last turn: the eos the model stops at
            else:
                raise ValueError(f"{where}: assistant turn {turn} ends neither with a special "
                                 f"token nor before one, so nothing marks where it stops; "
                                 f"this template cannot be masked")
        if append_eos:
            ids, mask = np.append(ids, self.tok.eos_id), np.append(mask, np.uint8(1))
        return ids, mask


class Encoded(NamedTuple):
    """One conversation: ``ids``, ``mask`` (lists, same length), image ``rows`` and ``grids``
    in placeholder order."""

    ids: list[int]
    mask: list[int]
    rows: list[np.ndarray]
    grids: list[tuple[int, int, int]]


class VLChatEncoder:
    """Encodes :class:`Conversation` s (module docstring) with ``hf`` (the release folder
    through transformers), ``tok`` (its vision ids) and ``settings`` (the images)."""

    def __init__(self, hf: HFTokenizer, tok: ReleaseVLTokenizer, settings: ImageSettings):
        self.renderer, self.tok, self.settings = _Renderer(hf), tok, settings

    def _image(self, path: Path, where: str) -> tuple[np.ndarray, tuple[int, int, int]]:
        s = self.settings
        try:
            pixels, grid = process_image(
                load_image(path), patch_size=s.patch_size,
                temporal_patch_size=s.temporal_patch_size, merge_size=s.merge_size,
                min_pixels=s.min_pixels, max_pixels=s.max_pixels, mean=s.mean, std=s.std,
                resize=s.resize, name=str(path), size_rule=s.size_rule)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return pixels.numpy(), grid

    def encode(self, conv: Conversation, where: str) -> Encoded:
        """The ids, mask, rows and grids of one conversation; ``ValueError`` naming ``where``."""
        ids, mask = self.renderer.encode(conv.messages, where)
        pad = self.tok.image_pad_id
        at = np.flatnonzero(ids == pad)
        if len(at) != len(conv.images) or np.isin(ids, [self.tok.video_pad_id]).any():
            raise ValueError(f"{where}: the chat template of {self.tok.folder} wrote {len(at)} "
                             f"image placeholder(s) ({self.tok.token_text(pad)}) for "
                             f"{len(conv.images)} image(s); write images as "
                             f"{{\"type\": \"image\", \"image\": PATH}} parts (see {SCHEMA})")
        out_ids: list[int] = []
        out_mask: list[int] = []
        rows, grids, start = [], [], 0
        for k, path in zip(at.tolist(), conv.images, strict=True):
            pixels, grid = self._image(path, where)
            n = num_placeholders(grid, self.settings.merge_size)
            out_ids += ids[start:k].tolist() + [pad] * n
            out_mask += mask[start:k].tolist() + [0] * n
            rows.append(pixels)
            grids.append(grid)
            start = k + 1
        out_ids += ids[start:].tolist()
        out_mask += mask[start:].tolist()
        return Encoded(out_ids, out_mask, rows, grids)


def prepare_vl_conversations(path: str | Path, out_dir: str | Path, tok: ReleaseVLTokenizer,
                             settings: ImageSettings, overwrite: bool = False,
                             progress: bool = True) -> Path:
    """Check the conversations of ``path`` (every problem as ``path:line``, nothing written),
    then write them as a prepared VL dataset folder ``out_dir`` (mpcore/data/vl_dataset.py;
    its ``meta.json`` records ``tok`` by content and its vision ids; the release's tokenizer
    files are copied in), atomically; returns ``out_dir``."""
    path, out_dir = Path(path), Path(out_dir)
    check_out_dir(out_dir, overwrite)
    extra = {"format": FORMAT, "version": VERSION, "kind": "conversations",
             "settings": settings.to_json(), "tokenizer": tok.to_json()}
    summary = scan_conversations(path, settings, extra, progress)
    encoder = VLChatEncoder(HFTokenizer(tok.folder), tok, settings)

    def samples():
        for where, conv, problem in iter_conversations(path):
            if problem:  # the file changed since the check
                raise ValueError(problem)
            enc = encoder.encode(conv, where)
            yield conv.line, EncodedSample(enc.ids, enc.mask, enc.rows, enc.grids, [], [])

    return write_vl_dataset(path, out_dir, tok, settings, None, summary, samples(), progress)
