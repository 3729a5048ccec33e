"""The input file of launch/score.py: parsed and checked line by line before any compute.

One JSON object per line, in one of these forms (a file may mix them; they are packed together):

    {"input_ids": [...], "loss_mask": [...]}                      text only (loss_mask optional)
    {"input_ids": [...], "pixel_values": [[...], ...], "image_grid_thw": [[t, h, w], ...]}
    {"input_ids": [...], "images": ["cat.png", "/abs/dog.jpg"]}
    {"input_ids": [...], "pixel_values_videos": [[...], ...], "video_grid_thw": [[t, h, w]]}

``pixel_values`` form (vision-language checkpoints): rows ``[N, C*T*P*P]`` as the transformers
Qwen2-VL processor returns them, one grid row per image in placeholder order; ``input_ids`` hold
each image's placeholder run already expanded (``t*h*w / merge^2`` image_token_ids, one run per
image, runs separated by other tokens, e.g. vision start/end).

``pixel_values_videos`` form (videos, with or without ``pixel_values`` images in the same line):
the rows and grids transformers' video processor of the family returns (``t`` temporal patches
of ``h x w``), and ``input_ids`` laid out as that family's processor lays a video out (Qwen2-VL:
one run of ``t*h*w / merge^2`` video_token_ids; Qwen3-VL and GLM-4V: one run per frame with its
timestamp text between, GLM's inside video start/end and with the image id). The family's own
placeholder rule checks the line (``InputSpec.check_stream``: the position rule the model uses).
Optional beside them, ``"second_per_grid_ts": [s, ...]`` (one positive number per video: the
seconds one temporal patch spans, ``temporal_patch_size / fps``, as Qwen2.5-VL's processor
returns it; its positions read it, the other families' do not); absent, 1 per video.

``images`` form: paths of PNG or JPEG files (relative to the input file's folder unless
absolute). Each image stands in ``input_ids`` as ONE image_token_id, in the order of the list;
score.py processes the file (mpcore.data.images, with the checkpoint's preprocessor_config.json
pixel bounds when it has one) and expands that id to the image's run. The output line then also
carries the expanded ``input_ids``, which its logprobs and entropy align with.

Every error is a ``ValueError`` that names the file, the line and the fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mpcore.data.images import (
    CLIP_MEAN,
    CLIP_STD,
    MAX_PIXELS,
    MIN_PIXELS,
    load_image,
    process_image,
)
from mpcore.data.jsonl import json_lines

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "images", "pixel_values_videos", "video_grid_thw",
              "second_per_grid_ts")


@dataclass(frozen=True)
class InputSpec:
    """What the checkpoint accepts; built from its config before the weights load."""

    vocab_size: int
    """Token ids must lie in ``[0, vocab_size)``."""
    checkpoint: str = "the checkpoint"
    """How messages name the checkpoint (its folder and architecture)."""
    vl: bool = False
    """Whether the checkpoint takes images (a vision-language model)."""
    image_token_id: int = -1
    """Image placeholder id (VL only)."""
    video_token_id: int = -1
    """Video placeholder id (VL only)."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    min_pixels: int = MIN_PIXELS
    """Image processor bounds for the ``images`` form (preprocessor_config.json)."""
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    size_rule: Callable | None = None
    """The family's resize rule for the ``images`` form (None: Qwen2-VL's ``smart_resize``)."""
    check_stream: Callable | None = None
    """The family's own check of one line's placeholders against its grids, ``(input_ids,
    image_grid, video_grid) -> None`` raising ``ValueError`` (lines with videos)."""

    @property
    def patch_dim(self) -> int:
        """Width of one pixel_values row: ``in_channels * temporal_patch_size * patch_size^2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def vl_spec(cfg, folder: str | Path, processing=None,
            check_stream: Callable | None = None) -> InputSpec:
    """The ``InputSpec`` of a VL config (``cfg.text``, ``cfg.vision``, token ids) and its
    checkpoint folder's ``preprocessor_config.json`` (pixel bounds, mean/std) if present;
    ``processing``: the family's image processor (``Family.image_processing``: its resize rule,
    and the bounds and mean/std a folder without that file gets; None: Qwen2-VL's);
    ``check_stream``: the family's placeholder check (``InputSpec.check_stream``)."""
    vision, folder = cfg.vision, Path(folder)
    spec = dict(vocab_size=cfg.text.vocab_size, checkpoint=f"{folder} (vision-language)",
                vl=True, image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                merge_size=vision.spatial_merge_size, in_channels=vision.in_channels,
                size_rule=processing.size_rule if processing else None,
                check_stream=check_stream)
    path = folder / "preprocessor_config.json"
    pre = json.loads(path.read_text()) if path.is_file() else {}
    size = pre.get("size") or {}
    low, high = (processing.min_pixels, processing.max_pixels) if processing else (MIN_PIXELS,
                                                                                   MAX_PIXELS)
    mean, std = (processing.mean, processing.std) if processing else (CLIP_MEAN, CLIP_STD)
    # top-level keys win over "size" (older files say min/max_pixels there), as in transformers
    spec["min_pixels"] = int(pre.get("min_pixels", size.get("shortest_edge", size.get(
        "min_pixels", low))))
    spec["max_pixels"] = int(pre.get("max_pixels", size.get("longest_edge", size.get(
        "max_pixels", high))))
    spec["image_mean"] = tuple(pre.get("image_mean", mean))
    spec["image_std"] = tuple(pre.get("image_std", std))
    for key in ("patch_size", "temporal_patch_size", "merge_size"):
        if key in pre and int(pre[key]) != spec[key]:
            raise ValueError(f"{path}: {key} = {pre[key]} but the model's vision config has "
                             f"{spec[key]}; the processor and the vision tower must agree")
    return InputSpec(**spec)


