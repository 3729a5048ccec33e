"""The image-text manifest: JSONL, one sample per line, and its check.

Four kinds of line (blank lines are skipped):

    caption        {"image": "cats/1.jpg", "caption": "A cat on a mat."}
    video caption  {"video": ["clip/0.png", "clip/1.png", ...], "caption": "A cat jumps."}
    interleaved    {"content": [{"text": "Look:"}, {"image": "a.png"}, {"text": "a dog."},
                                {"video": ["f0.png", "f1.png"]}, ...]}
    text only      {"text": "Any document."}

A video is the list of its (already sampled) frame files, in order, all of one size; optional
beside it (a video caption line or a content video item): ``"fps": F`` (frames per second of the
listed frames, for the timestamps Qwen3-VL and GLM-4V write between frames; default 24, what
transformers assumes for pre-sampled frames). Videos follow the family's video processor
(``mpcore.data.videos``); preparing them needs the family's video settings.

Optional on caption and interleaved lines: ``"max_pixels": N`` (an int >= the run's min_pixels)
caps the resize of that sample's images (not its videos), as Qwen2-VL's per-image
``max_pixels``. Optional on an interleaved text item: ``"target": false`` (the text is context,
e.g. a prompt, not a target). No other keys are allowed (a typo must not silently drop data).

Image paths are relative to the manifest's folder (absolute paths also work); the files must be
PNG or JPEG (checked by content, not by name). A sample becomes, with ``<vs> <pad>*n <ve>`` for
each image (``n = t*h*w / merge^2`` placeholders, its grid after the resize) and each video as
the family's processor writes it (``VideoProcessing.layout``: Qwen2-VL ``<vs> <video_pad>*n
<ve>``; Qwen3-VL and GLM-4V one run per temporal patch with timestamps as text):

    caption      <vs> <pad>*n <ve> caption EOS
    interleaved  its items in order, then EOS
    text only    text EOS

Targets (``loss_mask[t]`` true = token t is a target, ``mpcore.parallel.LabelShifter``'s meaning): every
text token whose item is a target (a caption, any text without ``"target": false``) and the EOS;
never an image's ``<vs> <pad>* <ve>`` nor any token of a video. A sample needs at least one
target text.

:func:`scan_manifest` checks a whole manifest before anything is written: JSON, keys, types,
empty texts, missing files, files that are not PNG/JPEG, sizes (aspect ratio; over
``max_pixels`` when resizing is off; a video's frames of different sizes). It reports up to 20 problems at once, each as
``manifest:line: what is wrong; how to fix it``. It reads only image headers (and hashes the
bytes for the fingerprint), so it streams.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

from mpcore.data.images import (
    CLIP_MEAN,
    CLIP_STD,
    FORMATS,
    MAX_PIXELS,
    MIN_PIXELS,
    check_image_size,
    resize_to,
)
from mpcore.data.indexed import Progress
from mpcore.data.jsonl import json_lines
from mpcore.data.videos import VideoSettings, video_grid

SCHEMA = "mpcore/data/vl_manifest.py"
MAX_REPORTED = 20
_KINDS = {
    "caption": ({"image", "caption"}, {"max_pixels"}),
    "video_caption": ({"video", "caption"}, {"fps"}),
    "interleaved": ({"content"}, {"max_pixels"}),
    "text": ({"text"}, set()),
}


@dataclass(frozen=True)
class ImageSettings:
    """How images are resized and cut (``mpcore.data.images.process_image``'s arguments), for
    one model family's image processor (:meth:`for_family`; the defaults are Qwen2-VL's)."""

    patch_size: int = 14
    """Side of one vision patch in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch; an image repeats its one frame this many times."""
    merge_size: int = 2
    """The merger fuses merge x merge patches into one placeholder token."""
    min_pixels: int = MIN_PIXELS
    """Smaller images are scaled up to at least this many pixels."""
    max_pixels: int = MAX_PIXELS
    """Larger images are scaled down to at most this many (a sample may lower it)."""
    resize: bool = True
    """False: images are used at their own size, which must be multiples of patch * merge and
    at most max_pixels (else the manifest check fails)."""
    pixel_dtype: str = "float32"
    """Storage of the pixel rows: float32 (exact) or float16 (half the disk; abs error <= 1e-3
    on CLIP-normalised values, see tests/unit/test_vl_data.py)."""
    family: str = "qwen2_vl"
    """The model family whose image processor these settings follow (``mpcore.models.registry``); a
    run of another family refuses the data (``mpcore.vl_data``)."""
    mean: tuple[float, ...] = CLIP_MEAN
    """Per-channel mean subtracted after the 1/255 rescale."""
    std: tuple[float, ...] = CLIP_STD
    """Per-channel standard deviation divided by."""
    size_rule: Callable | None = field(default=None, compare=False, repr=False)
    """The family's resize rule (``Family.image_size_rule``; None: Qwen2-VL's
    ``smart_resize``). Not stored: ``family`` names it. The settings of a prepared dataset
    (``VLDataset.settings``) describe it and leave this None."""

    @classmethod
    def for_family(cls, family, **overrides) -> ImageSettings:
        """The settings of ``family``'s image processor (a ``mpcore.models.Family`` of an image-text
        family: its ``image_processing`` defaults and resize rule), with ``overrides`` (fields
        given as None keep the family's value)."""
        proc = family.image_processing
        if proc is None:
            raise ValueError(f"the {family.name} family takes no images; prepare image-text "
                             f"data for a vision-language family")
        values = dict(patch_size=proc.patch_size, temporal_patch_size=proc.temporal_patch_size,
                      merge_size=proc.merge_size, min_pixels=proc.min_pixels,
                      max_pixels=proc.max_pixels, mean=tuple(proc.mean), std=tuple(proc.std))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values, family=family.name, size_rule=proc.size_rule)

    @classmethod
    def from_json(cls, d: dict) -> ImageSettings:
        """:meth:`to_json` back (without the resize rule); a dataset prepared before settings
        named their family is Qwen2-VL's (all data was prepared that way then)."""
        names = {f.name for f in fields(cls)} - {"size_rule"}
        values = {k: tuple(v) if k in ("mean", "std") else v for k, v in d.items() if k in names}
        return cls(**values)

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"image setting {name} must be a positive int, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}; "
                f"lower --min-pixels or raise --max-pixels"
            )
        if self.pixel_dtype not in ("float32", "float16"):
            raise ValueError(f"pixel_dtype must be float32 or float16, got {self.pixel_dtype!r}")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
                raise ValueError(f"image setting {name} must be three numbers (R, G, B), got "
                                 f"{value!r}")
        if not all(v > 0 for v in self.std):
            raise ValueError(f"image setting std must be positive, got {self.std!r}")

    @property
    def factor(self) -> int:
        """Image sides are multiples of this (``patch_size * merge_size``)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Width of one pixel row: ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def to_json(self) -> dict:
        """Every field but the resize rule (which ``family`` names), mean/std as lists."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "size_rule"}
        return {**out, "mean": list(self.mean), "std": list(self.std)}

    def grid(
        self, height: int, width: int, max_pixels: int | None, name: str
    ) -> tuple[int, int, int]:
        """The ``(t, h, w)`` patch grid an image of ``height x width`` gets."""
        cap = self.max_pixels if max_pixels is None else max_pixels
        if cap < self.min_pixels:
            raise ValueError(
                f"max_pixels {cap} is below min_pixels {self.min_pixels}; raise "
                f"the sample's max_pixels or lower --min-pixels"
            )
        if self.resize:
            height, width = resize_to(
                height, width, patch_size=self.patch_size, merge_size=self.merge_size,
                temporal_patch_size=self.temporal_patch_size, min_pixels=self.min_pixels,
                max_pixels=cap, size_rule=self.size_rule)
        else:
            check_image_size(height, width, factor=self.factor, max_pixels=cap, name=name)
        return 1, height // self.patch_size, width // self.patch_size


