"""VL conversations -> a release's token ids, an assistant-only mask, and the images' rows.

Input, one JSON object per line (``path:line`` in every error), images by path (relative to
the file's folder unless absolute), as transformers' processors take them::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                               {"type": "text", "text": "What is it?"}]},
                  {"role": "assistant", "content": "A cat."}]}

A content is a string or a list of parts ``{"type": "text", "text": ...}`` /
``{"type": "image", "image": PATH}`` / ``{"type": "video", "video": [FRAME, ...]}``. A video
is the list of its frame files (PNG or JPEG, sampled beforehand, all of one size, in order;
relative paths as for images), optionally with ``"fps": F`` (the frames per second of that
list, for the timestamps Qwen3-VL and GLM-4V write; default 24, what transformers assumes for
pre-sampled frames); a video given as one file is refused (decode and sample it into frames
first, e.g. ``ffmpeg -i clip.mp4 -vf fps=2 clip/%04d.png``). Roles and the other rules are the
text chat path's (``mpcore.data.chat``: system, user, assistant, tool; an assistant turn
required).

Ids and mask: ``mpcore.data.vl_chat_encode`` (what transformers' processor gives on the same
messages, the release's own vision ids). Images follow the family's image processor
(``ImageSettings``: the release's preprocessor_config.json or the family's defaults), videos
its video processor (``VideoSettings``: the release's video processor config).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

from mpcore.data.chat import ROLES
from mpcore.data.hf_encode import HFTokenizer
from mpcore.data.jsonl import json_lines
from mpcore.data.videos import VideoSettings
from mpcore.data.vl_chat_encode import SCHEMA, VLChatEncoder
from mpcore.data.vl_dataset import FORMAT, VERSION, EncodedSample, check_out_dir, write_vl_dataset
from mpcore.data.vl_manifest import (
    MAX_REPORTED,
    ImageSettings,
    ManifestSummary,
    Video,
    VLProgress,
    image_header,
    parse_video,
    video_header,
)
from mpcore.data.vl_release import ReleaseVLTokenizer


class Conversation(NamedTuple):
    """One checked line: ``messages`` for the template, ``images`` (paths) and ``videos``
    (``Video``: frame paths, fps), each in order."""

    line: int
    messages: list[dict]
    images: list[Path]
    videos: list[Video]


def _video(part: dict, folder: Path, at: str) -> Video:
    value = part.get("video")
    if isinstance(value, str):
        raise ValueError(f"{at} gives the video as one file ({value!r}); give its frames "
                         f"instead: {{\"type\": \"video\", \"video\": [\"f0.png\", "
                         f"\"f1.png\", ...]}} (sample it first, e.g. ffmpeg -i clip.mp4 -vf "
                         f"fps=2 clip/%04d.png), optionally with \"fps\"")
    extra = set(part) - {"type", "video", "fps"}
    if extra:
        raise ValueError(f"{at} is a video part with unknown key(s) {sorted(extra)}; it takes "
                         f"video (the frame list) and fps")
    return parse_video(value, part.get("fps"), folder, at)


def _part(part, folder: Path, at: str, images: list[Path], videos: list[Video]) -> dict:
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
        videos.append(_video(part, folder, at))
        return part
    raise ValueError(f"{at} has type {part.get('type')!r}; use text, image or video parts "
                     f"(see {SCHEMA})")


def _message(m, folder: Path, where: str, k: int, images: list[Path],
             videos: list[Video]) -> dict:
    if not isinstance(m, dict):
        raise ValueError(f"{where}: message {k} is not an object with role and content")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ValueError(f"{where}: message {k} has role {role!r}; use one of {', '.join(ROLES)}")
    if isinstance(content, list):
        if not content:
            raise ValueError(f"{where}: message {k} ({role}) has an empty content list")
        parts = [_part(p, folder, f"{where}: message {k} part {j}", images, videos)
                 for j, p in enumerate(content)]
        return {**m, "content": parts}
    if not isinstance(content, str) or not content.strip():
        if role == "assistant" and m.get("tool_calls"):
            return m
        raise ValueError(f"{where}: message {k} ({role}) has no content; give a string or a "
                         f"list of text / image / video parts, or drop the message")
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
    videos: list[Video] = []
    messages = [_message(m, folder, where, k, images, videos) for k, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn, so nothing would train; add the "
                         f"assistant's answer or drop the line")
    return Conversation(line, messages, images, videos)


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


def _scan_visuals(conv: Conversation, where: str, settings: ImageSettings,
                  video: VideoSettings | None, h) -> tuple[list[int], list[int]]:
    """The row counts of the images and of the videos of one conversation, from the files'
    headers; their bytes go into ``h``. ``ValueError`` naming ``where``."""
    images = []
    for image in conv.images:
        t, gh, gw = settings.grid(*image_header(image, where), None, where)
        h.update(hashlib.sha256(image.read_bytes()).digest())
        images.append(t * gh * gw)
    videos = []
    if conv.videos and video is None:
        raise ValueError(f"{where}: a video, but the {settings.family} family takes no videos "
                         f"(its processor has no video rules); drop the video, or prepare for "
                         f"a release of a family that takes them")
    for item in conv.videos:
        t, gh, gw = video_header(item, settings, video, where)
        problem = video.problem(item.fps, settings.temporal_patch_size)
        if problem:
            raise ValueError(f"{where}: {problem}")
        for frame in item.frames:
            h.update(hashlib.sha256(frame.read_bytes()).digest())
        h.update(json.dumps(item.fps).encode())
        videos.append(t * gh * gw)
    return images, videos


def scan_conversations(path: str | Path, settings: ImageSettings, extra: dict,
                       progress: bool = True, video: VideoSettings | None = None
                       ) -> ManifestSummary:
    """Check every line and every image and frame header of ``path``; one ``ValueError``
    listing up to 20 problems (``path:line: problem; fix``), nothing written. ``video``: the
    family's video settings (None: a video is a problem). The fingerprint covers ``extra``
    (settings, tokenizer), every image's and frame's bytes and the file."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    problems: list[str] = []
    samples = images = tokens = rows = videos = video_rows = 0
    meter = VLProgress(f"checking {path} (image tokens only)") if progress else None
    for where, conv, problem in iter_conversations(path):
        if len(problems) >= MAX_REPORTED:
            break
        if problem:
            problems.append(problem)
            continue
        samples += 1
        try:
            image_rows, clip_rows = _scan_visuals(conv, where, settings, video, h)
        except ValueError as e:
            problems.append(str(e) if str(e).startswith(where) else f"{where}: {e}")
            continue
        images, rows = images + len(image_rows), rows + sum(image_rows)
        tokens += sum(image_rows) // settings.merge_size**2
        videos, video_rows = videos + len(clip_rows), video_rows + sum(clip_rows)
        if meter:
            meter.update(samples, tokens, images)
    if problems:
        more = f" (stopped at the first {MAX_REPORTED})" if len(problems) >= MAX_REPORTED else ""
        raise ValueError(f"{path}: {len(problems)} problem(s){more}; nothing was written:\n  "
                         + "\n  ".join(problems))
    if samples == 0:
        raise ValueError(f"{path} holds no conversations; add lines (see {SCHEMA})")
    h.update(Path(path).read_bytes())
    return ManifestSummary(samples, images, tokens, rows, h.hexdigest(), videos, video_rows)