@dataclass
class ScoreItem:
    """One input line, checked. ``input_ids`` are expanded (one run per image)."""

    input_ids: list[int]
    loss_mask: list[int] | None = None
    pixel_values: torch.Tensor | None = None
    """``[N, patch_dim]`` float32, or None for a text-only line."""
    image_grid_thw: list[tuple[int, int, int]] = field(default_factory=list)
    echo_ids: bool = False
    """The ``images`` form: the output line carries the expanded ``input_ids``."""
    pixel_values_videos: torch.Tensor | None = None
    """``[N, patch_dim]`` float32 rows of the line's videos, or None."""
    video_grid_thw: list[tuple[int, int, int]] = field(default_factory=list)
    second_per_grid: list[float] = field(default_factory=list)
    """Seconds per temporal patch of each video (``second_per_grid_ts``; empty: 1 each)."""

    @property
    def num_images(self) -> int:
        return len(self.image_grid_thw)

    @property
    def num_videos(self) -> int:
        return len(self.video_grid_thw)


def read_input(path: str | Path, spec: InputSpec) -> list[ScoreItem]:
    """Every line of the JSONL file at ``path`` as a ``ScoreItem``, in order. ``ValueError``
    naming ``path:line`` and the fix on the first bad line; a blank line is one (output line i
    belongs to input line i, so a skipped line would shift every later output)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--input {path}: no such file; pass a JSONL file with one "
                         f'{{"input_ids": [...]}} per line')
    items, cache = [], {}
    for _, where, row, problem in json_lines(path, skip_blank=False):
        if problem == "a blank line":
            raise ValueError(f"{where}: a blank line; output line i belongs to input line i, so "
                             f"every line must be one JSON object: delete the line, or write "
                             f'{{"input_ids": []}} for an empty sequence')
        if problem:
            raise ValueError(f"{where}: {problem}; each line must be one JSON object such as "
                             f'{{"input_ids": [1, 2, 3]}}')
        items.append(parse_line(row, spec, where, path.parent, cache))
    return items


def parse_line(row, spec: InputSpec, where: str, folder: Path, cache: dict | None = None
               ) -> ScoreItem:
    """One decoded JSON line as a ``ScoreItem`` (``where`` = ``"file:line"`` for messages;
    ``folder`` resolves relative image paths; ``cache`` maps a path to its processed image)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a line must be a JSON object with input_ids, got "
                         f"{type(row).__name__}")
    ids = token_ids(row.get("input_ids"), "input_ids", spec.vocab_size, where)
    mask = loss_mask(row.get("loss_mask"), len(ids), where)
    given = [k for k in IMAGE_KEYS if k in row]
    if given and not spec.vl:
        raise ValueError(f"{where}: the line has {given}, but {spec.checkpoint} is a text-only "
                         f"decoder and cannot take images; score it with a vision-language "
                         f"checkpoint (Qwen2-VL) or drop the image keys")
    if not spec.vl:
        return ScoreItem(ids, mask)
    if "pixel_values_videos" in row or "video_grid_thw" in row:
        return parse_videos(row, ids, mask, spec, where)
    if "second_per_grid_ts" in row:
        raise ValueError(f"{where}: second_per_grid_ts without videos; it goes with "
                         f"pixel_values_videos and video_grid_thw (one number per video)")
    if spec.video_token_id in ids:
        raise ValueError(f"{where}: input_ids[{ids.index(spec.video_token_id)}] is the video "
                         f"placeholder id {spec.video_token_id} but the line gives no video; add "
                         f"pixel_values_videos with video_grid_thw")
    if "images" in row:
        if "pixel_values" in row or "image_grid_thw" in row:
            raise ValueError(f"{where}: give either images (file paths) or pixel_values with "
                             f"image_grid_thw, not both")
        return expand_images(ids, mask, row["images"], spec, where, folder,
                             {} if cache is None else cache)
    has_px, has_grid = "pixel_values" in row, "image_grid_thw" in row
    if has_px != has_grid:
        missing = "image_grid_thw" if has_px else "pixel_values"
        raise ValueError(f"{where}: {missing} is missing; pixel_values and image_grid_thw "
                         f"come together (one grid row [t, h, w] per image)")
    grid = grid_thw(row.get("image_grid_thw", []), spec, where)
    check_runs(ids, grid, spec, where)
    pixels = pixel_values(row["pixel_values"], grid, spec, where) if has_px else None
    return ScoreItem(ids, mask, pixels, grid)