@dataclass(frozen=True)
class Video:
    """A video item: its frame files in order, and its ``fps`` (None: not given)."""

    frames: tuple[Path, ...]
    fps: float | None = None


@dataclass(frozen=True)
class ManifestSample:
    """One parsed line: ``parts`` in order, each ``("text", str, is_target)``,
    ``("image", Path, False)`` or ``("video", Video, False)``; ``max_pixels`` the sample's
    cap of its images or None."""

    line: int
    kind: str
    parts: tuple[tuple[str, str | Path | Video, bool], ...]
    max_pixels: int | None

    @property
    def images(self) -> list[Path]:
        return [p for kind, p, _ in self.parts if kind == "image"]

    @property
    def videos(self) -> list[Video]:
        return [v for kind, v, _ in self.parts if kind == "video"]


class VLProgress(Progress):
    """``label: N samples, M images, K tokens, R tokens/s`` on one line, at most every second."""

    def update(
        self, num_samples: int, num_tokens: int, num_images: int = 0, force: bool = False
    ) -> None:
        self.show(f"{num_samples:,} samples, {num_images:,} images", num_tokens, force)


def _fail(where: str, message: str) -> ValueError:
    return ValueError(f"{where}: {message}")


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, f"{what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _fail(where, f"{what} is empty; give it text or drop it (see {SCHEMA})")
    return value


def _image(value, folder: Path, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"an image must be a non-empty path string, got {value!r}")
    return folder / value