def prepare_vl_conversations(path: str | Path, out_dir: str | Path, tok: ReleaseVLTokenizer,
                             settings: ImageSettings, overwrite: bool = False,
                             progress: bool = True, video: VideoSettings | None = None) -> Path:
    """Check the conversations of ``path`` (every problem as ``path:line``, nothing written),
    then write them as a prepared VL dataset folder ``out_dir`` (mpcore/data/vl_dataset.py;
    its ``meta.json`` records ``tok`` by content and its vision ids, and ``video``, the
    family's video settings (None: videos are refused); the release's tokenizer files are
    copied in), atomically; returns ``out_dir``."""
    path, out_dir = Path(path), Path(out_dir)
    check_out_dir(out_dir, overwrite)
    extra = {"format": FORMAT, "version": VERSION, "kind": "conversations",
             "settings": settings.to_json(), "tokenizer": tok.to_json(),
             "video_settings": None if video is None else video.to_json()}
    summary = scan_conversations(path, settings, extra, progress, video)
    encoder = VLChatEncoder(HFTokenizer(tok.folder), tok, settings, video)

    def samples():
        for where, conv, problem in iter_conversations(path):
            if problem:  # the file changed since the check
                raise ValueError(problem)
            e = encoder.encode(conv, where)
            yield conv.line, EncodedSample(e.ids, e.mask, e.rows, e.grids, e.video_rows,
                                           e.video_grids)

    return write_vl_dataset(path, out_dir, tok, settings, video, summary, samples(), progress)
