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

import operator

import torch

from mpcore.parallel.context import ContextPlan, split_batch
from mpcore.parallel.state import ParallelState


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
                        pad_values={"vision_rows": -1, "mtp_vision_rows": -1})
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
    """``grid`` (int ``[n, 3]`` tensor or nested list of ``(t, h, w)``, or None) as a list of
    int triples. Raises ``ValueError`` naming the fix for a tensor that is not integer or not
    ``[n, 3]``, a row that is not three positive ints, or h, w that do not divide by ``merge``
    (``tolist`` is a CPU-GPU sync point when ``grid`` lives on the GPU: pass it on the CPU)."""
    if grid is None:
        return []
    if isinstance(grid, torch.Tensor):
        if grid.is_floating_point() or grid.is_complex() or grid.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers (int64), got {grid.dtype}")
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(f"{name} must be [num_images, 3] rows of (t, h, w), got shape "
                             f"{tuple(grid.shape)}")
    rows = grid.tolist() if isinstance(grid, torch.Tensor) else list(grid)
    out = []
    for i, row in enumerate(rows):
        row = list(row) if isinstance(row, (list, tuple)) else row
        try:
            if not isinstance(row, list) or len(row) != 3 or any(
                    isinstance(v, bool) for v in row):
                raise TypeError
            t, h, w = (operator.index(v) for v in row)
        except TypeError:
            t = h = w = 0
        if min(t, h, w) < 1:
            raise ValueError(f"{name}[{i}] = {row!r} must be three positive ints (t, h, w): "
                             f"patch counts")
        if h % merge or w % merge:
            raise ValueError(f"{name}[{i}] = {row}: h and w must be multiples of the spatial "
                             f"merge size {merge} (the processor resizes images to multiples "
                             f"of patch_size * merge)")
        out.append((t, h, w))
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
