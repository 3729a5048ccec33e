"""Per-token inputs of a Qwen3-VL packed stream, computed on the GLOBAL stream, then split.

Layout: ``input_ids [T]`` holds documents end to end (``cu_seqlens [D+1]``). An image is one
run of ``t * h * w / m^2`` placeholder ids (``image_token_id``) between vision start/end tokens.
A video is laid out frame by frame, as the Qwen3-VL processor writes it: each temporal patch
``i < t`` is a text timestamp (``<0.5 seconds>``), vision start, a run of ``h * w / m^2``
``video_token_id`` ids, vision end. ``image_grid_thw [I, 3]`` / ``video_grid_thw [V, 3]`` give
each item's patch grid in stream order. ``mm_token_type_ids`` (0 text, 1 image, 2 video) is what
transformers groups runs by; here it follows from the ids, and when given it must agree.

Positions (``mpcore.models.common.mrope``, videos split into frames; transformers'
``Qwen3VLModel.get_rope_index``, per document, restarting at 0): a
text token takes the current position p on all three rows and advances p by 1; a placeholder
run starting at p with merged grid ``(t', h', w')`` (a video frame: ``t' = 1``) takes rows
``p + i_t``, ``p + i_h``, ``p + i_w`` over its grid (row-major), then p advances by
``max(h', w')``. So frames are separate items in time: the timestamps between them carry the
temporal order, not the temporal row.

Vision rows: the tower runs on ``cat(image pixels, video pixels)`` with ``cat(image_grid_thw,
video_grid_thw)``; placeholder k of the stream takes the k-th merged row of its kind, images'
rows first. The results, ``position_ids [3, T]``, ``vision_rows [T]`` (-1 for text) and
``labels [T]`` (``LabelShifter`` with both placeholder ids ignored), are then split together
by one ``ContextPlan``.
"""

from __future__ import annotations

import torch

from mpcore.models.common.mrope import mrope_positions, vision_items
from mpcore.models.common.qwen3_vl.config import Qwen3VLConfig
from mpcore.models.common.vl_split import split_vl_stream
from mpcore.parallel.context import ContextPlan
from mpcore.parallel.labels import IGNORE_INDEX, LabelShifter, check_cu_seqlens
from mpcore.parallel.state import ParallelState


def _kinds(ids: torch.Tensor, cfg: Qwen3VLConfig, mm_token_type_ids) -> torch.Tensor:
    kinds = (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
    if mm_token_type_ids is not None:
        given = torch.as_tensor(mm_token_type_ids).detach().cpu().long().view(-1)
        if given.shape != kinds.shape or not torch.equal(given, kinds):
            bad = (given != kinds).nonzero().view(-1)[:1].tolist() if given.shape == \
                kinds.shape else "shape"
            raise ValueError(f"mm_token_type_ids disagrees with input_ids (first at {bad}): it "
                             f"must be 1 exactly at image_token_id, 2 at video_token_id, 0 "
                             f"elsewhere, one entry per token")
    return kinds


def position_ids(input_ids: torch.Tensor, cu_seqlens, cfg: Qwen3VLConfig, image_grid_thw=None,
                 video_grid_thw=None, mm_token_type_ids=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids [3, T], vision_rows [T])`` int64 of a packed stream (module docstring).

    Raises ``ValueError`` before any compute when a run's length is not its item's (an image's
    ``t*h*w / m^2``, a video frame's ``h*w / m^2``), when runs and grids differ in number, or
    when ``mm_token_type_ids`` disagrees with the ids.
    """
    cu = check_cu_seqlens(cu_seqlens, input_ids.numel()).cpu().tolist()
    merge = cfg.vision.spatial_merge_size
    kinds = _kinds(input_ids.detach().cpu().long(), cfg, mm_token_type_ids)
    vision = vision_items(image_grid_thw, video_grid_thw, merge, split_frames=True)
    return mrope_positions(input_ids, cu, kinds, vision, merge,
                           "each image, and each video frame, is one run of its own (between "
                           "vision start/end tokens)")


def global_inputs(input_ids: torch.Tensor, cu_seqlens, cfg: Qwen3VLConfig, *,
                  image_grid_thw=None, video_grid_thw=None, loss_mask=None,
                  mm_token_type_ids=None) -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels", "position_ids" [3, T], "vision_rows"}`` of the GLOBAL stream
    (module docstring), ready for ``split_batch`` (pad ``vision_rows`` with -1)."""
    positions, rows = position_ids(input_ids, cu_seqlens, cfg, image_grid_thw, video_grid_thw,
                                   mm_token_type_ids)
    shifter = LabelShifter(IGNORE_INDEX, cfg.placeholder_ids)
    labels = shifter(input_ids, cu_seqlens, loss_mask)
    out = {"input_ids": input_ids, "labels": labels, "position_ids": positions,
           "vision_rows": rows}
    if getattr(cfg.text, "uses_mtp", False):
        out.update(mtp_targets(shifter, input_ids, cu_seqlens, rows, loss_mask))
    return out


def mtp_targets(shifter: LabelShifter, input_ids, cu_seqlens, vision_rows, loss_mask=None
                ) -> dict[str, torch.Tensor]:
    """The multi-token-prediction inputs of the GLOBAL stream (``mpcore.models.common.hybrid.
    mtp``): ``mtp_input_ids [T]`` (token t+1 in t's document, id 0 past its end),
    ``mtp_labels [T]`` (token t+2, placeholders and masked targets ignored) and
    ``mtp_vision_rows [T]`` (the tower row of token t+1 when it is a placeholder, -1
    otherwise), so the block embeds token t+1 as the decoder does, vision rows merged."""
    (target,) = shifter.mtp(input_ids, cu_seqlens, loss_mask, depth=1)
    # vision_rows shifted the same way: rows + 1 are valid "ids", the filler 0 becomes -1
    (rows,) = LabelShifter().mtp(vision_rows + 1, cu_seqlens, depth=1)
    return {"mtp_input_ids": target.input_ids, "mtp_labels": target.labels,
            "mtp_vision_rows": rows.input_ids - 1}


def local_inputs(state: ParallelState, input_ids: torch.Tensor, cu_seqlens, cfg: Qwen3VLConfig,
                 *, pixel_values: torch.Tensor | None = None, image_grid_thw=None,
                 pixel_values_videos: torch.Tensor | None = None, video_grid_thw=None,
                 loss_mask=None, sequence_parallel: bool = False, mm_token_type_ids=None,
                 layout: str | None = None, second_per_grid=None
                 ) -> tuple[ContextPlan, dict]:
    """The cp plan of one packed stream and this rank's ``Qwen3VLModel.forward`` keyword
    arguments (all but ``output``): the per-token tensors of the GLOBAL stream split together
    by one ``ContextPlan`` (zigzag when cp > 1; a multiple of tp under SP), the vision input
    (images then videos) whole on every rank (``mpcore.models.common.vl_split``). Signature of
    ``mpcore.models.qwen2_vl.inputs.local_vl_inputs`` (plus ``mm_token_type_ids``);
    ``second_per_grid`` is unused: a video's time is in its text (timestamps), not in its
    positions."""
    del second_per_grid
    batch = global_inputs(input_ids, cu_seqlens, cfg, image_grid_thw=image_grid_thw,
                          video_grid_thw=video_grid_thw, loss_mask=loss_mask,
                          mm_token_type_ids=mm_token_type_ids)
    return split_vl_stream(state, batch, cu_seqlens, pixels=[pixel_values, pixel_values_videos],
                           grids=[image_grid_thw, video_grid_thw],
                           sequence_parallel=sequence_parallel, layout=layout)
