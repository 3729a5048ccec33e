"""A prepared image-text dataset: one folder, written by :func:`prepare_vl_dataset`, read by
:class:`VLDataset`.

Folder layout (sample ``i`` = manifest sample ``i``, in manifest order; ``V`` the text vocab):

    meta.json          format "mpcore.vl_dataset", version, counts, image settings (the
                       processor's arguments, mean/std, and the model family whose processor
                       they follow: ``image_settings.family``), the tokenizer json, the manifest
                       path, fingerprint (sha256 of settings (family included), tokenizer,
                       every image's bytes, manifest)
    tokenizer.json     the VLTokenizer (mpcore/data/vl_tokenizer.py), with tokenizer.model
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

Streaming: the manifest is read line by line twice (check, then write); each image is decoded,
processed and appended to ``pixels.bin`` on its own, so a dataset larger than RAM prepares in
the memory of one image. Atomic: everything is written into a hidden temporary folder beside
``out_dir`` and renamed into place at the end; a failed or killed run leaves no dataset.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mpcore.atomic import fsync_dir
from mpcore.data.images import load_image, num_placeholders, process_image
from mpcore.data.indexed import IndexedDataset, IndexedWriter
from mpcore.data.vl_manifest import (
    ImageSettings,
    ManifestSample,
    VLProgress,
    iter_manifest,
    scan_manifest,
)
from mpcore.data.vl_tokenizer import VLTokenizer, as_vl_tokenizer

FORMAT, VERSION = "mpcore.vl_dataset", 1
GRID_BOUND = 1 << 16  # grid sides are patches: far below this for any real image
PREPARE = ("python launch/prepare_vl_data.py --family F --manifest M.jsonl --tokenizer T "
           "--out DIR")


class VLSample(NamedTuple):
    """One prepared sample (numpy): ``input_ids`` int64 [n], ``loss_mask`` bool [n],
    ``pixel_values`` float32 [N, patch_dim], ``grid_thw`` int64 [I, 3]."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    pixel_values: np.ndarray
    grid_thw: np.ndarray


def _encode(sample: ManifestSample, tok: VLTokenizer, settings: ImageSettings, where: str):
    """``(ids, mask, [rows per image], [grid per image])`` of one manifest sample."""
    ids: list[int] = []
    mask: list[int] = []
    rows, grids = [], []
    for kind, value, target in sample.parts:
        if kind == "text":
            enc = tok.encode(value)
            ids += enc
            mask += [int(target)] * len(enc)
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
    return ids, mask, rows, grids


def _fingerprint_extra(settings: ImageSettings, tok: VLTokenizer) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "settings": settings.to_json(),
        "tokenizer": tok.to_json(),
    }


def dataset_fingerprint(
    manifest: str | Path, tokenizer: str | Path | VLTokenizer, settings: ImageSettings | None = None
) -> str:
    """The ``fingerprint`` that :func:`prepare_vl_dataset` would write into meta.json, from a
    check of the manifest (no image is decoded): compare it to decide whether to prepare."""
    settings = settings or ImageSettings()
    return scan_manifest(
        manifest, settings, _fingerprint_extra(settings, as_vl_tokenizer(tokenizer)), progress=False
    ).fingerprint


# The files a run reads, in the order a content fingerprint covers them (meta.json apart).
CONTENT_FILES = ("tokens.bin", "tokens.idx", "mask.bin", "grids.bin", "pixels.bin",
                 "row_offsets.i64", "tokenizer.json")


def folder_fingerprint(folder: str | Path, file_fingerprint) -> str:
    """What a run trains on in prepared folder ``folder``: the fingerprint meta.json recorded
    when it was prepared (settings, tokenizer, every image's bytes, the manifest) and
    ``file_fingerprint(path)`` of each of :data:`CONTENT_FILES` (so files replaced without
    their meta.json differ too). A missing or foreign folder raises ``ValueError``."""
    meta = VLDataset(folder).meta
    parts = [f"prepared {str(meta.get('fingerprint'))[:16]}"]
    parts += [f"{name} {file_fingerprint(Path(folder) / name)}" for name in CONTENT_FILES]
    return "; ".join(parts)