def parse_videos(row: dict, ids: list[int], mask: list[int] | None, spec: InputSpec,
                 where: str) -> ScoreItem:
    """A line with videos (``pixel_values_videos`` + ``video_grid_thw``, and optionally images
    as ``pixel_values`` + ``image_grid_thw``): rows and grids checked here, the placeholder
    layout by the family's own rule (``spec.check_stream``)."""
    if "images" in row:
        raise ValueError(f"{where}: a line with videos gives its images as pixel_values with "
                         f"image_grid_thw, not as images (file paths)")
    for pixels, grid in (("pixel_values_videos", "video_grid_thw"),
                         ("pixel_values", "image_grid_thw")):
        if (pixels in row) != (grid in row):
            missing = grid if pixels in row else pixels
            raise ValueError(f"{where}: {missing} is missing; {pixels} and {grid} come together "
                             f"(one grid row [t, h, w] per item)")
    videos = grid_thw(row["video_grid_thw"], spec, where, "video_grid_thw")
    video_pixels = pixel_values(row["pixel_values_videos"], videos, spec, where,
                                "pixel_values_videos")
    images = grid_thw(row.get("image_grid_thw", []), spec, where)
    image_pixels = pixel_values(row["pixel_values"], images, spec, where) if images else None
    if spec.check_stream is not None:
        try:
            spec.check_stream(ids, images, videos)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return ScoreItem(ids, mask, image_pixels, images, pixel_values_videos=video_pixels,
                     video_grid_thw=videos, second_per_grid=seconds(row, len(videos), where))


