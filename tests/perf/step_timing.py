"""Timing helpers shared by the family benchmarks (bench_qwen35.py, bench_moe.py): a median step
time after warmup with the device synchronised around each step, the peak allocated memory, the
first and last loss; bf16 autocast and AdamW as both sides of a comparison take them; our
inputs as pretrain makes them."""

from __future__ import annotations

import statistics
import time

import torch

from mpcore.batches import place


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, steps: int, warmup: int, device: torch.device) -> dict:
    """Run ``step()`` (returns the loss as a float) ``warmup + steps`` times: the median of the
    last ``steps`` times (``step_s``), the peak allocated GiB since the start (null on CPU),
    the first and last loss."""
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        losses.append(step())
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"step_s": statistics.median(times), "peak_gib": peak, "loss_first": losses[0],
            "loss_last": losses[-1]}


def autocast(device: torch.device):
    """bf16 autocast on CUDA; off (fp32) elsewhere."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def adamw(params, device: torch.device) -> torch.optim.Optimizer:
    """AdamW at lr 1e-4, fused on CUDA."""
    return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")


def placed_inputs(family, state, ids: torch.Tensor, cfg, device: torch.device) -> dict:
    """Model inputs of one packed document ``ids`` as pretrain's step makes them
    (``mpcore.batches.local_inputs``): the family's ``local_inputs`` on the host, then placed on
    ``device`` with the host copies that the range checks and fla's chunk planning read, so
    nothing in the step asks the device."""
    ids = ids.cpu()
    _, local = family.local_inputs(state, ids, torch.tensor([0, ids.numel()]), cfg)
    return place(local, family, device)
