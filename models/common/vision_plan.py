"""Host-side plan of one vision forward: attention segments, rotary positions, window order.

Layout of ``pixel_values [N, patch_dim]`` (as the Qwen2-VL image processor writes it): image by
image (rows of ``grid_thw``), frame by frame, then merged unit by merged unit, row-major over
the ``(h / m, w / m)`` grid of units (m = ``spatial_merge_size``), and inside a unit its
``m x m`` patches row-major. So patch rows come in groups of ``m^2`` (one group per output
token), and patch ``(i, j)`` of unit ``(a, b)`` sits at (h, w) position ``(a*m + i, b*m + j)``:
the rotary positions. Every frame attends to itself only (segments of ``h * w`` rows).

Qwen2.5-VL window attention: each frame's unit grid is cut into windows of
``ws = window_size // m // patch_size`` units a side (the last row and column of windows may be
partial). Before the blocks, units (groups of ``m^2`` rows, with their rotary rows) are put in
window order: image, frame, window row, window column, then row-major inside the window. The
window blocks attend inside each window, the ``fullatt_block_indexes`` blocks inside each frame
(a frame's rows stay contiguous in window order, so the frame segments are unchanged), and the
merged output rows go back to the original unit order at the end.

Everything here runs on the CPU from ``grid_thw.tolist()`` (a CPU-GPU sync point when
``grid_thw`` lives on the GPU: pass it on the CPU to avoid it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpcore.models.common.vl_split import check_grid


@dataclass(frozen=True)
class VisionPlan:
    """Host (CPU) tensors describing one batch of images for the tower (module docstring)."""

    grid: tuple[tuple[int, int, int], ...]
    """``(t, h, w)`` per image, in patches."""
    num_patches: int
    """``N = sum(t * h * w)``: rows of ``pixel_values``."""
    positions: torch.Tensor
    """``[N, 2]`` int64 (h, w) rotary position of each row, in the order the blocks see rows."""
    frame_cu: torch.Tensor
    """``[frames + 1]`` int32 cumulative frame lengths (full-attention segments)."""
    max_frame: int
    """Longest frame segment."""
    window_cu: torch.Tensor | None
    """``[windows + 1]`` int32 cumulative window lengths in rows (Qwen2.5-VL), else None."""
    max_window: int
    """Longest window segment (0 without windows)."""
    row_order: torch.Tensor | None
    """``[N]`` int64: block row k is input row ``row_order[k]`` (None: identity)."""
    unit_inverse: torch.Tensor | None
    """``[N / m^2]`` int64: output token u is merged row ``unit_inverse[u]`` (None: identity)."""


def _positions(t: int, h: int, w: int, m: int) -> torch.Tensor:
    """``[t*h*w, 2]`` (h, w) positions of one image's rows in processor order."""
    gh, gw = h // m, w // m
    hh = torch.arange(gh).view(gh, 1, 1, 1) * m + torch.arange(m).view(1, 1, m, 1)
    ww = torch.arange(gw).view(1, gw, 1, 1) * m + torch.arange(m).view(1, 1, 1, m)
    hh, ww = torch.broadcast_tensors(hh, ww)  # (gh, gw, m, m) each
    return torch.stack([hh, ww], dim=-1).reshape(-1, 2).repeat(t, 1)


def _windows(t: int, gh: int, gw: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's units in window order (``[t*gh*gw]`` int64 unit ids) and the window sizes
    in units (every window is non-empty: the window grid is ``ceil(g / ws)`` a side)."""
    nh, nw = -(-gh // ws), -(-gw // ws)
    f = torch.arange(t).view(t, 1, 1)
    a = torch.arange(gh).view(1, gh, 1) // ws
    b = torch.arange(gw).view(1, 1, gw) // ws
    window = ((f * nh + a) * nw + b).flatten()  # window id of each unit, units in order
    # A stable sort by window id keeps row-major order inside each window.
    order = torch.sort(window, stable=True).indices
    return order, torch.bincount(window, minlength=t * nh * nw)


def _cumulative(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu.to(torch.int32)


def plan_vision(cfg, grid_thw) -> VisionPlan:
    """The plan of images ``grid_thw`` (``mpcore.models.common.vl_split.check_grid``) for a tower of
    ``cfg`` (a vision config: ``spatial_merge_size``, ``merge_unit``, ``arch`` and, for
    qwen2_5_vl, ``window_units``)."""
    grid = tuple(check_grid(grid_thw, "grid_thw", cfg.spatial_merge_size))
    m, unit = cfg.spatial_merge_size, cfg.merge_unit
    num = sum(t * h * w for t, h, w in grid)
    positions = torch.cat([_positions(*g, m) for g in grid]) if grid else torch.zeros(
        0, 2, dtype=torch.int64)
    frame_lengths = [h * w for t, h, w in grid for _ in range(t)]
    frame_cu = _cumulative(frame_lengths)
    max_frame = max(frame_lengths, default=0)
    if cfg.arch != "qwen2_5_vl":
        return VisionPlan(grid, num, positions, frame_cu, max_frame, None, 0, None, None)
    orders, sizes, offset = [], [], 0
    for t, h, w in grid:
        order, size = _windows(t, h // m, w // m, cfg.window_units)
        orders.append(order + offset)
        sizes.append(size)
        offset += t * (h // m) * (w // m)
    unit_order = torch.cat(orders) if grid else torch.zeros(0, dtype=torch.int64)
    window_lengths = (torch.cat(sizes) * unit).tolist() if grid else []
    row_order = (unit_order[:, None] * unit + torch.arange(unit)).flatten()
    return VisionPlan(grid, num, positions[row_order], frame_cu, max_frame,
                      _cumulative(window_lengths), max(window_lengths, default=0), row_order,
                      torch.argsort(unit_order))
