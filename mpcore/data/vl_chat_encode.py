"""One checked VL conversation -> the release's ids, an assistant-only mask, image and video rows.

The reference is transformers' processor (``processor.apply_chat_template(messages,
tokenize=True)``), which works on TEXT: the release's chat template renders the conversation
with one placeholder per image and per video, the processor replaces each placeholder by its
expansion as text, and the whole text is tokenized (no added specials). The same is done here,
so that timestamps written between video frames tokenize in their context as there:

- an image's ONE placeholder token (``image_token_id``'s text) becomes ``t*h*w / merge^2`` of
  them, ``(t, h, w)`` its grid after the family's resize rule (``ImageSettings``);
- a video's placeholder, with the two tokens the template writes around it
  (``VideoProcessing.wrap``: Qwen's ``<|vision_start|><|video_pad|><|vision_end|>``, GLM-4V's
  ``<|begin_of_video|><|video|><|end_of_video|>``), becomes the family's layout
  (``VideoProcessing.layout`` with the release's own ids: Qwen2-VL one run of video
  placeholders; Qwen3-VL / Qwen3.5 per temporal patch ``<S.s seconds>`` then a run between
  vision start / end; GLM-4V per temporal patch a run of image placeholders between the
  release's image begin / end and the seconds, inside its video begin / end).

Mask: the text chat path's (``mpcore.data.chat``) on the expanded text: each assistant turn's
content and its end-of-turn token. Placeholder tokens and every token of a video's expansion
(its timestamps included, the processor's text, not the conversation's) are never targets. A
template that writes NO end token for an assistant turn (GLM-4V: ``<|assistant|>\\n`` then the
content, then the next turn's role token; GLM's generation stops at ``<|user|>`` or at eos):
the turn's end token is the next turn's first token when it is special (``<|user|>``), and
after the LAST turn the tokenizer's eos is appended to the conversation and trained (else the
model would never learn to stop), so there the ids are the processor's plus that one eos.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from mpcore.data.chat import ChatRenderer
from mpcore.data.hf_encode import HFTokenizer
from mpcore.data.images import load_image, num_placeholders, process_image
from mpcore.data.videos import VideoSettings, process_video, video_parts
from mpcore.data.vl_manifest import ImageSettings, Video
from mpcore.data.vl_release import ReleaseVLTokenizer

SCHEMA = "mpcore/data/vl_chat.py"


class _Renderer(ChatRenderer):
    """The text chat renderer (``mpcore.data.chat``) with the folder's chat template passed
    explicitly (a VL release may keep it in chat_template.json, which only its processor
    reads), the end-of-turn rule for templates that write no end token (module docstring), and
    a hook that rewrites the rendered text before it is tokenized."""

    def __init__(self, tok: HFTokenizer):
        super().__init__(tok)
        self.template = tok.info.chat_template

    def encode(self, messages: list[dict], where: str, rewrite=None
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [n], mask uint8 [n])`` of one conversation (module docstring);
        ``rewrite(text, spans) -> (text, spans, hidden)``: the expansion, ``hidden`` the
        character ranges whose tokens are never targets."""
        text, spans = self.spans(messages, where)
        hidden: list[tuple[int, int]] = []
        if rewrite is not None:
            text, spans, hidden = rewrite(text, spans)
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
                                 f"token, nor before one, so nothing marks where it stops; "
                                 f"this template cannot be masked")
        for lo, hi in hidden:
            mask[(starts >= lo) & (ends <= hi)] = 0
        if append_eos:
            ids, mask = np.append(ids, self.tok.eos_id), np.append(mask, np.uint8(1))
        return ids, mask


class Encoded(NamedTuple):
    """One conversation: ``ids``, ``mask`` (lists, same length), image ``rows`` and ``grids``
    and ``video_rows`` / ``video_grids``, each in placeholder order."""

    ids: list[int]
    mask: list[int]
    rows: list[np.ndarray]
    grids: list[tuple[int, int, int]]
    video_rows: list[np.ndarray]
    video_grids: list[tuple[int, int, int]]


def system_visual(conv) -> int | None:
    """The index of the first system message holding an image or a video, or None."""
    for k, m in enumerate(conv.messages):
        if m["role"] == "system" and isinstance(m["content"], list) and any(
                p.get("type") in ("image", "video") for p in m["content"]):
            return k
    return None