def seconds(row: dict, num_videos: int, where: str) -> list[float]:
    """The line's ``second_per_grid_ts`` (module docstring) as floats, or [] when absent."""
    given = row.get("second_per_grid_ts")
    if given is None:
        return []
    if not (isinstance(given, list) and len(given) == num_videos and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and v > 0 for v in given)):
        raise ValueError(f"{where}: second_per_grid_ts must be a list of {num_videos} positive "
                         f"numbers (one per video: temporal_patch_size / fps), got "
                         f"{json.dumps(given)[:80]}")
    return [float(v) for v in given]


def token_ids(ids, name: str, vocab_size: int, where: str) -> list[int]:
    """``ids`` as a list of ints in ``[0, vocab_size)``; JSON booleans and floats are not ids."""
    if not isinstance(ids, list):
        raise ValueError(f"{where}: {name} must be a list of token ids, got "
                         f"{'nothing' if ids is None else type(ids).__name__}")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            kind = ("a JSON boolean" if isinstance(t, bool) else
                    "a float" if isinstance(t, float) else type(t).__name__)
            raise ValueError(f"{where}: {name}[{i}] = {json.dumps(t)} is {kind}, not a token "
                             f"id; write ids as JSON integers (e.g. 42, not 42.0 or true)")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{where}: {name}[{i}] = {t} is outside the model's vocab [0, "
                             f"{vocab_size}); check the tokenizer matches the checkpoint")
    return ids


def loss_mask(mask, length: int, where: str) -> list[int] | None:
    """``mask`` as a list of 0/1 as long as input_ids, or None."""
    if mask is None:
        return None
    if not isinstance(mask, list) or len(mask) != length:
        got = f"{len(mask)} entries" if isinstance(mask, list) else type(mask).__name__
        raise ValueError(f"{where}: loss_mask must be a list as long as input_ids ({length}), "
                         f"got {got}")
    bad = [m for m in mask if m not in (0, 1) or isinstance(m, float)]
    if bad:
        raise ValueError(f"{where}: loss_mask entries must be 0 or 1 (or true/false), got "
                         f"{json.dumps(bad[0])}")
    return [int(m) for m in mask]


def grid_thw(grid, spec: InputSpec, where: str, name: str = "image_grid_thw"
             ) -> list[tuple[int, int, int]]:
    """``grid`` (the line's ``name``) as int triples; h and w must be multiples of the merge
    size."""
    if not isinstance(grid, list):
        raise ValueError(f"{where}: {name} must be a list of [t, h, w], one per "
                         f"{'video' if name.startswith('video') else 'image'}")
    out = []
    for i, row in enumerate(grid):
        if not (isinstance(row, list) and len(row) == 3 and all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in row)):
            raise ValueError(f"{where}: {name}[{i}] = {json.dumps(row)} must be three "
                             f"positive integers [t, h, w]")
        if row[1] % spec.merge_size or row[2] % spec.merge_size:
            raise ValueError(f"{where}: {name}[{i}] = {row}: h and w must be multiples "
                             f"of the spatial merge size {spec.merge_size}")
        out.append(tuple(row))
    return out


def check_runs(ids: list[int], grid: list[tuple[int, int, int]], spec: InputSpec,
               where: str) -> None:
    """Image i's placeholders are the i-th run of image_token_ids, of ``t*h*w / merge^2``."""
    image, runs, start = spec.image_token_id, [], None
    for i, t in enumerate([*ids, None]):
        if t == image and start is None:
            start = i
        elif t != image and start is not None:
            runs.append((start, i - start))
            start = None
    if runs and not grid:
        raise ValueError(f"{where}: input_ids hold {sum(n for _, n in runs)} image placeholder "
                         f"ids ({image}, first at input_ids[{runs[0][0]}]) but the line gives no "
                         f"image; add pixel_values with image_grid_thw, or images (file paths)")
    merge2 = spec.merge_size ** 2
    for k, ((t, h, w), (at, length)) in enumerate(zip(grid, runs, strict=False)):
        if length != t * h * w // merge2:
            raise ValueError(f"{where}: image {k} (grid [{t}, {h}, {w}]) needs "
                             f"{t * h * w // merge2} placeholder ids (t*h*w / "
                             f"{spec.merge_size}^2), but its run at input_ids[{at}] has {length}; "
                             f"expand each image to its own run of image_token_id {image}")
    if len(runs) != len(grid):  # after the loop: a wrong length is the likelier mistake
        raise ValueError(f"{where}: input_ids have {len(runs)} runs of image placeholder ids "
                         f"({image}) but image_grid_thw has {len(grid)} rows; give one grid "
                         f"row (and one run, between vision start/end tokens) per image")


