"""What a released VL checkpoint folder says about preparing data for it.

    release_family(folder)            its family, from config.json's architectures
    release_vl_tokenizer(folder, f)   its tokenizer with the vision ids its config.json names
    release_image_settings(folder, f) the image settings of its preprocessor_config.json (the
                                      family's defaults for keys it lacks)
    release_video_settings(folder, f, image)  the video settings of its video processor config
                                      (None for a family that takes no videos)

The ids are the family config's ``*_token_id`` fields as ``family.config_from_hf`` reads them
from the release (so ``mpcore.build`` compares the same names with ``model.init_from``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mpcore.data.hf_folder import folder_of
from mpcore.data.videos import VideoSettings
from mpcore.data.vl_manifest import ImageSettings
from mpcore.data.vl_release import NOT_VISION, ReleaseVLTokenizer
from mpcore.models import family_of_hf
from mpcore.models.common.family import Family
from mpcore.models.common.hf_io import read_hf_config


def _config(folder: Path) -> dict:
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has a tokenizer.json but no config.json, so its vision token "
                         f"ids are unknown; pass the released checkpoint's folder (config.json "
                         f"beside tokenizer.json)")
    return read_hf_config(folder)


def release_family(folder: str | Path) -> Family:
    """The family of the release at ``folder`` (a folder or its tokenizer.json)."""
    return family_of_hf(_config(folder_of(folder)))


def release_vl_tokenizer(folder: str | Path, family: Family) -> ReleaseVLTokenizer:
    """The tokenizer of the release at ``folder`` with ``family``'s vision ids from its
    config.json. ``ValueError`` naming the folder and the fix for a text family (no vision
    ids: VL conversations need a vision-language release) or a release of another family."""
    folder = folder_of(folder)
    hf = _config(folder)
    if family.modality != "image-text":
        raise ValueError(f"{folder} is a {family.name} release, a text family without a vision "
                         f"tower; VL conversations (images) need a vision-language release; "
                         f"prepare text conversations with launch/prepare_data.py --chat")
    found = family_of_hf(hf)
    if found.name != family.name:
        raise ValueError(f"{folder} is a {found.name} release but --family {family.name}; drop "
                         f"--family (the release's is used) or pass the {family.name} release")
    cfg = family.config_from_hf(hf)
    ids = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
           if f.name.endswith("_token_id") and f.name not in NOT_VISION}
    return ReleaseVLTokenizer(folder, ids)


def release_image_settings(folder: str | Path, family: Family, **overrides) -> ImageSettings:
    """``ImageSettings.for_family(family)`` with the values of the release's
    ``preprocessor_config.json`` (patch_size, temporal_patch_size, merge_size, size's
    shortest_edge / longest_edge or min_pixels / max_pixels, image_mean, image_std), then
    ``overrides`` (None keeps)."""
    path = folder_of(folder) / "preprocessor_config.json"
    given = json.loads(path.read_text()) if path.is_file() else {}
    size = given.get("size") or {}
    values = {"patch_size": given.get("patch_size"),
              "temporal_patch_size": given.get("temporal_patch_size"),
              "merge_size": given.get("merge_size"),
              "min_pixels": size.get("shortest_edge", given.get("min_pixels")),
              "max_pixels": size.get("longest_edge", given.get("max_pixels")),
              "mean": tuple(given["image_mean"]) if "image_mean" in given else None,
              "std": tuple(given["image_std"]) if "image_std" in given else None}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ImageSettings.for_family(family, **values)


def _video_config(folder: Path) -> tuple[dict, str]:
    """The release's video processor settings and the file they came from, in transformers'
    order: processor_config.json's ``video_processor``, video_preprocessor_config.json, then
    preprocessor_config.json (what ``AutoVideoProcessor`` falls back to); ``{}`` if none."""
    nested = folder / "processor_config.json"
    if nested.is_file() and isinstance(json.loads(nested.read_text()).get("video_processor"),
                                       dict):
        return json.loads(nested.read_text())["video_processor"], str(nested)
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text()), str(folder / name)
    return {}, "the family's defaults"


def release_video_settings(folder: str | Path, family: Family, image: ImageSettings,
                           min_pixels: int | None = None, max_pixels: int | None = None
                           ) -> VideoSettings | None:
    """``VideoSettings.for_family(family)`` with the release's video processor values (size's
    shortest_edge / longest_edge or min_pixels / max_pixels, image_mean, image_std), then
    ``min_pixels`` / ``max_pixels`` (``--video-min-pixels`` / ``--video-max-pixels``; None
    keeps). None when ``family`` takes no videos (a video line is then refused by line).
    ``ValueError`` naming the file when its patch geometry differs from the images' (``image``):
    the rows of both feed one tower."""
    if family.image_processing is None or family.image_processing.video is None:
        return None
    given, source = _video_config(folder_of(folder))
    for key in ("patch_size", "temporal_patch_size", "merge_size"):
        if given.get(key) is not None and given[key] != getattr(image, key):
            raise ValueError(f"{source}: the video processor's {key} is {given[key]} but the "
                             f"images' is {getattr(image, key)}; one vision tower reads both, "
                             f"so the release's processor configs must agree")
    size = given.get("size") or {}
    values = {"min_pixels": size.get("shortest_edge", given.get("min_pixels")),
              "max_pixels": size.get("longest_edge", given.get("max_pixels")),
              "mean": tuple(given["image_mean"]) if "image_mean" in given else None,
              "std": tuple(given["image_std"]) if "image_std" in given else None}
    values.update({k: v for k, v in {"min_pixels": min_pixels,
                                     "max_pixels": max_pixels}.items() if v is not None})
    hf = read_hf_config(folder_of(folder))
    return VideoSettings.for_family(family, **values).with_model(family,
                                                                 family.config_from_hf(hf))
