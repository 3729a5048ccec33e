"""The default image-text dataset that ships with mpcore, prepared on first use.

Source: ``launch/data/images/captions.jsonl`` (15 public-domain / CC0 images from scikit-image's
sample data, one caption each; see launch/data/images/README.md). Tokenizer: the default text
corpus's SentencePiece model (``prepare_default``, vocab ``V``) with the four VL ids appended
(mpcore/data/vl_tokenizer.py), so the model's vocabulary is ``V + 4`` and the default text
corpus (same model) blends in id for id.

Image settings for a tiny CPU model (:func:`default_settings`): the run's family's own image
processing (``ImageSettings.for_family``: its patch size, resize rule, mean/std), but small
images: ``min_pixels = 4 * f^2`` and ``max_pixels = 32 * f^2`` with ``f = patch_size *
merge_size``. For Qwen2-VL (:data:`DEFAULT_SETTINGS`: patch 14, temporal patch 2, merge 2, so
rows of 1176) that is 4 to 32 merged placeholder tokens per image (the shipped set: 16 to 30, 25
on average; samples of 47 to 78 tokens); Qwen3-VL's patch 16 gives the same counts, GLM-4V's
rule (it counts an image's 2 frames against the bounds) half as many. Pass other settings for a
larger model.

Into ``data_dir``: ``default_vl_v<V>_<settings hash>/`` (a dataset folder, see vl_dataset.py;
the hash covers the family, so each family has its own),
next to the default corpus files. A later call whose fingerprint (every image's bytes, the
captions, the tokenizer, the settings) matches meta.json reuses it; ranks that call it at the
same time (torchrun) serialise on a file lock in ``data_dir``. About a second on 2 CPU cores.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import time
from pathlib import Path
from typing import NamedTuple

from mpcore.data.corpus import SHIPPED_DATA, prepare_default
from mpcore.data.vl_dataset import VLDataset, dataset_fingerprint, prepare_vl_dataset
from mpcore.data.vl_manifest import ImageSettings

DEFAULT_MANIFEST = SHIPPED_DATA / "images" / "captions.jsonl"
DEFAULT_SETTINGS = ImageSettings(min_pixels=4 * 28 * 28, max_pixels=32 * 28 * 28)
"""Qwen2-VL's :func:`default_settings`."""


def default_settings(family=None) -> ImageSettings:
    """The shipped set's image settings for ``family`` (an image-text ``mpcore.models.Family``; None:
    Qwen2-VL's, :data:`DEFAULT_SETTINGS`): its processor with the small bounds of the module
    docstring."""
    if family is None:
        return DEFAULT_SETTINGS
    proc = family.image_processing
    factor = 0 if proc is None else proc.patch_size * proc.merge_size
    return ImageSettings.for_family(family, min_pixels=4 * factor ** 2,
                                    max_pixels=32 * factor ** 2)


class VLDefault(NamedTuple):
    """Paths of the default data: the VL dataset folder, its ``tokenizer.json``, and the
    default text corpus's indexed prefix (same SentencePiece model) for blending."""

    dataset: Path
    tokenizer: Path
    text_prefix: Path


def default_folder(data_dir: str | Path, vocab_size: int = 2048,
                   settings: ImageSettings = DEFAULT_SETTINGS) -> Path:
    """Where :func:`prepare_vl_default` puts the dataset for these arguments."""
    tag = hashlib.sha256(json.dumps(settings.to_json(), sort_keys=True).encode()).hexdigest()
    return Path(data_dir) / f"default_vl_v{vocab_size}_{tag[:8]}"


def prepare_vl_default(
    data_dir: str | Path,
    vocab_size: int = 2048,
    settings: ImageSettings = DEFAULT_SETTINGS,
    manifest: str | Path = DEFAULT_MANIFEST,
) -> VLDefault:
    """The default VL dataset in ``data_dir``, built if needed (module docstring)."""
    manifest = Path(manifest)
    if not manifest.is_file():
        raise ValueError(
            f"the default image manifest {manifest} is missing; it ships with the "
            f"mpcore repository (run from a checkout)"
        )
    model_path, text_prefix = prepare_default(data_dir, vocab_size)
    data_dir = Path(data_dir)
    out = default_folder(data_dir, vocab_size, settings)
    with open(data_dir / ".prepare_vl.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the with block closes the file
        want = dataset_fingerprint(manifest, model_path, settings)
        try:
            ready = VLDataset(out).meta["fingerprint"] == want
        except ValueError:
            ready = False
        if not ready:
            start = time.perf_counter()
            prepare_vl_dataset(manifest, out, model_path, settings, overwrite=True, progress=False)
            print(f"prepared the default image set in {out} (first use, or its cache did not "
                  f"match): {time.perf_counter() - start:.1f} s; later runs reuse it", flush=True)
    return VLDefault(out, out / "tokenizer.json", text_prefix)
