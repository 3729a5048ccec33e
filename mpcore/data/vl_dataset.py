"""A prepared image-text dataset: one folder, written by :func:`prepare_vl_dataset`, read by
:class:`VLDataset`.

Folder layout (sample ``i`` = manifest sample ``i``, in manifest order; ``V`` the text vocab):

    meta.json          format "mpcore.vl_dataset", version, counts, image settings (the
                       processor's arguments, mean/std, the patch geometry ``patch_size``,
                       ``temporal_patch_size``, ``merge_size``, and the model family whose
                       processor they follow: ``image_settings.family``), video settings
                       (``mpcore.data.videos``; null when prepared without), the tokenizer
                       json, the manifest path, fingerprint (sha256 of settings (family
                       included), tokenizer, every image's and every video frame's bytes,
                       manifest)
    tokenizer.json     the VLTokenizer (mpcore/data/vl_tokenizer.py), with tokenizer.model;
                       or, for VL conversations prepared with a released checkpoint's folder
                       (mpcore/data/vl_chat.py), the release's own tokenizer files, copied
                       (meta.json's ``tokenizer``: format "hf_release", fingerprint, vision
                       ids; ``ReleaseVLTokenizer``, mpcore/data/vl_release.py)
    tokens.bin/.idx    indexed dataset (mpcore/data/indexed.py), vocab V + 4: document i is
                       sample i's ids, placeholder runs expanded and the final EOS included
    mask.bin/.idx      indexed dataset, vocab 2: document i is sample i's loss mask (1 = the
                       token is a target), same length as its ids
    grids.bin/.idx     indexed dataset of ints (< 65536): document i is sample i's image grids
                       flattened (t, h, w, t, h, w, ...), images in placeholder order
    pixels.bin         raw little-endian rows [num_pixel_rows, patch_dim], float32 (or float16,
                       meta "pixel_dtype"): process_image's rows of every image, back to back
    row_offsets.i64    int64 [num_samples + 1]: sample i's rows are row_offsets[i:i+2]
    lines.i64          int64 [num_samples]: sample i's manifest line (for error messages)
    video_grids.bin/.idx, video_pixels.bin, video_row_offsets.i64
                       the same for the samples' videos (grids (t, h, w) per video, rows of
                       ``process_video``, same patch_dim), videos in stream order
    video_seconds.f64  float64 [num_videos]: each video's seconds per temporal patch,
                       ``temporal_patch_size / fps`` (24 fps when none was given), which
                       Qwen2.5-VL's positions read (``second_per_grid``); absent in folders
                       prepared before it, whose videos then read as 1 s per patch

A video's tokens are its family's layout (``VideoProcessing.layout``), text parts encoded like
any text; GLM-4V's layout writes two ids after the tokenizer's (its video start / end), so its
``tokens`` vocabulary is ``V + 6``. Version 1 folders (before videos) read as having none.

Streaming: the manifest is read line by line twice (check, then write); each image is decoded,
processed and appended to ``pixels.bin`` on its own, so a dataset larger than RAM prepares in
the memory of one image. Atomic: everything is written into a hidden temporary folder beside
``out_dir`` and renamed into place at the end; a failed or killed run leaves no dataset.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mpcore.atomic import fsync_dir
from mpcore.data.images import load_image, num_placeholders, process_image
from mpcore.data.indexed import IndexedDataset, IndexedWriter
from mpcore.data.videos import VideoSettings, process_video, seconds_per_grid, video_parts
from mpcore.data.vl_manifest import (
    ImageSettings,
    ManifestSample,
    VLProgress,
    iter_manifest,
    scan_manifest,
)
from mpcore.data.vl_release import FORMAT as RELEASE_FORMAT
from mpcore.data.vl_release import ReleaseVLTokenizer
from mpcore.data.vl_tokenizer import VLTokenizer, as_vl_tokenizer

FORMAT, VERSION = "mpcore.vl_dataset", 2
READABLE = (1, 2)  # version 1: no videos
GRID_BOUND = 1 << 16  # grid sides are patches: far below this for any real image
PREPARE = ("python launch/prepare_vl_data.py --family F --manifest M.jsonl --tokenizer T "
           "--out DIR")


class VLSample(NamedTuple):
    """One prepared sample (numpy): ``input_ids`` int64 [n], ``loss_mask`` bool [n],
    ``pixel_values`` float32 [N, patch_dim], ``grid_thw`` int64 [I, 3] (images), and its
    videos' ``pixel_values_videos`` float32 [M, patch_dim], ``video_grid_thw`` int64 [V, 3]
    (None for a sample built without them), ``video_seconds`` float64 [V] (seconds per
    temporal patch of each video; None: 1 each)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    pixel_values: np.ndarray
    grid_thw: np.ndarray
    pixel_values_videos: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None
    video_seconds: np.ndarray | None = None