def pixel_values(rows, grid: list[tuple[int, int, int]], spec: InputSpec, where: str,
                 name: str = "pixel_values") -> torch.Tensor:
    """``rows`` (the line's ``name``) as float32 ``[sum(t*h*w), patch_dim]``, checked against
    the grid and config."""
    grid_name = "video_grid_thw" if name.endswith("videos") else "image_grid_thw"
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ValueError(f"{where}: {name} must be a list of rows (lists of numbers)")
    width = spec.patch_dim
    for i, r in enumerate(rows):
        if len(r) != width:
            raise ValueError(f"{where}: {name}[{i}] has {len(r)} values; this "
                             f"checkpoint's vision tower takes rows of in_channels * "
                             f"temporal_patch_size * patch_size^2 = {spec.in_channels} * "
                             f"{spec.temporal_patch_size} * {spec.patch_size}^2 = {width}")
    patches = sum(t * h * w for t, h, w in grid)
    if len(rows) != patches:
        raise ValueError(f"{where}: {name} has {len(rows)} rows but {grid_name} "
                         f"needs sum(t*h*w) = {patches}; give every item's rows, in order")
    try:
        pixels = torch.tensor(rows, dtype=torch.float32).view(patches, width)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {name} must hold numbers only ({e})") from e
    if not bool(torch.isfinite(pixels).all()):
        raise ValueError(f"{where}: {name} has NaN or infinite values")
    return pixels


def expand_images(ids: list[int], mask: list[int] | None, paths, spec: InputSpec, where: str,
                  folder: Path, cache: dict) -> ScoreItem:
    """The ``images`` form: process each file and expand its single placeholder id."""
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{where}: images must be a list of file paths (strings)")
    slots = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    if len(slots) != len(paths):
        raise ValueError(f"{where}: {len(paths)} image path(s) but {len(slots)} image "
                         f"placeholder ids ({spec.image_token_id}) in input_ids; in the images "
                         f"form each image is ONE placeholder id, which score.py expands")
    for k, (a, b) in enumerate(zip(slots, slots[1:], strict=False)):
        if b == a + 1:
            raise ValueError(f"{where}: images {k} and {k + 1} are adjacent placeholder ids "
                             f"(input_ids[{a}] and [{b}]); put other tokens between images "
                             f"(Qwen2-VL: vision end, vision start) so each keeps its own run")
    rows, grid, out_ids, out_mask, prev = [], [], [], [], 0
    for slot, name in zip(slots, paths, strict=True):
        file = (folder / name) if not Path(name).is_absolute() else Path(name)
        if file not in cache:
            try:
                cache[file] = process_image(
                    load_image(file), patch_size=spec.patch_size,
                    temporal_patch_size=spec.temporal_patch_size, merge_size=spec.merge_size,
                    min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                    mean=spec.image_mean, std=spec.image_std, name=str(file),
                    size_rule=spec.size_rule)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from e
        pixels, thw = cache[file]
        run = math.prod(thw) // spec.merge_size ** 2
        out_ids += ids[prev:slot] + [spec.image_token_id] * run
        if mask is not None:
            out_mask += mask[prev:slot] + [mask[slot]] * run
        rows.append(pixels)
        grid.append(thw)
        prev = slot + 1
    out_ids += ids[prev:]
    if mask is not None:
        out_mask += mask[prev:]
    return ScoreItem(out_ids, out_mask if mask is not None else None,
                     (rows[0] if len(rows) == 1 else torch.cat(rows)) if rows else None, grid,
                     echo_ids=True)
