"""Integer tensors whose value range the host already knows, so no layer asks the device again.

The embedding and the loss heads must raise on an id outside the vocab (a CUDA gather would
fault, a vocab-parallel one would read zeros), and asking the device for ``min``/``max`` costs
a CPU-GPU sync per call: the GPU drains and waits while the host catches up. A batch is on the
host before it moves to the device, where the same check is free. ``to_device`` takes the
range there and records it against the device tensor; ``known_range`` gives it back to the
layers, which then check it without a sync. The record is weak (it goes with the tensor) and
holds the tensor's version counter, so a tensor changed in place is checked on the device again.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

_known = WeakIdKeyDictionary()  # tensor -> (lo, hi, ignore, version)


def to_device(t: torch.Tensor, device: torch.device, *, ignore: int | None = None,
              non_blocking: bool = False) -> torch.Tensor:
    """``t`` (an integer tensor on the host) on ``device``, with its range over the entries
    other than ``ignore`` recorded. ``lo > hi`` records that every entry is ``ignore``."""
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_cuda:
        raise ValueError(f"to_device takes an integer tensor on the host, got {t.dtype} on "
                         f"{t.device}")
    kept = t if ignore is None else t[t != ignore]
    lo, hi = (int(kept.min()), int(kept.max())) if kept.numel() else (0, -1)
    out = t.to(device, non_blocking=non_blocking)
    _known[out] = (lo, hi, ignore, out._version)
    return out


def known_range(t: torch.Tensor, ignore: int | None = None) -> tuple[int, int] | None:
    """``(lo, hi)`` of ``t``'s entries other than ``ignore`` when the host recorded it (with
    the same ``ignore``) and ``t`` was not changed in place since, else None."""
    entry = _known.get(t)
    if entry is None or entry[2] != ignore or entry[3] != t._version:
        return None
    return entry[0], entry[1]
