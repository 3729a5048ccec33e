"""transformers' processors on VL conversations WITH videos, as far as they run without
torchvision (not installed here: the machine's torch is a CPU build that PyPI's torchvision does
not import with).

What runs is transformers' own code: the release's chat template (``apply_chat_template(...,
tokenize=False)``), the processor's ``__call__`` (each placeholder replaced by its expansion
text: ``replace_image_token`` / ``replace_video_token``, Qwen3-VL's and GLM-4V's timestamps
from the video metadata, then the tokenizer on the whole text), and the video processor's
resize RULE (its ``smart_resize``), frame padding, rescale-and-normalise and ``patchify``.

The steps that need torchvision are two calls of ``TorchvisionBackend``: ``tvF.resize`` (the
interpolation kernel) and ``tvF.normalize``; :class:`_Bicubic` replaces only those by the torch
operations torchvision runs for them on the CPU (bicubic with antialias on the uint8 frames,
``F.interpolate``, after checking that the processor asked for bicubic; ``(x - mean) / std``
per channel). The kernel
is pinned separately: tests/unit/test_video_processing.py compares rows with the recorded
output of the real processors (with torchvision) and runs them live where torchvision imports.

``Qwen2VLVideoProcessor``'s module imports torchvision at its top, so it cannot be loaded at all;
its steps (``smart_resize`` of each frame, the same function as ``transformers.models.qwen2_vl.
image_processing_pil_qwen2_vl.smart_resize``, which imports; the same rescale/normalise and ``patchify`` as
``Qwen3VLVideoProcessor``, line for line in transformers 5.x) are composed here from those
importable pieces.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers.image_processing_backends import TorchvisionBackend
from transformers.image_utils import PILImageResampling, SizeDict, load_image
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

VIDEO_SIZE = {"shortest_edge": 8 * 8, "longest_edge": 2048}  # frames counted (Qwen3-VL, GLM)
QWEN2_VIDEO_SIZE = {"shortest_edge": 8 * 8, "longest_edge": 512}  # one frame (Qwen2-VL)


def video_config(arch: str) -> dict:
    """The video_preprocessor_config.json of the tiny release of ``arch`` (patch geometry of
    its image processor; bounds that shrink some videos and keep others)."""
    mean = [0.5] * 3 if arch in ("qwen3_vl", "qwen3_5") else [0.48145466, 0.4578275,
                                                               0.40821073]
    std = [0.5] * 3 if arch in ("qwen3_vl", "qwen3_5") else [0.26862954, 0.26130258,
                                                             0.27577711]
    size = QWEN2_VIDEO_SIZE if arch in ("qwen2_vl", "qwen2_5_vl") else VIDEO_SIZE
    return {"patch_size": 2, "temporal_patch_size": 2, "merge_size": 2, "size": dict(size),
            "image_mean": mean, "image_std": std, "do_sample_frames": False}


def write_video_config(arch: str, folder: Path) -> dict:
    config = video_config(arch)
    (Path(folder) / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2))
    return config


def _bicubic_backend():
    class _Bicubic(TorchvisionBackend):
        """``TorchvisionBackend.resize`` to an exact size, by the torch call torchvision makes
        for uint8 frames on the CPU (module docstring)."""

        def resize(self, image, size, resample=None, antialias=True, **kwargs):
            assert resample in (PILImageResampling.BICUBIC, 3), resample  # the processors'
            assert size.height and size.width and image.dtype == torch.uint8
            *lead, c, h, w = image.shape
            flat = image.reshape(-1, c, h, w).contiguous()
            out = F.interpolate(flat, size=[size.height, size.width], mode="bicubic",
                                align_corners=False, antialias=antialias)
            return out.reshape(*lead, c, size.height, size.width)

        def normalize(self, image, mean, std, inplace=False, **kwargs):
            # torchvision's tensor normalize: per channel (dim -3), (x - mean) / std
            mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
            return image.sub(mean).div(std)

    return _Bicubic


def video_processor(arch: str, config: dict):
    """transformers' video processor of ``arch`` (module docstring) from ``config``."""
    backend = _bicubic_backend()
    kwargs = dict(config)
    if arch == "glm4v":
        return type("Glm4vVideo", (Glm4vVideoProcessor, backend), {})(**kwargs)
    if arch in ("qwen3_vl", "qwen3_5"):
        return type("Qwen3VLVideo", (Qwen3VLVideoProcessor, backend), {})(**kwargs)

    class Qwen2VLVideo(Qwen3VLVideoProcessor, backend):
        """Qwen2VLVideoProcessor's resize: each frame by Qwen2-VL's smart_resize."""

        def resize(self, videos, size, resample, factor, temporal_factor=2, **kw):
            h, w = smart_resize(*videos.shape[-2:], factor=factor,
                                min_pixels=size.shortest_edge, max_pixels=size.longest_edge)
            return backend.resize(self, videos, SizeDict(height=h, width=w), resample)

    return Qwen2VLVideo(**kwargs)


def processor_inputs(processor, messages, folder: Path) -> dict:
    """transformers' processor outputs for ``messages`` (images by path, videos as frame
    lists, relative to ``folder``): its template's text, then its ``__call__`` with the
    images and frames loaded by transformers' ``load_image`` and each video's metadata (its
    fps when the part gives one; none given: the processors' default of 24)."""
    text = processor.apply_chat_template(messages, tokenize=False)
    images, videos, metadata = [], [], []
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image":
                images.append(load_image(str(folder / part["image"])))
            elif part["type"] == "video":
                frames = [np.asarray(load_image(str(folder / f))) for f in part["video"]]
                videos.append(frames)
                metadata.append(VideoMetadata(total_num_frames=len(frames),
                                              fps=part.get("fps"),
                                              frames_indices=list(range(len(frames)))))
    kwargs = {}
    if videos:
        # the frames are RGB already (load_image): its RGB step is torchvision's no-op here
        kwargs = {"videos": videos, "video_metadata": metadata, "do_sample_frames": False,
                  "do_convert_rgb": False}
    return processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
