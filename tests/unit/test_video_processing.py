"""Videos as frames -> rows and grids, against each family's transformers video processor.

``mpcore.data.videos.process_video`` on small synthetic frame lists (odd frame counts, sizes
that are no multiple of any patch, frames scaled up and down) must give exactly what
transformers 5.x ``Qwen2VLVideoProcessor``, ``Qwen3VLVideoProcessor`` and ``Glm4vVideoProcessor``
give on the same frames (``do_sample_frames=False``: the frames are the sampled ones; bounds
passed as ``size``). Those processors need torchvision: where it is installed the comparison
runs live; everywhere, the rows are compared with the sha256 of the processors' output recorded
here (transformers 5.24.0, torchvision 0.28.0, CPU), so CI (no torchvision) checks them too.

The text layout (where a video's placeholders and timestamps go) is compared with the strings
that ``Qwen3VLProcessor.replace_video_token`` and ``Glm4vProcessor.replace_video_token`` build
(they need no video processor), and GLM-4V's video start / end ids with its model config's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mpcore.config import load_config
from mpcore.data.images import process_image
from mpcore.data.videos import VideoSettings, frame_times, process_video, video_parts
from mpcore.data.vl_manifest import ImageSettings
from mpcore.models import family_named

REPO = Path(__file__).resolve().parents[2]
# (family, frames, height, width, min_pixels, max_pixels): resized up, down, and kept
CASES = [
    ("qwen2_vl", 3, 30, 50, 56 * 56, 28 * 28 * 8),
    ("qwen2_vl", 4, 40, 40, 56 * 56, 56 * 56),
    ("qwen2_vl", 2, 56, 84, 28 * 28, 28 * 28 * 6),
    ("qwen3_vl", 3, 33, 47, 32 * 32 * 2, 32 * 32 * 12),
    ("qwen3_vl", 6, 90, 40, 32 * 32, 32 * 32 * 16),
    ("glm4v", 5, 20, 70, 28 * 28 * 2, 28 * 28 * 12),
    ("glm4v", 2, 60, 30, 28 * 28, 28 * 28 * 40),
]
# sha256 of transformers' pixel_values_videos (float32 bytes) and video_grid_thw per case
RECORDED = {
    "qwen2_vl-3x30x50": ([2, 4, 6],
        "4b0303436b831d96015c0c24853a517acc292a0c76c647822cb8c9f34f58058b"),
    "qwen2_vl-4x40x40": ([2, 4, 4],
        "64b46a81261be7a20e9cd11864c758ed39b381924cb2ac666b35e33242909084"),
    "qwen2_vl-2x56x84": ([1, 4, 6],
        "c3c67cfb35410a1e5f6fd53f76d7e9b54ce94449d5dc6884685f78849491fbbb"),
    "qwen3_vl-3x33x47": ([2, 2, 2],
        "0a13077f60d91f1568bdbd9fd539341fe4ea8f06c9afe7df80731de053d24c2d"),
    "qwen3_vl-6x90x40": ([3, 4, 2],
        "c3f751625ac284f899733ad9615aa288106399da3fe5cd7df32faa91a496ee2e"),
    "glm4v-5x20x70": ([3, 2, 4],
        "5ce64c959e3b53620899049a7703bf452b25fdf35affa3639ba41520ba84207a"),
    "glm4v-2x60x30": ([1, 4, 2],
        "71e055128abd0c7b76f9f2a56c8fe31eba8329bd982fdc8a028c0d9ec7de2a16"),
}
HF_CLASSES = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen3_vl": "Qwen3VLVideoProcessor",
              "glm4v": "Glm4vVideoProcessor"}


def make_frames(n: int, height: int, width: int) -> list[np.ndarray]:
    """``n`` uint8 RGB frames of a hashed pattern (no RNG: the same bytes everywhere)."""
    i = np.arange(height, dtype=np.int64)[:, None, None]
    j = np.arange(width, dtype=np.int64)[None, :, None]
    c = np.arange(3, dtype=np.int64)[None, None, :]
    return [((i * 73856093) ^ (j * 19349663) ^ ((c + 3 * k) * 83492791)) % 256
            for k in range(n)]


def frames_of(case) -> list[np.ndarray]:
    _, n, height, width, _, _ = case
    return [f.astype(np.uint8) for f in make_frames(n, height, width)]


def settings_of(case):
    family = family_named(case[0])
    return (ImageSettings.for_family(family),
            VideoSettings.for_family(family, min_pixels=case[4], max_pixels=case[5]))


def digest(rows: torch.Tensor) -> str:
    return hashlib.sha256(rows.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def case_id(case) -> str:
    return "{}-{}x{}x{}".format(*case[:4])


def transformers_video(case):
    """transformers' ``(pixel_values_videos, video_grid_thw)`` of the case's frames."""
    pytest.importorskip("torchvision", reason="transformers' video processors need torchvision "
                                              "(the recorded digests still check the rows)")
    import transformers

    family, *_, low, high = case
    kwargs = dict(do_sample_frames=False, size={"shortest_edge": low, "longest_edge": high},
                  return_tensors="pt")
    if family != "glm4v":
        kwargs["cap_pixels_per_frame"] = False  # today's default, without its warning
    out = getattr(transformers, HF_CLASSES[family])()(videos=[frames_of(case)], **kwargs)
    return out["pixel_values_videos"], out["video_grid_thw"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rows_equal_the_transformers_video_processor(case):
    want, grid = transformers_video(case)
    rows, ours = process_video(frames_of(case), *settings_of(case))
    assert [list(ours)] == grid.tolist()
    assert rows.dtype == torch.float32 and rows.shape == want.shape
    assert torch.equal(rows, want.to(torch.float32)), float((rows - want).abs().max())


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rows_equal_the_recorded_processor_output(case):
    rows, grid = process_video(frames_of(case), *settings_of(case))
    want_grid, want_digest = RECORDED[case_id(case)]
    assert list(grid) == want_grid
    assert digest(rows) == want_digest


def test_the_checks_see_the_resize_and_the_padding():
    """The digests above would catch PIL's resize (the images' path) in place of the video
    processors' interpolation, and a video padded with anything but its last frame."""
    case = CASES[0]  # three frames, resized: padded to four
    image, video = settings_of(case)
    frames = frames_of(case)
    rows, (t, h, w) = process_video(frames, image, video)
    assert t == 2
    pil = process_image(frames[0], min_pixels=video.min_pixels, max_pixels=video.max_pixels)[0]
    # frame 0's half of the temporal axis of each row: (rows, C, T, P*P)
    ours, theirs = rows[: h * w].view(h * w, 3, 2, -1)[:, :, 0], pil.view(h * w, 3, 2, -1)[:, :, 0]
    assert ours.shape == theirs.shape  # the same size: only the interpolation differs
    assert float((ours - theirs).abs().max()) > 1e-3
    padded, _ = process_video([*frames, frames[-1]], image, video)
    assert torch.equal(rows, padded)
    other, _ = process_video([*frames, frames[0]], image, video)
    assert not torch.equal(rows, other)