class VLChatEncoder:
    """Encodes ``Conversation`` s (module docstring) with ``hf`` (the release folder through
    the ``tokenizers`` library), ``tok`` (its vision ids), ``settings`` (the images) and
    ``video`` (the family's video settings; None: the family takes no videos)."""

    def __init__(self, hf: HFTokenizer, tok: ReleaseVLTokenizer, settings: ImageSettings,
                 video: VideoSettings | None = None):
        self.renderer, self.tok, self.settings, self.video = _Renderer(hf), tok, settings, video
        self.image_text = tok.token_text(tok.image_pad_id)
        self.video_text = tok.token_text(tok.video_pad_id)

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

    def _video(self, item: Video, where: str) -> tuple[np.ndarray, tuple[int, int, int], str]:
        """The rows, grid and expansion text (the layout with the release's ids) of a video."""
        if self.video is None:
            raise ValueError(f"{where}: a video, but this family takes no videos; drop it")
        frames = [load_image(frame) for frame in item.frames]
        try:
            pixels, grid = process_video(frames, self.settings, self.video,
                                         name=str(item.frames[0]))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        parts = video_parts(grid, len(frames), item.fps, self.settings, self.video,
                            self.tok.token_ids())
        text = "".join(p if isinstance(p, str) else self.tok.token_text(p) for p in parts)
        return pixels.numpy(), grid, text

    def _wrapped(self) -> str:
        """The text a release's template writes for one video (module docstring)."""
        ids = self.tok.token_ids()
        missing = [name for name in self.video.wrap if name not in ids]
        if missing:
            raise ValueError(f"the release's config.json names no {', '.join(missing)}, which "
                             f"its videos are written between; restore the release's config")
        first, last = (self.tok.token_text(ids[name]) for name in self.video.wrap)
        return first + self.video_text + last

    def _check_counts(self, conv, text: str, where: str) -> None:
        found = (text.count(self.image_text), text.count(self.video_text))
        given = (len(conv.images), len(conv.videos))
        if found == given:
            return
        system = system_visual(conv)
        why = (f"; it does not render images or videos in a system turn (message {system}):"
               f" move them to a user turn" if system is not None else
               f"; write them as {{\"type\": \"image\", \"image\": PATH}} / {{\"type\": "
               f"\"video\", \"video\": [FRAMES]}} parts (see {SCHEMA})")
        raise ValueError(f"{where}: the chat template of {self.tok.folder} wrote {found[0]} "
                         f"image and {found[1]} video placeholder(s) ({self.image_text}, "
                         f"{self.video_text}) for {given[0]} image(s) and {given[1]} "
                         f"video(s){why}")

    def _edits(self, text: str, images, videos, where: str) -> list[tuple[int, int, str, bool]]:
        """``(start, end, new text, hidden)`` per placeholder of the rendered ``text``, in
        order: each image's one placeholder -> its run, each wrapped video placeholder -> its
        layout (hidden: never targets)."""
        edits, at = [], 0
        for _, grid in images:
            k = text.find(self.image_text, at)
            n = num_placeholders(grid, self.settings.merge_size)
            edits.append((k, k + len(self.image_text), self.image_text * n, False))
            at = k + len(self.image_text)
        wrapped, at = (self._wrapped() if videos else ""), 0
        for _, _, layout in videos:
            k = text.find(wrapped, at)
            if k < 0:
                raise ValueError(f"{where}: the chat template wrote a video placeholder "
                                 f"{self.video_text} without the tokens around it that the "
                                 f"processor replaces ({wrapped}); this template cannot take "
                                 f"videos")
            edits.append((k, k + len(wrapped), layout, True))
            at = k + len(wrapped)
        return sorted(edits)

    def encode(self, conv, where: str) -> Encoded:
        """The ids, mask, rows and grids of one conversation; ``ValueError`` naming ``where``."""
        images = [self._image(path, where) for path in conv.images]
        videos = [self._video(item, where) for item in conv.videos]

        def rewrite(text: str, spans):
            self._check_counts(conv, text, where)
            out, hidden, moved, done = [], [], [], 0  # moved: (old end, growth) per edit
            for start, end, new, hide in self._edits(text, images, videos, where):
                out.append(text[done:start])
                at = sum(len(p) for p in out)
                out.append(new)
                if hide:
                    hidden.append((at, at + len(new)))
                moved.append((end, len(new) - (end - start)))
                done = end

            def shift(p: int) -> int:  # span edges never fall inside a placeholder
                return p + sum(grown for end, grown in moved if end <= p)

            out.append(text[done:])
            return "".join(out), [(shift(a), shift(b)) for a, b in spans], hidden

        try:
            ids, mask = self.renderer.encode(conv.messages, where, rewrite)
        except ValueError as e:
            k = system_visual(conv)
            if k is None or "refuses this conversation" not in str(e):
                raise
            raise ValueError(f"{e}; it cannot render images or videos in a system turn "
                             f"(message {k}): move them to a user turn") from None
        mask[np.isin(ids, list(self.tok.placeholder_ids))] = 0  # rows from the tower
        return Encoded(ids.tolist(), mask.tolist(), [r for r, _ in images],
                       [g for _, g in images], [r for r, _, _ in videos],
                       [g for _, g, _ in videos])
