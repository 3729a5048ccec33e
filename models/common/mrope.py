"""The one M-RoPE position walker of the VL families, on the GLOBAL packed stream.

Layout: ``input_ids [T]`` holds documents end to end (``cu_seqlens [D+1]``); ``kinds [T]`` says
what each token is (0 text, 1 image placeholder, 2 video placeholder; each family decides it
from its ids: Qwen2-VL and Qwen3-VL by the placeholder id, GLM-4V by the open video span). A
vision item is one maximal run of placeholders of its kind that never crosses a document
boundary; :func:`vision_items` lists the runs the grids imply, in stream order: an image is one
run of ``t*h*w / m^2``; a video is one run (Qwen2-VL) or, when ``split_frames``, one run per
temporal patch of ``h*w / m^2`` (Qwen3-VL, GLM-4V: their processors put a timestamp between
frames). Results, per token: ``position_ids [3, T]`` and ``vision_rows [T]`` (row of the
tower's output, images' rows first, then videos'; -1 for text), both int64.

The rule (transformers 5.x ``get_rope_index`` of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V,
per document, restarting at 0): a text token takes the current position p on all three rows
and advances p by 1; an item with merged grid ``(t, h / m, w / m)`` starting at p takes rows
``p + floor(i_t * interval)``, ``p + i_h``, ``p + i_w`` over its grid (row-major), then p
advances by ``max(h, w) / m``. ``interval`` is 1 except for Qwen2.5-VL videos
(``tokens_per_second * second_per_grid``). Every check raises ``ValueError`` before any
compute, naming the item and the token where its run starts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mpcore.models.common.vl_split import check_grid, placeholder_runs

GRID_NAMES = {1: "image_grid_thw", 2: "video_grid_thw"}


class Item(NamedTuple):
    """One placeholder run the grids imply."""

    name: str
    """For messages: ``image 0 (grid [1, 4, 8])``, ``video 1 frame 2 (grid [4, 8, 8])``."""
    grid: tuple[int, int, int]
    """Patch grid ``(t, h, w)`` of this run (a video frame: ``t = 1``)."""
    row: int
    """Its first row of the vision tower's output."""
    interval: float = 1.0
    """Temporal position step per temporal patch."""


class VisionItems(NamedTuple):
    """The runs of each kind in stream order (``items[1]`` images, ``items[2]`` videos), how
    many grid rows each kind had, and what one run of a kind is called in messages."""

    items: dict[int, list[Item]]
    grid_rows: dict[int, int]
    labels: dict[int, str]


def vision_items(image_grid_thw, video_grid_thw, merge: int, *, split_frames: bool,
                 video_intervals: list[float] | None = None) -> VisionItems:
    """The runs of ``image_grid_thw [I, 3]`` / ``video_grid_thw [V, 3]`` (module docstring);
    ``video_intervals``: one temporal step per video (None: 1). ``ValueError`` for a grid not
    made of multiples of ``merge``."""
    images = check_grid(image_grid_thw, GRID_NAMES[1], merge)
    videos = check_grid(video_grid_thw, GRID_NAMES[2], merge)
    intervals = [1.0] * len(videos) if video_intervals is None else video_intervals
    items: dict[int, list[Item]] = {1: [], 2: []}
    row = 0
    for k, (t, h, w) in enumerate(images):
        items[1].append(Item(f"image {k} (grid {[t, h, w]})", (t, h, w), row))
        row += t * h * w // merge ** 2
    for k, (t, h, w) in enumerate(videos):
        if split_frames:
            for f in range(t):
                items[2].append(Item(f"video {k} frame {f} (grid {[t, h, w]})", (1, h, w), row))
                row += h * w // merge ** 2
        else:
            items[2].append(Item(f"video {k} (grid {[t, h, w]})", (t, h, w), row,
                                 intervals[k]))
            row += t * h * w // merge ** 2
    labels = {1: "image", 2: "video frame" if split_frames else "video"}
    return VisionItems(items, {1: len(images), 2: len(videos)}, labels)


def mrope_positions(input_ids: torch.Tensor, cu: list[int], kinds: torch.Tensor,
                    vision: VisionItems, merge: int, hint: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids [3, T], vision_rows [T])`` int64 on ``input_ids``' device (module
    docstring). ``cu``: the checked document boundaries as a list; ``kinds [T]`` on the CPU;
    ``hint``: how the family's processor lays an item out, for a run of the wrong length."""
    total = input_ids.numel()
    positions = torch.empty(3, total, dtype=torch.int64)
    rows = torch.full((total,), -1, dtype=torch.int64)
    doc_starts, used, p = set(cu[:-1]), {1: 0, 2: 0}, 0
    items, labels = vision.items, vision.labels
    for start, stop, kind in placeholder_runs(input_ids, kinds, cu) if total else []:
        if start in doc_starts:
            p = 0  # positions restart in every document
        length = stop - start
        if kind == 0:
            positions[:, start:stop] = torch.arange(p, p + length)
            p += length
            continue
        if used[kind] >= len(items[kind]):
            raise ValueError(f"the stream has more {labels[kind]} placeholder runs than "
                             f"{GRID_NAMES[kind]} gives ({len(items[kind])}); the extra run "
                             f"starts at token {start}")
        name, (t, h, w), first, interval = items[kind][used[kind]]
        expected = t * h * w // merge ** 2
        if length != expected:
            cut = stop in doc_starts and stop < total and int(kinds[stop]) == kind
            raise ValueError(f"{name} needs {expected} placeholder tokens but its run at token "
                             f"{start} has {length} (t*h*w / {merge}^2); "
                             f"{'it is cut by a document boundary' if cut else hint}")
        gt, gh, gw = torch.meshgrid((torch.arange(t) * interval).long(),
                                    torch.arange(h // merge), torch.arange(w // merge),
                                    indexing="ij")
        positions[:, start:stop] = p + torch.stack([gt, gh, gw]).reshape(3, -1)
        rows[start:stop] = first + torch.arange(length)
        used[kind] += 1
        p += max(h, w) // merge
    for kind in (1, 2):
        if used[kind] != len(items[kind]):
            raise ValueError(
                f"{GRID_NAMES[kind]} has {vision.grid_rows[kind]} rows but the stream has "
                f"{used[kind]} {labels[kind]} placeholder runs: the grids give "
                f"{len(items[kind])} {labels[kind]}s (one run per image, one per video"
                f"{' frame' if labels[2] != 'video' else ''}); give one grid row per item, in "
                f"stream order")
    return positions.to(input_ids.device), rows.to(input_ids.device)
