"""Videos given as frame files -> vision-tower input rows, as each family's transformers video
processor turns pre-sampled frames into ``pixel_values_videos`` / ``video_grid_thw``.

    VideoSettings.for_family(family)   a family's video processor (``Family.image_processing.
                                       video``: bounds, mean/std, resize rule, text layout)
    video_grid(n, h, w, image, video)  -> (t, h', w') of n frames of h x w (headers only)
    process_video(frames, image, video) -> (rows [t*h*w, C*T*P*P] float32, (t, h, w))
    video_parts(grid, fps, image, video, token_ids) -> the video's ids and texts, in order

Steps of ``process_video`` (transformers 5.x ``Qwen2VLVideoProcessor``, ``Qwen3VLVideoProcessor``,
``Glm4vVideoProcessor`` with ``do_sample_frames=False``): every frame RGB as an image is
(``images.to_rgb``), all of one size; the video resized ONCE to the family's size for its frame
count (``size_rule``) by torchvision's resize, which on the CPU is torch's bicubic interpolation
with antialias on the uint8 frames (so not PIL's resize, which images use); rescale and
normalise fused as the processors do (``(x - 255 mean) / (255 std)`` in float32); a frame count
that is not a multiple of ``temporal_patch_size`` padded by repeating the last frame; cut into
patches. Rows: temporal patch by temporal patch, each as an image's (merge windows row-major,
patches row-major inside a window), columns ``(C, T, P, P)``: the frames of one temporal patch
are the ``T`` axis. tests/unit/test_video_processing.py checks it against those processors.

Frame times (seconds of each frame: ``i / fps``; the manifest may give ``fps``, else the 24 that
transformers assumes for pre-sampled frames) feed the timestamps that Qwen3-VL and GLM-4V write
into the text between frames (``VideoProcessing.layout``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
import torch.nn.functional as F

from mpcore.data.images import check_image_size, to_rgb
from mpcore.models.common.resize import smart_resize
from mpcore.models.registry import FAMILIES

DEFAULT_FPS = 24.0  # transformers' Qwen3-VL / GLM-4V processors assume it without metadata
NOT_STORED = {"size_rule", "layout", "wrap", "seconds_problem"}  # the family's functions, not the data's values


@dataclass(frozen=True)
class VideoSettings:
    """How videos are resized, normalised and written into the text for one family's video
    processor (:meth:`for_family`); the patch geometry is the data's ``ImageSettings``'."""

    family: str
    """The model family whose video processor these settings follow."""
    hf_class: str
    """Its transformers video processor class (for messages and the record)."""
    min_pixels: int
    """Frames are scaled up to at least this many pixels (the processor's shortest_edge)."""
    max_pixels: int
    """... and down to at most this many (longest_edge; GLM-4V / Qwen3-VL count frames)."""
    mean: tuple[float, ...]
    """Per-channel mean (of values in [0, 1])."""
    std: tuple[float, ...]
    """Per-channel standard deviation."""
    extra_ids: int = 0
    """Ids after the tokenizer's that the layout writes (GLM-4V's video start / end)."""
    size_rule: Callable | None = field(default=None, compare=False, repr=False)
    """``VideoProcessing.size_rule`` (None: Qwen2-VL's smart_resize of one frame). Not stored."""
    layout: Callable | None = field(default=None, compare=False, repr=False)
    """``VideoProcessing.layout``. Not stored: a prepared dataset's settings leave it None."""
    wrap: tuple[str, str] | None = field(default=None, compare=False, repr=False)
    """``VideoProcessing.wrap``: the ids a release's chat template writes around its video
    placeholder. Not stored."""
    seconds_problem: Callable | None = field(default=None, compare=False, repr=False)
    """``(seconds per temporal patch) -> problem or None``: ``VideoProcessing.
    seconds_problem`` bound to the release's model config (``with_model``). Not stored."""

    @classmethod
    def for_family(cls, family, **overrides) -> VideoSettings:
        """The settings of ``family``'s video processor (``family.image_processing.video``),
        with ``overrides`` (``min_pixels``, ``max_pixels``; None keeps the family's).
        ``ValueError`` for a family whose prepared data takes no videos."""
        proc = family.image_processing.video if family.image_processing else None
        if proc is None:
            takes = sorted(f.name for f in FAMILIES.values()
                           if f.image_processing is not None and f.image_processing.video)
            raise ValueError(f"the {family.name} family takes no videos from prepared data; "
                             f"drop the videos from the manifest or prepare it for a family "
                             f"with a video processor ({', '.join(takes)})")
        values = dict(min_pixels=proc.min_pixels, max_pixels=proc.max_pixels,
                      mean=tuple(proc.mean), std=tuple(proc.std), extra_ids=proc.extra_ids)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(family=family.name, hf_class=proc.hf_class, size_rule=proc.size_rule,
                   layout=proc.layout, wrap=proc.wrap, **values)

    def with_model(self, family, cfg) -> VideoSettings:
        """These settings with ``family``'s ``seconds_problem`` bound to the model config
        ``cfg`` (a release's), so that a video whose time the model would read differently
        is refused by line."""
        check = family.image_processing.video.seconds_problem
        bound = None if check is None else (lambda seconds: check(cfg, seconds))
        return replace(self, seconds_problem=bound)

    def problem(self, fps: float | None, temporal_patch_size: int) -> str | None:
        """What is wrong with a video's ``fps`` (None: not given) for the bound model, or
        None (see ``seconds_problem``)."""
        if self.seconds_problem is None:
            return None
        return self.seconds_problem(temporal_patch_size / (fps or DEFAULT_FPS))

    @classmethod
    def from_json(cls, d: dict) -> VideoSettings:
        names = {f.name for f in fields(cls)} - NOT_STORED
        values = {k: tuple(v) if k in ("mean", "std") else v for k, v in d.items() if k in names}
        return cls(**values)

    def __post_init__(self):
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"video setting {name} must be a positive int, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"video min_pixels {self.min_pixels} > max_pixels "
                             f"{self.max_pixels}; lower --video-min-pixels or raise "
                             f"--video-max-pixels")
        if len(self.mean) != 3 or len(self.std) != 3 or not all(v > 0 for v in self.std):
            raise ValueError(f"video mean and std must be three numbers (std positive), got "
                             f"{self.mean!r}, {self.std!r}")

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in NOT_STORED}
        return {**out, "mean": list(self.mean), "std": list(self.std)}


