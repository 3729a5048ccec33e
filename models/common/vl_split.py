"""One vision-language packed stream -> this cp rank's model inputs (every VL family's last step).

A family first makes the GLOBAL per-token tensors of the stream (``input_ids``, ``labels``,
M-RoPE ``position_ids [3, T]``, ``vision_rows [T]``: the tower row of each placeholder, -1 for
text), by its own position rule. Then ONE ``ContextPlan`` splits them all together (zigzag per
document when cp > 1, unless ``layout`` says otherwise; local length a multiple of tp under
sequence parallelism), ``vision_rows`` padded with -1. The vision input (images then videos,
``pixel_values [N, patch_dim]`` and ``grid_thw [I, 3]``) goes whole to every cp rank; with no
vision item both are None and the model runs its dummy window (every rank joins every
collective).
"""

from __future__ import annotations

import torch

from parallel.context import ContextPlan, split_batch
from parallel.state import ParallelState


def split_vl_stream(state: ParallelState, batch: dict[str, torch.Tensor], cu_seqlens, *,
                    pixels: list[torch.Tensor | None], grids: list, sequence_parallel: bool,
                    layout: str | None) -> tuple[ContextPlan, dict]:
    """``(plan, forward kwargs)`` of this cp rank (module docstring). ``batch``: the global
    per-token tensors; ``pixels`` / ``grids``: the image and video parts, None where absent."""
    input_ids = batch["input_ids"]
    layout = (layout or "zigzag") if state.cp > 1 else "contiguous"
    plan = ContextPlan(cu_seqlens, input_ids.numel(), state.cp, layout,
                       pad_multiple=state.tp if sequence_parallel else 1)
    local = split_batch({**batch, "cu_seqlens": cu_seqlens}, plan, state.cp_rank,
                        pad_values={"vision_rows": -1})
    rank_layout = plan.rank_layout(state.cp_rank)
    device = input_ids.device
    parts = [p for p in pixels if p is not None]
    given = [torch.as_tensor(g, dtype=torch.int64).view(-1, 3) for g in grids if g is not None]
    grid = torch.cat(given) if given else None
    if grid is None or not grid.numel():
        parts, grid = [], None
    return plan, {**local, "doc_id": rank_layout.doc_id.to(device),
                  "positions_in_doc": rank_layout.positions_in_doc.to(device),
                  "pixel_values": torch.cat(parts) if parts else None, "grid_thw": grid}


def check_grid(grid, name: str, merge: int) -> list[tuple[int, int, int]]:
    """``grid`` (``[n, 3]`` tensor or nested list, or None) as a list of int triples; raises
    ``ValueError`` naming the row when an entry is not a positive int or h, w do not divide by
    ``merge``."""
    if grid is None:
        return []
    rows = grid.tolist() if isinstance(grid, torch.Tensor) else list(grid)
    out = []
    for i, row in enumerate(rows):
        row = list(row) if isinstance(row, (list, tuple)) else row
        if (not isinstance(row, list) or len(row) != 3 or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in row)):
            raise ValueError(f"{name}[{i}] = {row!r} must be three positive ints (t, h, w)")
        if row[1] % merge or row[2] % merge:
            raise ValueError(f"{name}[{i}] = {row}: h and w must be multiples of the spatial "
                             f"merge size {merge} (the processor resizes images to multiples "
                             f"of patch_size * merge)")
        out.append(tuple(row))
    return out


def placeholder_runs(ids: torch.Tensor, kinds: torch.Tensor, cu: list[int]):
    """Maximal runs ``(start, stop, kind)`` of equal ``kinds`` (0 text, 1 image, 2 video),
    never crossing a document boundary."""
    cut = torch.zeros(ids.numel(), dtype=torch.bool)
    cut[0] = True
    cut[1:] = kinds[1:] != kinds[:-1]
    cut[torch.tensor(cu[:-1], dtype=torch.int64)] = True
    starts = cut.nonzero().view(-1).tolist()
    stops = [*starts[1:], ids.numel()]
    return [(a, b, int(kinds[a])) for a, b in zip(starts, stops, strict=True)]
