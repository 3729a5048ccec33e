"""Integer tensors whose value range the host already knows, so no layer asks the device again.

The embedding and the loss heads must raise on an id outside the vocab (a CUDA gather would
fault, a vocab-parallel one would read zeros), and asking the device for ``min``/``max`` costs
a CPU-GPU sync per call: the GPU drains and waits while the host catches up. A batch is on the
host before it moves to the device, where the same check is free. ``to_device`` takes the
range there and records it against the device tensor; ``known_range`` gives it back to the
layers, which then check it without a sync; ``host_copy`` gives back the host tensor itself
for small ones whose values the host reads (``cu_seqlens``). The record is weak (it goes with
the tensor) and holds the version counters, so a tensor changed in place is asked again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary


class _Record(NamedTuple):
    lo: int  # range of the entries other than ignore (lo > hi: none)
    hi: int
    ignore: int | None
    version: int  # the device tensor's version counter when recorded
    host: torch.Tensor | None  # the host tensor kept (None: the tensor itself, or not kept)
    kept: bool
    host_version: int


_known = WeakIdKeyDictionary()  # device tensor -> _Record


def to_device(t: torch.Tensor, device: torch.device, *, ignore: int | None = None,
              non_blocking: bool = False, keep_host: bool = False) -> torch.Tensor:
    """``t`` (an integer tensor on the host) on ``device``, with its range over the entries
    other than ``ignore`` recorded. ``lo > hi`` records that every entry is ``ignore``.
    ``keep_host``: also keep ``t`` itself (for small tensors whose values the host reads, such
    as ``cu_seqlens``; see :func:`host_copy`)."""
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.device.type != "cpu":
        raise ValueError(f"to_device takes an integer tensor on the host, got {t.dtype} on "
                         f"{t.device}")
    kept = t if ignore is None else t[t != ignore]
    lo, hi = (int(kept.min()), int(kept.max())) if kept.numel() else (0, -1)
    out = t.to(device, non_blocking=non_blocking)
    # A record never holds its own key (out is t on the host): the entry would never go.
    host = None if not keep_host or out is t else t
    _known[out] = _Record(lo, hi, ignore, out._version, host, keep_host, t._version)
    return out


def copy_to(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without a CPU-GPU sync. A host tensor bound for CUDA goes through
    pinned memory and an asynchronous copy: a plain copy from pageable memory waits for the
    stream to drain first, so the GPU idles while the host catches up. The pinned block is
    the caching host allocator's, which holds it until the copy has run. Anything else is
    ``t.to(device)``."""
    if t.device.type != "cpu" or torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def known_range(t: torch.Tensor, ignore: int | None = None) -> tuple[int, int] | None:
    """``(lo, hi)`` of ``t``'s entries other than ``ignore`` when the host recorded it (with
    the same ``ignore``) and ``t`` was not changed in place since, else None."""
    r = _known.get(t)
    if r is None or r.ignore != ignore or r.version != t._version:
        return None
    return r.lo, r.hi


def value_range(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of non-empty ``t``: the range recorded on the host by :func:`to_device`
    (no ignore value), else measured on the device (a CPU-GPU sync when ``t`` is on a GPU)."""
    known = known_range(t)
    if known is not None:
        return known
    lo, hi = torch.stack([t.min(), t.max()]).tolist()
    return int(lo), int(hi)


def host_values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values on the host: the copy :func:`to_device` kept (``keep_host``), else ``t``
    copied from its device (a CPU-GPU sync when ``t`` is on a GPU)."""
    host = host_copy(t)
    return host if host is not None else t.cpu()


def host_copy(t: torch.Tensor) -> torch.Tensor | None:
    """The host tensor ``t`` was copied from by ``to_device(keep_host=True)``, when neither
    was changed in place since (the same values, readable without a sync), else None."""
    r = _known.get(t)
    if r is None or not r.kept or r.version != t._version:
        return None
    host = t if r.host is None else r.host
    return host if host._version == r.host_version else None