def test_frames_must_share_a_size_and_fill_a_temporal_patch():
    image, video = settings_of(CASES[3])
    frames = frames_of(CASES[3])
    with pytest.raises(ValueError, match="frame 1 is 20x33 but frame 0 is 33x47"):
        process_video([frames[0], frames[1][:20, :33].copy()], image, video)
    with pytest.raises(ValueError, match="shorter than one temporal patch"):
        process_video(frames[:1], image, video)  # Qwen3-VL's and GLM-4V's processors refuse it
    q2 = settings_of(CASES[0])
    rows, grid = process_video(frames_of(CASES[0])[:1], *q2)  # Qwen2-VL's pads it
    assert grid[0] == 1 and rows.shape[0] == grid[0] * grid[1] * grid[2]


def _names(parts, ids: dict, names: dict) -> str:
    by_id = {ids[k]: v for k, v in names.items()}
    return "".join(p if isinstance(p, str) else by_id[p] for p in parts)


def _metadata(n: int, fps):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(range(n)))


IDS = {"image_token_id": 100, "video_token_id": 101, "vision_start_token_id": 102,
       "vision_end_token_id": 103}


@pytest.mark.parametrize("fps", [None, 2.0, 0.7])
@pytest.mark.parametrize("num_frames", [5, 6])
def test_qwen3_vl_layout_is_the_processors(num_frames, fps):
    from transformers import Qwen3VLProcessor

    grid = (-(-num_frames // 2), 4, 6)
    stub = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                           vision_start_token="<|vision_start|>", video_token="<|video_pad|>",
                           vision_end_token="<|vision_end|>")
    stub._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(stub, *a)
    want = Qwen3VLProcessor.replace_video_token(
        stub, {"video_grid_thw": torch.tensor([grid]),
               "video_metadata": [_metadata(num_frames, fps)]}, 0)
    image, video = settings_of(CASES[3])
    parts = video_parts(grid, num_frames, fps, image, video, IDS)
    names = {"video_token_id": "<|video_pad|>", "vision_start_token_id": "<|vision_start|>",
             "vision_end_token_id": "<|vision_end|>"}
    assert _names(parts, IDS, names) == want
    assert want.count(" seconds>") == grid[0]


@pytest.mark.parametrize("fps", [None, 0.5])
@pytest.mark.parametrize("num_frames", [5, 6])
def test_glm4v_layout_is_the_processors(num_frames, fps):
    from transformers import Glm4vProcessor

    grid = (-(-num_frames // 2), 4, 2)
    stub = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2), image_token="<|image|>")
    stub.replace_frame_token_id = (
        lambda *a, **k: Glm4vProcessor.replace_frame_token_id(stub, *a, **k))
    want = Glm4vProcessor.replace_video_token(
        stub, {"video_grid_thw": torch.tensor([grid]),
               "video_metadata": [_metadata(num_frames, fps)]}, 0)
    image, video = settings_of(CASES[5])
    parts = video_parts(grid, num_frames, fps, image, video, IDS)
    names = {"image_token_id": "<|image|>", "vision_start_token_id": "<|begin_of_image|>",
             "vision_end_token_id": "<|end_of_image|>"}
    # the processor writes the frames; the chat template wraps <|video|> in the video span
    assert _names(parts[1:-1], IDS, names) == want
    cfg = load_config(str(REPO / "launch" / "configs" / "glm4v_tiny.yaml"),
                      ["model.vocab_size=200"])
    model_cfg = family_named("glm4v").config_from_section(cfg.model, IDS)
    span = (model_cfg.video_start_token_id, model_cfg.video_end_token_id)
    assert (parts[0], parts[-1]) == span == (104, 105)
    assert video.extra_ids == 2


def test_qwen2_vl_layout_is_one_run():
    image, video = settings_of(CASES[0])
    parts = video_parts((3, 4, 6), 5, None, image, video, IDS)
    assert parts == [102, *[101] * 18, 103]


def test_frame_times_pad_with_the_last_frame():
    assert frame_times(3, 5, 2, 2.0) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.0]
