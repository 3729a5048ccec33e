"""This rank's inputs of a text-only packed stream: labels on the GLOBAL stream, then one split.

Layout: ``input_ids [T]`` holds documents end to end (``cu_seqlens [D+1]``). Label t is
``input_ids[t+1]`` within its document (``mpcore.parallel.LabelShifter``: ignored at each document's
last token and where ``loss_mask`` is false), computed BEFORE the split; then one
``ContextPlan`` (zigzag per document when cp > 1, unless ``layout`` says otherwise; local length
a multiple of tp under sequence parallelism) splits ids, labels and positions together.
"""

from __future__ import annotations

import torch

from mpcore.parallel.context import ContextPlan, split_batch
from mpcore.parallel.labels import LabelShifter, position_ids
from mpcore.parallel.state import ParallelState


def local_text_inputs(state: ParallelState, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      cfg=None, *, loss_mask: torch.Tensor | None = None,
                      sequence_parallel: bool = False, layout: str | None = None,
                      pixel_values: torch.Tensor | None = None, image_grid_thw=None,
                      extra: dict[str, torch.Tensor] | None = None
                      ) -> tuple[ContextPlan, dict]:
    """The cp plan of one packed stream and this rank's ``Transformer.forward`` keyword
    arguments (all but ``output``): ``input_ids, position_ids, labels, doc_id,
    positions_in_doc [L]`` and local ``cu_seqlens [S+1]`` int32, on ``input_ids``' device.

    ``input_ids [T]`` int, ``cu_seqlens [D+1]`` int (non-empty documents), ``loss_mask [T]``
    bool or None; positions restart at 0 per document. ``cfg`` is unused (the signature is
    every family's ``local_inputs``). ``layout``: ``zigzag`` or ``contiguous`` (None: zigzag
    when cp > 1). A text model takes no images: ``pixel_values`` / ``image_grid_thw`` must be
    None. ``extra``: more per-token tensors ``[T]`` of the global stream (e.g. the MTP ids
    and labels, ``mpcore.models.common.hybrid.mtp``), split with the rest and returned by key.
    """
    del cfg
    if pixel_values is not None or image_grid_thw is not None:
        raise ValueError("this is a text-only model: it takes no pixel_values or "
                         "image_grid_thw; use a vision-language checkpoint for images")
    total = input_ids.numel()
    labels = LabelShifter()(input_ids, cu_seqlens, loss_mask)  # (T,) before any split
    positions = position_ids(cu_seqlens, total).to(input_ids.device)
    if state.cp == 1:
        layout = "contiguous"
    plan = ContextPlan(cu_seqlens, total, state.cp, layout or "zigzag",
                       pad_multiple=state.tp if sequence_parallel else 1)
    local = split_batch({"input_ids": input_ids, "labels": labels, "position_ids": positions,
                         "cu_seqlens": cu_seqlens, **(extra or {})}, plan, state.cp_rank)
    rank_layout = plan.rank_layout(state.cp_rank)
    device = input_ids.device
    return plan, {"input_ids": local["input_ids"], "position_ids": local["position_ids"],
                  "labels": local["labels"], "doc_id": rank_layout.doc_id.to(device),
                  "positions_in_doc": rank_layout.positions_in_doc.to(device),
                  "cu_seqlens": local["cu_seqlens"], **{k: local[k] for k in extra or {}}}
