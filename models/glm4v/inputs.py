"""Per-token inputs of a GLM-4V packed stream, computed on the GLOBAL stream before any split.

Layout: ``input_ids [T]``, documents end to end (``cu_seqlens [D+1]``). An image is one run of
``t * h * w / m^2`` placeholders (``image_token_id``, m the merge size) between image start/end
tokens; a video of t frames is t such runs of ``h * w / m^2``, one per frame, each between
image start/end tokens with its timestamp as text, all inside ``video_start ... video_end``.
Images and videos share the placeholder id: a placeholder inside an open video span of its own
document is a video frame (transformers' processor rule for ``mm_token_type_ids``, applied per
document), any other an image. ``image_grid_thw [I, 3]`` / ``video_grid_thw [V, 3]`` give the
items' patch grids in stream order.

    position_ids [3, T]  M-RoPE rows (temporal, height, width), restarting in every document
    vision_rows  [T]     tower output row of a placeholder (images first, then videos), else -1
    labels       [T]     ``LabelShifter`` with the placeholder id ignored

The position rule (``mpcore.models.common.mrope``, videos split into frames) is transformers 5.x
``Glm4vModel.get_rope_index``, per document: a text token
takes the current position p on all three rows and advances p by 1; an image (or one video
frame) with merged grid ``(t, h / m, w / m)`` starting at p takes ``p + i_t, p + i_h, p + i_w``
over its grid, row-major, then p advances by ``max(h, w) / m``. Frames are separate items (the
video's grid split into t rows of t=1), so a video's temporal row steps through the text between
frames, not by a frame index. Each item needs a run of its own: runs that touch (two images
with no token between) are refused, as transformers cannot place them either.
"""

from __future__ import annotations

import torch

from mpcore.models.common.mrope import mrope_positions, vision_items
from mpcore.models.common.vl_split import split_vl_stream
from mpcore.models.glm4v.config import Glm4vConfig
from mpcore.parallel.context import ContextPlan
from mpcore.parallel.labels import IGNORE_INDEX, LabelShifter, check_cu_seqlens
from mpcore.parallel.state import ParallelState

__all__ = ["glm4v_inputs", "local_glm4v_inputs", "mm_token_types", "position_ids"]


def mm_token_types(input_ids: torch.Tensor, cu: list[int], cfg: Glm4vConfig) -> torch.Tensor:
    """``[T]`` int64: 0 text, 1 image placeholder, 2 video placeholder (module docstring)."""
    ids = input_ids.detach().cpu().long()
    placeholder = ids == cfg.image_token_id
    opened = torch.zeros_like(ids)
    for a, b in zip(cu[:-1], cu[1:], strict=True):  # spans never reach across documents
        doc = ids[a:b]
        opened[a:b] = ((doc == cfg.video_start_token_id).cumsum(0)
                       - (doc == cfg.video_end_token_id).cumsum(0))
    return placeholder.long() * torch.where(opened > 0, 2, 1)


def position_ids(input_ids: torch.Tensor, cu_seqlens, cfg: Glm4vConfig, image_grid_thw=None,
                 video_grid_thw=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids [3, T], vision_rows [T])`` int64 of a packed stream (module docstring).

    Raises ``ValueError`` before any compute when a placeholder run's length is not its item's
    ``t * h * w / m^2`` (naming the item and both counts), or runs and grid rows differ in number.
    """
    cu = check_cu_seqlens(cu_seqlens, input_ids.numel()).cpu().tolist()
    m = cfg.vision.spatial_merge_size
    kinds = mm_token_types(input_ids, cu, cfg)
    vision = vision_items(image_grid_thw, video_grid_thw, m, split_frames=True)
    return mrope_positions(input_ids, cu, kinds, vision, m,
                           "give each item a run of its own, between image start/end tokens")


def glm4v_inputs(input_ids: torch.Tensor, cu_seqlens, cfg: Glm4vConfig, *, image_grid_thw=None,
                 video_grid_thw=None, loss_mask=None,
                 ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """The global per-token tensors ``{"input_ids", "labels", "position_ids", "vision_rows"}``
    of a packed stream (module docstring), ready for one ``split_batch``."""
    positions, rows = position_ids(input_ids, cu_seqlens, cfg, image_grid_thw, video_grid_thw)
    labels = LabelShifter(ignore_index, cfg.placeholder_ids)(input_ids, cu_seqlens, loss_mask)
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions,
            "vision_rows": rows}


def local_glm4v_inputs(state: ParallelState, input_ids: torch.Tensor, cu_seqlens,
                       cfg: Glm4vConfig, *, pixel_values: torch.Tensor | None = None,
                       image_grid_thw=None, pixel_values_videos: torch.Tensor | None = None,
                       video_grid_thw=None, loss_mask=None, sequence_parallel: bool = False,
                       layout: str | None = None, second_per_grid=None
                       ) -> tuple[ContextPlan, dict]:
    """The cp plan of one packed stream and this rank's ``Glm4vModel.forward`` keyword arguments
    (all but ``output``): the per-token tensors made on the GLOBAL stream, then split together
    by one ``ContextPlan`` (zigzag when cp > 1 unless ``layout`` says otherwise; a multiple of tp
    under SP); the vision input (images, then videos) passed whole to every rank
    (``mpcore.models.common.vl_split``). ``second_per_grid`` is unused: a video's time is in
    its text (timestamps), not in its positions."""
    del second_per_grid
    batch = glm4v_inputs(input_ids, cu_seqlens, cfg, image_grid_thw=image_grid_thw,
                         video_grid_thw=video_grid_thw, loss_mask=loss_mask)
    return split_vl_stream(state, batch, cu_seqlens, pixels=[pixel_values, pixel_values_videos],
                           grids=[image_grid_thw, video_grid_thw],
                           sequence_parallel=sequence_parallel, layout=layout)
