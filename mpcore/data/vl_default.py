"""The default image-text dataset that ships with mpcore, prepared on first use.

Source: ``launch/data/images/captions.jsonl`` (15 public-domain / CC0 images from scikit-image's
sample data, one caption each; see launch/data/images/README.md). Tokenizer: the default text
corpus's SentencePiece model (``prepare_default``, vocab ``V``) with the four VL ids appended
(mpcore/data/vl_tokenizer.py), so the model's vocabulary is ``V + 4`` and the default text
corpus (same model) blends in id for id.

Image settings for a tiny CPU model (:data:`DEFAULT_SETTINGS`): the real Qwen2-VL processing
(patch 14, temporal patch 2, merge 2, so rows of 1176 and any Qwen2-VL tower's patch embedding
fits), but small images: ``min_pixels = 4 * 28^2`` and ``max_pixels = 32 * 28^2``, i.e. 4 to 32
merged placeholder tokens per image (the shipped set: 16 to 30, 25 on average; samples of 47 to
78 tokens). Pass other settings for a larger model.

Into ``data_dir``: ``default_vl_v<V>_<settings hash>/`` (a dataset folder, see vl_dataset.py),
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

from mpcore.data.corpus import prepare_default
from mpcore.data.vl_dataset import VLDataset, dataset_fingerprint, prepare_vl_dataset
from mpcore.data.vl_manifest import ImageSettings

DEFAULT_MANIFEST = (
    Path(__file__).resolve().parents[2] / "launch" / "data" / "images" / "captions.jsonl"
)
DEFAULT_SETTINGS = ImageSettings(min_pixels=4 * 28 * 28, max_pixels=32 * 28 * 28)


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
