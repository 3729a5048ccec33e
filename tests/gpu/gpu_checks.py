"""Checks shared by the GPU tests (``tests/conftest.py`` skips them without CUDA): a norm-wise
relative error, and code whose second run makes no CPU-GPU sync."""

from __future__ import annotations

from collections.abc import Callable

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms) in float64; 0 when both are 0."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def second_run_never_syncs(run: Callable[[], torch.Tensor],
                           reset: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, second)``: ``run()`` once unchecked (a first call compiles Triton kernels and
    builds cuDNN graphs, which may sync), ``reset()`` (gradients back to zero), then ``run()``
    again under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing
    call. The caller compares the two results."""
    first = run()
    reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return first, second