class EncodedSample(NamedTuple):
    """One sample's ids, mask, rows and grids (images, then videos), and each video's seconds
    per temporal patch, as written."""

    ids: list[int]
    mask: list[int]
    rows: list[np.ndarray]
    grids: list[tuple[int, int, int]]
    video_rows: list[np.ndarray]
    video_grids: list[tuple[int, int, int]]
    video_seconds: tuple[float, ...] = ()


def _encode_video(item, tok: VLTokenizer, settings: ImageSettings, video: VideoSettings | None,
                  where: str):
    """``(ids, rows, grid)`` of one video item: its frames processed, its layout's texts
    encoded."""
    if video is None:
        raise ValueError(f"{where}: a video, but no video settings were given")
    frames = [load_image(frame) for frame in item.frames]
    try:
        pixels, grid = process_video(frames, settings, video, name=str(item.frames[0]))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    ids: list[int] = []
    for part in video_parts(grid, len(frames), item.fps, settings, video, tok.token_ids()):
        ids += tok.encode(part) if isinstance(part, str) else [part]
    return ids, pixels.numpy(), grid


def _encode(sample: ManifestSample, tok: VLTokenizer, settings: ImageSettings,
            video: VideoSettings | None, where: str) -> EncodedSample:
    """The ids, mask, rows and grids (images, then videos) of one manifest sample."""
    ids: list[int] = []
    mask: list[int] = []
    rows, grids, video_rows, video_grids, seconds = [], [], [], [], []
    for kind, value, target in sample.parts:
        if kind == "text":
            enc = tok.encode(value)
            ids += enc
            mask += [int(target)] * len(enc)
            continue
        if kind == "video":
            enc, pixels, grid = _encode_video(value, tok, settings, video, where)
            ids += enc
            mask += [0] * len(enc)  # timestamps included: the processor's, not targets
            video_rows.append(pixels)
            video_grids.append(grid)
            seconds.append(seconds_per_grid(value.fps, settings.temporal_patch_size))
            continue
        try:
            pixels, grid = process_image(
                load_image(value),
                patch_size=settings.patch_size,
                temporal_patch_size=settings.temporal_patch_size,
                merge_size=settings.merge_size,
                min_pixels=settings.min_pixels,
                max_pixels=sample.max_pixels or settings.max_pixels,
                mean=settings.mean,
                std=settings.std,
                resize=settings.resize,
                name=str(value),
                size_rule=settings.size_rule,
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        n = num_placeholders(grid, settings.merge_size)
        ids += [tok.vision_start_id, *[tok.image_pad_id] * n, tok.vision_end_id]
        mask += [0] * (n + 2)
        rows.append(pixels.numpy())
        grids.append(grid)
    ids.append(tok.eos_id)
    mask.append(1)
    return EncodedSample(ids, mask, rows, grids, video_rows, video_grids, tuple(seconds))


def _fingerprint_extra(settings: ImageSettings, tok: VLTokenizer,
                       video: VideoSettings | None = None) -> dict:
    extra = {
        "format": FORMAT,
        "version": VERSION,
        "settings": settings.to_json(),
        "tokenizer": tok.to_json(),
    }
    if video is not None:
        extra["video_settings"] = video.to_json()
    return extra


def dataset_fingerprint(
    manifest: str | Path, tokenizer: str | Path | VLTokenizer,
    settings: ImageSettings | None = None, video: VideoSettings | None = None,
) -> str:
    """The ``fingerprint`` that :func:`prepare_vl_dataset` would write into meta.json, from a
    check of the manifest (no image is decoded): compare it to decide whether to prepare."""
    settings = settings or ImageSettings()
    extra = _fingerprint_extra(settings, as_vl_tokenizer(tokenizer), video)
    return scan_manifest(manifest, settings, extra, progress=False, video=video).fingerprint


# The files a run reads, in the order a content fingerprint covers them (meta.json apart);
# VIDEO_FILES too in a folder of version 2.
CONTENT_FILES = ("tokens.bin", "tokens.idx", "mask.bin", "grids.bin", "pixels.bin",
                 "row_offsets.i64", "tokenizer.json")
VIDEO_FILES = ("video_grids.bin", "video_pixels.bin", "video_row_offsets.i64")
SECONDS_FILE = "video_seconds.f64"  # in folders prepared since videos carry their time


def folder_fingerprint(folder: str | Path, file_fingerprint) -> str:
    """What a run trains on in prepared folder ``folder``: the fingerprint meta.json recorded
    when it was prepared (settings, tokenizer, every image's bytes, the manifest) and
    ``file_fingerprint(path)`` of each of :data:`CONTENT_FILES` (so files replaced without
    their meta.json differ too). A missing or foreign folder raises ``ValueError``."""
    meta = VLDataset(folder).meta
    names = CONTENT_FILES + (VIDEO_FILES if meta["version"] >= 2 else ())
    names += (SECONDS_FILE,) if (Path(folder) / SECONDS_FILE).is_file() else ()
    parts = [f"prepared {str(meta.get('fingerprint'))[:16]}"]
    parts += [f"{name} {file_fingerprint(Path(folder) / name)}" for name in names]
    return "; ".join(parts)


def prepare_vl_dataset(
    manifest: str | Path,
    out_dir: str | Path,
    tokenizer: str | Path | VLTokenizer,
    settings: ImageSettings | None = None,
    overwrite: bool = False,
    progress: bool = True,
    video: VideoSettings | None = None,
) -> Path:
    """Check ``manifest`` (mpcore/data/vl_manifest.py), then write the dataset folder
    ``out_dir`` (layout in the module docstring) atomically; returns ``out_dir``.

    ``tokenizer``: a SentencePiece ``.model``, a ``tokenizer.json`` or a VLTokenizer.
    ``settings``: the image processing (default :class:`ImageSettings`); ``video``: the
    family's video processing (``VideoSettings.for_family``; None: a manifest with videos is
    refused). Every problem with the manifest raises ``ValueError`` (``manifest:line: ...``)
    before anything is written. (Conversations with a released tokenizer:
    ``mpcore.data.vl_chat.prepare_vl_conversations``.)
    """
    manifest, out_dir = Path(manifest), Path(out_dir)
    settings = settings or ImageSettings()
    tok = as_vl_tokenizer(tokenizer)
    check_out_dir(out_dir, overwrite)
    if video is not None and video.family != settings.family:
        raise ValueError(f"video settings of the {video.family} family with image settings of "
                         f"the {settings.family} family; take both from one family")
    summary = scan_manifest(manifest, settings, _fingerprint_extra(settings, tok, video),
                            progress, video)
    samples = ((s.line, _encode(s, tok, settings, video, f"{manifest}:{s.line}"))
               for s in iter_manifest(manifest))
    return write_vl_dataset(manifest, out_dir, tok, settings, video, summary, samples, progress)


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """``ValueError`` when ``out_dir`` exists and ``overwrite`` is off."""
    if out_dir.exists() and not overwrite:
        raise ValueError(
            f"{out_dir} already exists; pass overwrite=True (--overwrite) to "
            f"replace it, or choose another --out"
        )


def write_vl_dataset(source: Path, out_dir: Path, tok, settings: ImageSettings,
                     video: VideoSettings | None, summary, samples, progress: bool = True) -> Path:
    """Write ``samples`` (``(line, EncodedSample)`` in order; ``summary``: the checked
    source's counts and fingerprint) as the folder ``out_dir``, atomically (a hidden temporary
    folder renamed into place; any error leaves nothing at ``out_dir``); returns it.
    ``tok``: a VLTokenizer or a ``ReleaseVLTokenizer`` (its ``save`` and ``to_json``)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        counts = _write(source, tmp, samples, tok, settings, video, progress)
        if (counts["num_samples"], counts["num_images"], counts["num_videos"]) != (
            summary.num_samples,
            summary.num_images,
            summary.num_videos,
        ):
            raise ValueError(f"{source} changed while it was being prepared; run again")
        tok.save(tmp)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            **counts,
            "patch_dim": settings.patch_dim,
            "pixel_dtype": settings.pixel_dtype,
            "image_settings": settings.to_json(),
            "video_settings": None if video is None else video.to_json(),
            "tokenizer": tok.to_json(),
            "manifest": str(source.resolve()),
            "fingerprint": summary.fingerprint,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        _sync_folder(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


class _Rows:
    """One kind of vision input being written: grids (indexed, one document per sample), raw
    rows back to back, and int64 row offsets per sample."""

    def __init__(self, folder: Path, prefix: str, dtype: np.dtype):
        self.grids = IndexedWriter(folder / f"{prefix}grids", GRID_BOUND, progress=False)
        self.pixels = open(folder / f"{prefix}pixels.bin", "wb")
        self.offsets = open(folder / f"{prefix}row_offsets.i64", "wb")
        self.offsets.write(np.zeros(1, "<i8").tobytes())
        self.dtype, self.num_rows, self.num_items = dtype, 0, 0

    def add(self, rows: list[np.ndarray], grids: list[tuple[int, int, int]]) -> None:
        """One sample's items."""
        self.grids.add(np.asarray(grids, dtype=np.int64).reshape(-1))
        for r in rows:
            self.pixels.write(r.astype(self.dtype, copy=False).tobytes())
            self.num_rows += len(r)
        self.offsets.write(np.array([self.num_rows], "<i8").tobytes())
        self.num_items += len(grids)

    def close(self, ok: bool) -> None:
        for f in (self.pixels, self.offsets):
            if ok:
                f.flush()
                os.fsync(f.fileno())
            f.close()
        if ok:
            self.grids.close()
        else:
            self.grids.abort()


def _write(manifest: Path, folder: Path, encoded, tok, settings: ImageSettings,
           video: VideoSettings | None, progress: bool) -> dict[str, int]:
    dtype = np.dtype(settings.pixel_dtype).newbyteorder("<")
    meter = VLProgress(f"preparing {manifest}") if progress else None
    samples = tokens = targets = image_tokens = video_tokens = 0
    vocab = tok.vocab_size + (video.extra_ids if video is not None else 0)
    parts = [_Rows(folder, "", dtype), _Rows(folder, "video_", dtype)]
    ok = False
    try:
        with (
            IndexedWriter(folder / "tokens", vocab, progress=False) as ids_w,
            IndexedWriter(folder / "mask", 2, progress=False) as mask_w,
            open(folder / "lines.i64", "wb") as lines,
            open(folder / SECONDS_FILE, "wb") as seconds,
        ):
            for line, enc in encoded:
                assert len(enc.video_seconds) == len(enc.video_grids), line
                seconds.write(np.asarray(enc.video_seconds, "<f8").tobytes())
                ids_w.add(enc.ids)
                mask_w.add(enc.mask)
                parts[0].add(enc.rows, enc.grids)
                parts[1].add(enc.video_rows, enc.video_grids)
                lines.write(np.array([line], "<i8").tobytes())
                samples += 1
                tokens += len(enc.ids)
                targets += sum(enc.mask)
                image_tokens += sum(num_placeholders(g, settings.merge_size) for g in enc.grids)
                video_tokens += sum(num_placeholders(g, settings.merge_size)
                                    for g in enc.video_grids)
                if meter:
                    meter.update(samples, tokens, parts[0].num_items)
            for f in (lines, seconds):
                f.flush()
                os.fsync(f.fileno())
        ok = True
    finally:
        for part in parts:
            part.close(ok)
    if meter:
        meter.update(samples, tokens, parts[0].num_items, force=True)
    return {
        "num_samples": samples,
        "num_images": parts[0].num_items,
        "num_videos": parts[1].num_items,
        "num_tokens": tokens,
        "num_target_tokens": targets,
        "num_image_tokens": image_tokens,
        "num_video_tokens": video_tokens,
        "num_pixel_rows": parts[0].num_rows,
        "num_video_rows": parts[1].num_rows,
    }


def _sync_folder(folder: Path) -> None:
    """fsync every file of ``folder`` and the folder itself: the rename that publishes it must
    not reach the disk before its contents (a power cut would leave a dataset that looks
    whole)."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``; an existing ``out_dir`` is moved aside first and removed
    after, so there is always either the old or the new complete dataset (or, killed between
    the two renames, none at ``out_dir`` and the old one in ``.<name>.old-<pid>``)."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        out_dir.rename(old)
    tmp.rename(out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _raw(path: Path, dtype, shape: tuple[int, ...]) -> np.ndarray:
    want = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not path.is_file() or path.stat().st_size != want:
        size = path.stat().st_size if path.is_file() else "no"
        raise ValueError(
            f"{path}: {size} bytes, meta.json says {want}; the dataset is "
            f"incomplete or corrupt: prepare it again ({PREPARE})"
        )
    if want == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype, "r", shape=shape)


def pixel_geometry(meta: dict) -> dict[str, int]:
    """``{"patch_size", "temporal_patch_size", "merge_size", "patch_dim"}`` of a prepared
    folder's pixel rows, from its meta.json: the image settings' fields, or (a folder whose
    settings predate them) inferred from the row width ``patch_dim = 3 * T * P^2`` with the
    temporal patch 2 and merge 2 that every processor here used then."""
    settings, dim = meta.get("image_settings") or {}, int(meta["patch_dim"])
    if "patch_size" in settings:
        return {"patch_size": int(settings["patch_size"]),
                "temporal_patch_size": int(settings.get("temporal_patch_size", 2)),
                "merge_size": int(settings.get("merge_size", 2)), "patch_dim": dim}
    patch = math.isqrt(dim // 6)
    if 6 * patch * patch != dim:
        raise ValueError(f"pixel rows of {dim} values are not 3 * 2 * P^2 for any patch side "
                         f"P, and meta.json does not say its patch size; prepare the dataset "
                         f"again ({PREPARE})")
    return {"patch_size": patch, "temporal_patch_size": 2, "merge_size": 2, "patch_dim": dim}


class _RowsView:
    """The memory-mapped grids, rows and offsets of one kind of vision input."""

    def __init__(self, folder: Path, prefix: str, meta_rows: int, num_samples: int,
                 patch_dim: int, dtype: np.dtype):
        self.grids = IndexedDataset(folder / f"{prefix}grids")
        if len(self.grids) != num_samples:
            raise ValueError(f"{self.grids.idx_path} holds {len(self.grids)} samples, meta.json "
                             f"says {num_samples}; prepare the dataset again ({PREPARE})")
        self.pixels = _raw(folder / f"{prefix}pixels.bin", dtype, (meta_rows, patch_dim))
        offsets = folder / f"{prefix}row_offsets.i64"
        self.offsets = _raw(offsets, "<i8", (num_samples + 1,))
        if num_samples and int(self.offsets[-1]) != meta_rows:
            raise ValueError(f"{offsets} does not span {prefix}pixels.bin; prepare the dataset "
                             f"again ({PREPARE})")

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return (np.asarray(self.pixels[lo:hi], dtype=np.float32),
                np.asarray(self.grids[i], dtype=np.int64).reshape(-1, 3))


class VLDataset:
    """Read-only, memory-mapped view of a folder written by :func:`prepare_vl_dataset`.

    ``len(ds)`` samples; ``ds[i]`` is a :class:`VLSample` (pixels read from the memory map and
    returned as float32; a version 1 folder's videos are empty). ``lengths`` int64 [n]: tokens
    per sample. ``tokenizer`` (VLTokenizer, or ReleaseVLTokenizer for release-prepared
    conversations), ``settings`` (ImageSettings; ``settings.family``:
    the model family whose image processor the data follows), ``video_settings``
    (VideoSettings or None), ``patch_dim``, ``geometry`` (:func:`pixel_geometry`), ``meta``
    (meta.json). A missing, foreign or truncated file raises ``ValueError`` naming it.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        try:
            self.meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{meta_path}: not a prepared VL dataset ({type(e).__name__}); "
                f"create it with: {PREPARE}"
            ) from None
        if self.meta.get("format") != FORMAT or self.meta.get("version") not in READABLE:
            raise ValueError(
                f"{meta_path} is not {FORMAT} version {VERSION}; prepare the "
                f"dataset again with this mpcore ({PREPARE})"
            )
        m = self.meta
        self.num_samples, self.patch_dim = m["num_samples"], m["patch_dim"]
        self.settings = ImageSettings.from_json(m["image_settings"])
        video = m.get("video_settings")
        self.video_settings = VideoSettings.from_json(video) if video else None
        self.geometry = pixel_geometry(m)
        record = m.get("tokenizer") or {}
        if record.get("format") == RELEASE_FORMAT:
            self.tokenizer = ReleaseVLTokenizer.load(self.folder, record)
        else:
            self.tokenizer = VLTokenizer.load(self.folder / "tokenizer.json")
        self.tokens = IndexedDataset(self.folder / "tokens")
        self.mask = IndexedDataset(self.folder / "mask")
        for part in (self.tokens, self.mask):
            if len(part) != self.num_samples:
                raise ValueError(
                    f"{part.idx_path} holds {len(part)} samples, meta.json says "
                    f"{self.num_samples}; prepare the dataset again ({PREPARE})"
                )
        if not np.array_equal(self.tokens.offsets, self.mask.offsets):
            raise ValueError(
                f"{self.mask.idx_path} does not match the token file; prepare the "
                f"dataset again ({PREPARE})"
            )
        n = self.num_samples
        dtype = np.dtype(m["pixel_dtype"]).newbyteorder("<")
        self.images = _RowsView(self.folder, "", m["num_pixel_rows"], n, self.patch_dim, dtype)
        self.videos = None
        if m["version"] >= 2:
            self.videos = _RowsView(self.folder, "video_", m["num_video_rows"], n,
                                    self.patch_dim, dtype)
        self.seconds, self.first_video = None, None
        if self.videos is not None and (self.folder / SECONDS_FILE).is_file():
            self.seconds = _raw(self.folder / SECONDS_FILE, "<f8", (m["num_videos"],))
            per_sample = np.asarray(self.videos.grids.doc_lengths, np.int64) // 3
            self.first_video = np.concatenate([[0], np.cumsum(per_sample)])
        self.pixels, self.grids = self.images.pixels, self.images.grids
        self.row_offsets = self.images.offsets
        self.lines = _raw(self.folder / "lines.i64", "<i8", (n,))
        self.lengths = self.tokens.doc_lengths

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> VLSample:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        pixels, grids = self.images.sample(i)
        if self.videos is None:
            videos, video_grids = np.zeros((0, self.patch_dim), np.float32), np.zeros((0, 3),
                                                                                      np.int64)
        else:
            videos, video_grids = self.videos.sample(i)
        seconds = None
        if self.seconds is not None:
            lo, hi = int(self.first_video[i]), int(self.first_video[i + 1])
            seconds = np.asarray(self.seconds[lo:hi], dtype=np.float64)
        return VLSample(np.asarray(self.tokens[i], dtype=np.int64), np.asarray(self.mask[i]) != 0,
                        pixels, grids, videos, video_grids, seconds)

    def describe(self, i: int) -> str:
        """``"sample i (manifest:line)"``, for messages."""
        return f"sample {i} ({self.meta['manifest']}:{int(self.lines[i])})"
