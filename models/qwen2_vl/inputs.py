"""Per-token inputs of a vision-language packed stream, computed on the GLOBAL stream.

Layout: ``input_ids [T]`` holds documents end to end (``cu_seqlens [D+1]``); an image or video
appears as one run of ``t * h * w / merge^2`` placeholder ids (``image_token_id`` /
``video_token_id``), usually between vision start/end tokens. ``image_grid_thw [I, 3]`` and
``video_grid_thw [V, 3]`` give each item's patch grid ``(t, h, w)``, images (videos) in the order
their runs appear in the stream. Everything here runs BEFORE any split; the results are per-token
tensors that ``mpcore.parallel.ContextPlan`` then splits together with the ids:

    position_ids [3, T]  M-RoPE rows (temporal, height, width), restarting in every document
    vision_rows  [T]     row of the vision tower's output for a placeholder, -1 for text
    labels       [T]     ``LabelShifter`` with both placeholder ids ignored: no target is ever a
                         placeholder (vision start/end tokens are ordinary text targets)

Vision rows: the tower runs on ``cat(image pixels, video pixels)`` with
``cat(image_grid_thw, video_grid_thw)``, so image i's merged rows come first, then videos.

The position rule (the walker is ``mpcore.models.common.mrope``, shared with Qwen3-VL and GLM-4V),
pinned to transformers 5.x (``Qwen2VLModel.get_rope_index``): a text token
takes the current position p on all three rows and advances p by 1; a vision item with merged
grid ``(t', h', w') = (t, h / m, w / m)`` starting at p takes rows
``p + floor(i_t * interval)``, ``p + i_h``, ``p + i_w`` over its ``t' x h' x w'`` grid (row-major),
then p advances by ``max(h', w')``. ``interval`` is 1 for images and Qwen2-VL videos, and
``tokens_per_second * second_per_grid`` for Qwen2.5-VL videos. transformers 4.x advanced p to
one past the largest position used instead, which differs for videos with ``t' * interval >
max(h', w')``; for images (t' = 1) the two rules agree.
"""

from __future__ import annotations

import torch

from mpcore.models.common.mrope import mrope_positions, vision_items
from mpcore.models.common.vl_split import check_grid, split_vl_stream
from mpcore.models.qwen2_vl.config import VLConfig
from mpcore.parallel.context import ContextPlan
from mpcore.parallel.labels import IGNORE_INDEX, LabelShifter, check_cu_seqlens
from mpcore.parallel.state import ParallelState

__all__ = ["local_vl_inputs", "vl_inputs", "vl_position_ids"]


def vl_position_ids(input_ids: torch.Tensor, cu_seqlens, cfg: VLConfig, image_grid_thw=None,
                    video_grid_thw=None, second_per_grid=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids [3, T], vision_rows [T])`` int64 of a packed stream (module docstring).

    ``second_per_grid``: seconds per temporal patch of each video (Qwen2.5-VL), default 1.
    Raises ``ValueError`` before any compute when a placeholder run's length is not its item's
    ``t * h * w / merge^2`` (naming the item and both counts), when runs and grids differ in
    number, or when a run crosses a document boundary.
    """
    cu = check_cu_seqlens(cu_seqlens, input_ids.numel()).cpu().tolist()
    merge = cfg.vision.spatial_merge_size
    num_videos = len(check_grid(video_grid_thw, "video_grid_thw", merge))
    seconds = [1.0] * num_videos if second_per_grid is None else [
        float(s) for s in (second_per_grid.tolist() if isinstance(second_per_grid, torch.Tensor)
                           else second_per_grid)]
    if len(seconds) != num_videos:
        raise ValueError(f"second_per_grid has {len(seconds)} entries for {num_videos} videos")
    step = cfg.tokens_per_second if cfg.arch == "qwen2_5_vl" else None  # Qwen2-VL: 1
    vision = vision_items(image_grid_thw, video_grid_thw, merge, split_frames=False,
                          video_intervals=[1.0 if step is None else step * s for s in seconds])
    ids = input_ids.detach().cpu().long()
    kinds = (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
    return mrope_positions(input_ids, cu, kinds, vision, merge,
                           "check the grid against the run (each item needs a run of its own, "
                           "e.g. between vision start/end tokens)")


def vl_inputs(input_ids: torch.Tensor, cu_seqlens, cfg: VLConfig, *, image_grid_thw=None,
              video_grid_thw=None, second_per_grid=None, loss_mask=None,
              ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """The global per-token tensors of a VL packed stream: ``{"input_ids", "labels",
    "position_ids" [3, T], "vision_rows"}`` (module docstring), ready for ``split_batch``
    (split ``vision_rows`` with ``pad_values={"vision_rows": -1}``)."""
    positions, vision_rows = vl_position_ids(input_ids, cu_seqlens, cfg, image_grid_thw,
                                             video_grid_thw, second_per_grid)
    labels = LabelShifter(ignore_index, cfg.placeholder_ids)(input_ids, cu_seqlens, loss_mask)
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions,
            "vision_rows": vision_rows}


def local_vl_inputs(state: ParallelState, input_ids: torch.Tensor, cu_seqlens, cfg: VLConfig,
                    *, pixel_values: torch.Tensor | None = None, image_grid_thw=None,
                    pixel_values_videos: torch.Tensor | None = None, video_grid_thw=None,
                    second_per_grid=None, loss_mask=None, sequence_parallel: bool = False,
                    layout: str | None = None) -> tuple[ContextPlan, dict]:
    """The cp plan of one packed VL stream and this rank's ``VLModel.forward`` keyword
    arguments (all but ``output``): the per-token tensors made on the GLOBAL stream
    (``vl_inputs``), then split together (zigzag when cp > 1; a multiple of tp under SP); the
    vision input (images then videos) passed whole to every rank. ``layout``: ``zigzag`` or
    ``contiguous`` (None: zigzag when cp > 1)."""
    batch = vl_inputs(input_ids, cu_seqlens, cfg, image_grid_thw=image_grid_thw,
                      video_grid_thw=video_grid_thw, second_per_grid=second_per_grid,
                      loss_mask=loss_mask)
    return split_vl_stream(state, batch, cu_seqlens, pixels=[pixel_values, pixel_values_videos],
                           grids=[image_grid_thw, video_grid_thw],
                           sequence_parallel=sequence_parallel, layout=layout)