def frame_size(num_frames: int, height: int, width: int, image, video: VideoSettings
               ) -> tuple[int, int]:
    """``(height, width)`` the frames are resized to (``image``: the data's ImageSettings,
    for the patch geometry and ``resize``; off: the frames' own size, checked)."""
    if not image.resize:
        check_image_size(height, width, factor=image.factor, max_pixels=video.max_pixels,
                         name="video frames")
        return height, width
    if video.size_rule is not None:
        return video.size_rule(num_frames, height, width, patch_size=image.patch_size,
                               merge_size=image.merge_size,
                               temporal_patch_size=image.temporal_patch_size,
                               min_pixels=video.min_pixels, max_pixels=video.max_pixels)
    return smart_resize(height, width, factor=image.factor, min_pixels=video.min_pixels,
                        max_pixels=video.max_pixels)


def video_grid(num_frames: int, height: int, width: int, image, video: VideoSettings
               ) -> tuple[int, int, int]:
    """The ``(t, h, w)`` patch grid of ``num_frames`` frames of ``height x width``:
    ``t = ceil(num_frames / temporal_patch_size)`` (the last frame repeats to fill)."""
    h, w = frame_size(num_frames, height, width, image, video)
    p = image.patch_size
    return -(-num_frames // image.temporal_patch_size), h // p, w // p


def process_video(frames, image, video: VideoSettings, name: str = "video"
                  ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``(pixel_values_videos [t*h*w, 3*T*P*P] float32, (t, h, w))`` of one video.

    ``frames``: PIL images (any mode) or uint8 arrays ``[H, W, 3]``, all of one size;
    ``image``: the data's ImageSettings (patch geometry, ``resize``); ``video``: the family's
    video settings. Steps and row order: the module docstring. ``ValueError`` naming ``name``
    for an empty list, frames of different sizes, or a size the family's rule refuses."""
    from PIL import Image

    if not frames:
        raise ValueError(f"{name}: a video needs at least one frame")
    arrays = []
    for k, frame in enumerate(frames):
        if isinstance(frame, np.ndarray):
            if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
                raise ValueError(f"{name}: frame {k} must be uint8 [H, W, 3], got "
                                 f"{frame.dtype} {list(frame.shape)}")
            frame = Image.fromarray(frame)
        arrays.append(np.asarray(to_rgb(frame, name)))
        if arrays[-1].shape != arrays[0].shape:
            raise ValueError(f"{name}: frame {k} is {arrays[-1].shape[0]}x{arrays[-1].shape[1]}"
                             f" but frame 0 is {arrays[0].shape[0]}x{arrays[0].shape[1]}; all "
                             f"frames of a video must have one size")
    pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # (N, C, H, W) uint8
    num_frames, _, height, width = pixels.shape
    try:
        size = frame_size(num_frames, height, width, image, video)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if size != (height, width):
        # torchvision's resize of uint8 frames on the CPU: this interpolation, on uint8
        pixels = F.interpolate(pixels.contiguous(), size=list(size), mode="bicubic",
                               align_corners=False, antialias=True)
    # the processors fuse rescale into normalise: mean and std scaled by 255 in float32
    mean = (torch.tensor(video.mean) * (1.0 / (1 / 255))).view(3, 1, 1)
    std = (torch.tensor(video.std) * (1.0 / (1 / 255))).view(3, 1, 1)
    pixels = (pixels.to(torch.float32) - mean) / std
    return patchify_video(pixels, image.patch_size, image.temporal_patch_size, image.merge_size)


def patchify_video(pixels: torch.Tensor, patch_size: int, temporal_patch_size: int,
                   merge_size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``pixels [N, C, H, W]`` (H, W multiples of ``patch_size * merge_size``) -> rows
    ``[t*h*w, C*T*P*P]`` (module docstring) and the grid ``(t, h, w)``; ``N`` is padded to a
    multiple of ``T`` by repeating the last frame."""
    if pad := -pixels.shape[0] % temporal_patch_size:
        pixels = torch.cat([pixels, pixels[-1:].expand(pad, *pixels.shape[1:])])
    frames, channels, height, width = pixels.shape
    m, p, tp = merge_size, patch_size, temporal_patch_size
    t, h, w = frames // tp, height // p, width // p
    patches = pixels.reshape(t, tp, channels, h // m, m, p, w // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h/m, w/m, m, m, C, T, P, P)
    return patches.reshape(t * h * w, channels * tp * p * p).contiguous(), (t, h, w)


def frame_times(grid_t: int, num_frames: int, temporal_patch_size: int, fps: float
                ) -> list[float]:
    """Seconds of each frame, ``i / fps``, the last repeated up to ``grid_t * T`` frames."""
    times = [i / fps for i in range(num_frames)]
    return times + times[-1:] * (grid_t * temporal_patch_size - num_frames)


def video_parts(grid: tuple[int, int, int], num_frames: int, fps: float | None, image,
                video: VideoSettings, token_ids: dict[str, int]) -> list[int | str]:
    """The video's ids (placeholders, start / end ids) and texts (timestamps) in stream order,
    as the family's processor writes them (``video.layout``)."""
    if video.layout is None:
        raise ValueError(f"the {video.family} video settings carry no text layout; build "
                         f"them with VideoSettings.for_family")
    times = frame_times(grid[0], num_frames, image.temporal_patch_size, fps or DEFAULT_FPS)
    return video.layout(tuple(grid), image.merge_size, times, token_ids)