def prepare_vl_dataset(
    manifest: str | Path,
    out_dir: str | Path,
    tokenizer: str | Path | VLTokenizer,
    settings: ImageSettings | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Check ``manifest`` (mpcore/data/vl_manifest.py), then write the dataset folder
    ``out_dir`` (layout in the module docstring) atomically; returns ``out_dir``.

    ``tokenizer``: a SentencePiece ``.model``, a ``tokenizer.json`` or a VLTokenizer.
    ``settings``: the image processing (default :class:`ImageSettings`). Every problem with
    the manifest raises ``ValueError`` (``manifest:line: ...``) before anything is written.
    """
    manifest, out_dir = Path(manifest), Path(out_dir)
    settings = settings or ImageSettings()
    tok = as_vl_tokenizer(tokenizer)
    if out_dir.exists() and not overwrite:
        raise ValueError(
            f"{out_dir} already exists; pass overwrite=True (--overwrite) to "
            f"replace it, or choose another --out"
        )
    summary = scan_manifest(manifest, settings, _fingerprint_extra(settings, tok), progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        counts = _write(manifest, tmp, tok, settings, progress)
        if (counts["num_samples"], counts["num_images"]) != (
            summary.num_samples,
            summary.num_images,
        ):
            raise ValueError(f"{manifest} changed while it was being prepared; run again")
        tok.save(tmp)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            **counts,
            "patch_dim": settings.patch_dim,
            "pixel_dtype": settings.pixel_dtype,
            "image_settings": settings.to_json(),
            "tokenizer": tok.to_json(),
            "manifest": str(manifest.resolve()),
            "fingerprint": summary.fingerprint,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        _sync_folder(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write(
    manifest: Path, folder: Path, tok: VLTokenizer, settings: ImageSettings, progress: bool
) -> dict[str, int]:
    dtype = np.dtype(settings.pixel_dtype).newbyteorder("<")
    meter = VLProgress(f"preparing {manifest}") if progress else None
    samples = images = tokens = targets = image_tokens = rows = 0
    with (
        IndexedWriter(folder / "tokens", tok.vocab_size, progress=False) as ids_w,
        IndexedWriter(folder / "mask", 2, progress=False) as mask_w,
        IndexedWriter(folder / "grids", GRID_BOUND, progress=False) as grid_w,
        open(folder / "pixels.bin", "wb") as pix,
        open(folder / "row_offsets.i64", "wb") as offsets,
        open(folder / "lines.i64", "wb") as lines,
    ):
        offsets.write(np.zeros(1, "<i8").tobytes())
        for sample in iter_manifest(manifest):
            ids, mask, pixel_rows, grids = _encode(
                sample, tok, settings, f"{manifest}:{sample.line}"
            )
            ids_w.add(ids)
            mask_w.add(mask)
            grid_w.add(np.asarray(grids, dtype=np.int64).reshape(-1))
            for r in pixel_rows:
                pix.write(r.astype(dtype, copy=False).tobytes())
                rows += len(r)
            offsets.write(np.array([rows], "<i8").tobytes())
            lines.write(np.array([sample.line], "<i8").tobytes())
            samples += 1
            images += len(grids)
            tokens += len(ids)
            targets += sum(mask)
            image_tokens += sum(num_placeholders(g, settings.merge_size) for g in grids)
            if meter:
                meter.update(samples, tokens, images)
        for f in (pix, offsets, lines):
            f.flush()
            os.fsync(f.fileno())
    if meter:
        meter.update(samples, tokens, images, force=True)
    return {
        "num_samples": samples,
        "num_images": images,
        "num_tokens": tokens,
        "num_target_tokens": targets,
        "num_image_tokens": image_tokens,
        "num_pixel_rows": rows,
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


class VLDataset:
    """Read-only, memory-mapped view of a folder written by :func:`prepare_vl_dataset`.

    ``len(ds)`` samples; ``ds[i]`` is a :class:`VLSample` (pixels read from the memory map and
    returned as float32). ``lengths`` int64 [n]: tokens per sample. ``tokenizer`` (VLTokenizer),
    ``settings`` (ImageSettings; ``settings.family``: the model family whose image processor
    the data follows), ``patch_dim``, ``meta`` (meta.json). A missing, foreign or truncated
    file raises ``ValueError`` naming it.
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
        if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
            raise ValueError(
                f"{meta_path} is not {FORMAT} version {VERSION}; prepare the "
                f"dataset again with this mpcore ({PREPARE})"
            )
        m = self.meta
        self.num_samples, self.patch_dim = m["num_samples"], m["patch_dim"]
        self.settings = ImageSettings.from_json(m["image_settings"])
        self.tokenizer = VLTokenizer.load(self.folder / "tokenizer.json")
        self.tokens = IndexedDataset(self.folder / "tokens")
        self.mask = IndexedDataset(self.folder / "mask")
        self.grids = IndexedDataset(self.folder / "grids")
        for part in (self.tokens, self.mask, self.grids):
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
        n, rows = self.num_samples, m["num_pixel_rows"]
        dtype = np.dtype(m["pixel_dtype"]).newbyteorder("<")
        self.pixels = _raw(self.folder / "pixels.bin", dtype, (rows, self.patch_dim))
        self.row_offsets = _raw(self.folder / "row_offsets.i64", "<i8", (n + 1,))
        self.lines = _raw(self.folder / "lines.i64", "<i8", (n,))
        if n and int(self.row_offsets[-1]) != rows:
            raise ValueError(
                f"{self.folder / 'row_offsets.i64'} does not span pixels.bin; "
                f"prepare the dataset again ({PREPARE})"
            )
        self.lengths = self.tokens.doc_lengths

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> VLSample:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        lo, hi = int(self.row_offsets[i]), int(self.row_offsets[i + 1])
        return VLSample(
            np.asarray(self.tokens[i], dtype=np.int64),
            np.asarray(self.mask[i]) != 0,
            np.asarray(self.pixels[lo:hi], dtype=np.float32),
            np.asarray(self.grids[i], dtype=np.int64).reshape(-1, 3),
        )

    def describe(self, i: int) -> str:
        """``"sample i (manifest:line)"``, for messages."""
        return f"sample {i} ({self.meta['manifest']}:{int(self.lines[i])})"