def parse_video(value, fps, folder: Path, where: str) -> Video:
    """A video item: ``value`` a non-empty list of frame paths (relative to ``folder``),
    ``fps`` a positive number or None; ``ValueError`` naming ``where``."""
    if not isinstance(value, list) or not value:
        raise _fail(where, f"a video must be a non-empty list of frame paths, got {value!r}")
    frames = tuple(_image(frame, folder, where) for frame in value)
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                            or not fps > 0 or not math.isfinite(fps)):
        raise _fail(where, f"fps must be a positive number, got {fps!r}")
    return Video(frames, None if fps is None else float(fps))


def _content(items, folder: Path, where: str) -> list[tuple[str, str | Path, bool]]:
    if not isinstance(items, list) or not items:
        raise _fail(
            where, 'content must be a non-empty list of {"text": ...} / {"image": ...} items'
        )
    parts = []
    for k, item in enumerate(items):
        at = f"{where}: content[{k}]"
        if not isinstance(item, dict):
            raise ValueError(f"{at} must be an object, got {type(item).__name__}")
        keys = set(item)
        if keys == {"image"}:
            parts.append(("image", _image(item["image"], folder, at), False))
        elif "video" in keys and keys <= {"video", "fps"}:
            parts.append(("video", parse_video(item["video"], item.get("fps"), folder, at), False))
        elif "text" in keys and keys <= {"text", "target"}:
            target = item.get("target", True)
            if not isinstance(target, bool):
                raise ValueError(f"{at}: target must be true or false, got {target!r}")
            parts.append(("text", _text(item["text"], at, "text"), target))
        else:
            raise ValueError(
                f'{at} has keys {sorted(keys)}; an item is {{"text": ...}} '
                f'(optionally with "target": false), {{"image": ...}} or {{"video": [...]}} '
                f'(optionally with "fps")'
            )
    if not any(kind == "text" and target for kind, _, target in parts):
        raise _fail(
            where,
            "content has no target text (only images or target: false); a "
            "sample needs some text to learn",
        )
    return parts


def parse_line(obj, folder: Path, where: str) -> tuple[str, list, int | None]:
    """``(kind, parts, max_pixels)`` of one decoded JSON line (see the module docstring)."""
    if not isinstance(obj, dict):
        raise _fail(where, f"expected a JSON object, got {type(obj).__name__}")
    keys = set(obj)
    kind = (
        "interleaved"
        if "content" in keys
        else "video_caption"
        if "video" in keys
        else "caption"
        if keys & {"image", "caption"}
        else "text"
        if "text" in keys
        else None
    )
    if kind is None:
        raise _fail(
            where,
            f'keys {sorted(keys)} fit no sample kind; use {{"image", "caption"}}, '
            f'{{"video", "caption"}}, {{"content": [...]}} or {{"text"}} (see {SCHEMA})',
        )
    required, optional = _KINDS[kind]
    if missing := required - keys:
        raise _fail(where, f"a {kind} sample needs {sorted(missing)} as well")
    if unknown := keys - required - optional:
        raise _fail(
            where,
            f"unknown keys {sorted(unknown)} for a {kind} sample (allowed: "
            f"{sorted(required | optional)}); remove or rename them",
        )
    max_pixels = obj.get("max_pixels")
    if max_pixels is not None and (
        isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1
    ):
        raise _fail(where, f"max_pixels must be a positive int, got {max_pixels!r}")
    if kind == "caption":
        parts = [
            ("image", _image(obj["image"], folder, where), False),
            ("text", _text(obj["caption"], where, "caption"), True),
        ]
    elif kind == "video_caption":
        parts = [
            ("video", parse_video(obj["video"], obj.get("fps"), folder, where), False),
            ("text", _text(obj["caption"], where, "caption"), True),
        ]
    elif kind == "interleaved":
        parts = _content(obj["content"], folder, where)
    else:
        parts = [("text", _text(obj["text"], where, "text"), True)]
    return kind, parts, max_pixels


def _parsed_lines(path: Path) -> Iterator[tuple[str, ManifestSample | None, str | None]]:
    """``(where, sample, None)`` per good line, ``(where, None, problem)`` per bad one."""
    if not path.is_file():
        raise ValueError(f"manifest {path} does not exist")
    folder = path.resolve().parent
    for line_no, where, obj, problem in json_lines(path):
        if problem:
            yield where, None, f"{where}: {problem}; each line is one JSON object"
            continue
        try:
            kind, parts, max_pixels = parse_line(obj, folder, where)
        except ValueError as e:
            yield where, None, str(e)
            continue
        yield where, ManifestSample(line_no, kind, tuple(parts), max_pixels), None


def iter_manifest(path: str | Path) -> Iterator[ManifestSample]:
    """The samples of a manifest, in order; ``ValueError`` (``path:line: ...``) on the first
    line that does not fit the schema. Files are not opened (see :func:`scan_manifest`)."""
    for _, sample, problem in _parsed_lines(Path(path)):
        if problem:
            raise ValueError(problem)
        yield sample


