"""The vision tower's rows for the placeholders one cp rank owns, with the work spread over cp.

Every cp rank holds the whole micro-batch's vision input (``pixel_values [N, patch_dim]`` of all
items, ``grid_thw [I, 3]``: images then videos) and its own local ``vision_rows`` (the tower
output row of each local placeholder, ``-1`` for text; ``mpcore.models.qwen2_vl.inputs``). Two modes:

``split`` (default): items are assigned to cp ranks by patch count (largest first, to the least
    loaded rank; deterministic, the same on every rank without communication). Each rank runs the
    tower on its own items only; the merged rows are all-gathered over cp (padded to the largest
    share) and each rank takes the rows its placeholders need. The all-gather's backward is a
    reduce-scatter: the gradient of an item's rows is SUMMED over every rank that used them and
    lands on the rank that computed them (dropping that sum is the bug seen in the field).
``replicate``: every rank runs the tower on all items and takes its rows; nothing is exchanged.

Either way the tower's parameter gradients on a rank cover only that rank's share of the work;
they are summed over the dp x cp group like every other gradient (CP ranks are data-parallel for
the weights), which gives the single-process gradient. A rank that runs no item (or a
micro-batch without images) still calls the tower, on one dummy merge window whose output is
multiplied by zero: every rank joins every collective (tp all-reduces inside the tower, the
cp all-gather, FSDP's parameter gathers) and contributes exact zero gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from mpcore.kernels.host_checked import copy_to
from mpcore.parallel.collectives import copy_to_tp, sp_all_gather
from mpcore.parallel.state import ProcessGroup, group_rank, group_size

MODES = ("split", "replicate")


def assign_items(sizes: list[int], cp: int) -> list[int]:
    """Owner cp rank of each item: largest first, to the rank with the fewest patches so far
    (ties to the lower rank)."""
    load = [0] * cp
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(cp), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner


def _run_tower(tower: nn.Module, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]],
               merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tower(pixel_values, grids), zero)``. With no items the tower still runs, on one dummy
    ``1 x merge x merge`` window of zeros: no rows come back, and ``zero`` (0 times its output)
    ties every parameter to the loss."""
    if grids:
        out = tower(pixel_values, torch.tensor(grids, dtype=torch.int64))
        return out, out.new_zeros(())
    dummy = pixel_values.new_zeros(merge * merge, pixel_values.shape[1])
    out = tower(dummy, torch.tensor([[1, merge, merge]], dtype=torch.int64))  # (1, H)
    return out[:0], 0 * out.sum()


def vision_rows_for_rank(tower: nn.Module, pixel_values: torch.Tensor,
                         grid_thw: list[tuple[int, int, int]], needed: torch.Tensor, *,
                         merge: int, mode: str, cp_group: ProcessGroup | None,
                         sum_grad_group: ProcessGroup | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [n, H], zero)``: the tower output rows ``needed [n]`` (int64 indices into
    the concatenated merged rows of all items), and a scalar 0 tied to every tower parameter
    (add it to the loss path so ranks that need nothing still backprop through the tower).
    ``pixel_values [N, patch_dim]`` (``N = 0`` when there are no items).

    ``sum_grad_group``: the tp group under sequence parallelism, where each tp rank selects the
    rows of its own token slice: the full rows then pass ``copy_to_tp`` (backward: all-reduce),
    so the tower, replicated over tp, receives the same summed gradient on every tp rank.

    Collective over ``cp_group`` in ``split`` mode (and over the tower's tp group always): every
    cp rank must call it, also with ``needed`` empty.
    """
    if mode not in MODES:
        raise ValueError(f"vision cp mode must be one of {MODES}, got {mode!r}")
    patches = [t * h * w for t, h, w in grid_thw]
    cp = group_size(cp_group)
    if mode == "replicate" or cp == 1:
        out, zero = _run_tower(tower, pixel_values, grid_thw, merge)  # (R, H)
        return copy_to_tp(out, sum_grad_group).index_select(0, needed), zero
    owner = assign_items(patches, cp)
    rank = group_rank(cp_group)
    pix_start = [0]
    for n in patches:
        pix_start.append(pix_start[-1] + n)
    mine = [i for i in range(len(patches)) if owner[i] == rank]
    local_pixels = (torch.cat([pixel_values[pix_start[i]:pix_start[i + 1]] for i in mine])
                    if mine else pixel_values)
    out, zero = _run_tower(tower, local_pixels, [grid_thw[i] for i in mine], merge)  # (R_r, H)
    rows = [n // merge ** 2 for n in patches]
    share = [sum(rows[i] for i in range(len(rows)) if owner[i] == r) for r in range(cp)]
    width = max(share)
    if width == 0:  # no item anywhere: nothing to exchange
        return out, zero
    padded = torch.cat([out, out.new_zeros(width - out.shape[0], out.shape[1])])
    gathered = sp_all_gather(padded, cp_group)  # (cp * width, H); backward: reduce-scatter
    gathered = copy_to_tp(gathered, sum_grad_group)
    # Global merged row g of item i at offset o lives at owner(i) * width + (rows of the
    # owner's earlier items) + o.
    where, seen = [], [0] * cp
    for i, n in enumerate(rows):
        base = owner[i] * width + seen[owner[i]]
        where.extend(range(base, base + n))
        seen[owner[i]] += n
    # Built on the host, copied without a CPU-GPU sync.
    index = copy_to(torch.tensor(where, dtype=torch.int64), needed.device)
    return gathered.index_select(0, index.index_select(0, needed)), zero