def image_header(path: Path, where: str) -> tuple[int, int]:
    """``(height, width)`` of a PNG/JPEG from its header; ``ValueError`` naming the line."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise _fail(
            where, f"image {path} does not exist; paths are relative to the manifest's folder"
        )
    try:
        with Image.open(path) as image:
            fmt, (width, height) = image.format, image.size
    except (OSError, UnidentifiedImageError) as e:
        raise _fail(
            where, f"{path} is not a readable image ({type(e).__name__}); give a PNG or JPEG file"
        ) from None
    if fmt not in FORMATS:
        raise _fail(
            where,
            f"{path} is {fmt}, not PNG or JPEG; convert it (e.g. PIL: "
            f"Image.open(p).convert('RGB').save('x.png'))",
        )
    return height, width


@dataclass(frozen=True)
class ManifestSummary:
    """What :func:`scan_manifest` found: counts and the sha256 of the manifest, every image's
    bytes (in order) and ``extra`` (the settings)."""

    num_samples: int
    num_images: int
    num_image_tokens: int
    num_pixel_rows: int
    fingerprint: str
    num_videos: int = 0
    num_video_rows: int = 0


def video_header(item: Video, settings: ImageSettings, video: VideoSettings | None,
                 where: str) -> tuple[int, int, int]:
    """The ``(t, h, w)`` grid of a video item from its frames' headers (all of one size);
    ``ValueError`` naming the line and the fix."""
    if video is None:
        raise _fail(where, f"a video, but no video settings were given (the {settings.family} "
                           f"family's prepared data takes none); prepare it with "
                           f"launch/prepare_vl_data.py --family of a family with a video "
                           f"processor, or drop the video")
    for k, frame in enumerate(item.frames):
        if not frame.is_file():
            raise _fail(where, f"frame {k} of a video ({frame}) does not exist; frame paths are "
                               f"relative to the file's folder unless absolute")
    sizes = [image_header(frame, where) for frame in item.frames]
    for k, size in enumerate(sizes):
        if size != sizes[0]:
            raise _fail(where, f"frame {k} ({item.frames[k]}) is {size[0]}x{size[1]} but frame "
                               f"0 is {sizes[0][0]}x{sizes[0][1]}; all frames of a video must "
                               f"have one size")
    try:
        return video_grid(len(sizes), *sizes[0], settings, video)
    except ValueError as e:
        raise _fail(where, f"video of {item.frames[0]}...: {e}") from None


def scan_manifest(
    path: str | Path, settings: ImageSettings, extra: dict | None = None, progress: bool = True,
    video: VideoSettings | None = None,
) -> ManifestSummary:
    """Check every line and image header of ``path`` (module docstring); raises one
    ``ValueError`` listing up to 20 problems, each ``path:line: problem; fix``. ``video``:
    the family's video settings (None: a video is a problem)."""
    path = Path(path)
    h = hashlib.sha256(json.dumps(extra or {}, sort_keys=True).encode())
    problems: list[str] = []
    samples = images = tokens = rows = videos = video_rows = 0
    meter = VLProgress(f"checking {path} (image tokens only)") if progress else None
    for where, sample, problem in _parsed_lines(path):
        if len(problems) >= MAX_REPORTED:
            break
        if problem:
            problems.append(problem)
            continue
        samples += 1
        for image in sample.images:
            try:
                height, width = image_header(image, where)
                t, gh, gw = settings.grid(height, width, sample.max_pixels, where)
            except ValueError as e:
                problems.append(str(e) if str(e).startswith(where) else f"{where}: {e}")
                continue
            h.update(hashlib.sha256(image.read_bytes()).digest())
            images += 1
            rows += t * gh * gw
            tokens += t * gh * gw // settings.merge_size**2
        for item in sample.videos:
            try:
                t, gh, gw = video_header(item, settings, video, where)
            except ValueError as e:
                problems.append(str(e))
                continue
            for frame in item.frames:  # the content of every frame, as of every image
                h.update(hashlib.sha256(frame.read_bytes()).digest())
            videos += 1
            video_rows += t * gh * gw
        if meter:
            meter.update(samples, tokens, images)
    if meter:
        meter.update(samples, tokens, images, force=True)
    if problems:
        more = f" (stopped at the first {MAX_REPORTED})" if len(problems) >= MAX_REPORTED else ""
        raise ValueError(
            f"{path}: {len(problems)} problem(s){more}; nothing was written:\n  "
            + "\n  ".join(problems)
        )
    if samples == 0:
        raise ValueError(f"{path} holds no samples; add lines (see {SCHEMA})")
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return ManifestSummary(samples, images, tokens, rows, h.hexdigest(), videos, video_rows)
