"""Loss reduction: the mean over the valid labels of a whole step, across dp x cp ranks.

The convention (DESIGN.md, Batches), used by every training path:

    loss = (sum of per-token losses at valid labels, over every micro-batch of the step on
            every rank of the dp x cp group) / N
    N    = number of valid labels in that same set.

What is all-reduced: N only, once per step, as an int64 SUM over the dp_cp group
(:func:`global_valid_count`). Each rank then scales its local sums by 1/N:

    share(rank, micro_batch) = sum(valid local per-token losses of the micro-batch) / N

The shares add up, over micro-batches and ranks, to the global mean; so do their gradients.
Gradients must therefore be SUMMED over dp x cp. DDP and FSDP *average* over their W = dp * cp
ranks, so backpropagate ``W * share`` under them (equivalently, divide N by W). There is no
cp_size factor anywhere else: a cp rank is simply another holder of part of the tokens. TP ranks
hold identical per-token losses (vocab-parallel cross entropy returns the full loss on every tp
rank); tp is not part of the group.

Valid labels: ``labels != ignore_index`` for integer labels, or a bool mask ``[same shape]``.
Per-token losses at invalid positions are replaced by 0 (``torch.where``: a NaN there cannot
leak). A step without any valid label has loss 0 (N is clamped to 1).

Gradient accumulation under DDP/FSDP over ``state.dp_cp_group``:

    n = global_valid_count([mb["labels"] for mb in micro_batches], state.dp_cp_group)
    logged = torch.zeros(())
    for mb in micro_batches:
        share = loss_share(per_token_loss(mb), mb["labels"], n)       # no communication
        (share * group_size(state.dp_cp_group)).backward()
        logged = logged + share.detach()
    step_loss = sum_over_group(logged, state.dp_cp_group)             # the global mean
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mpcore.parallel.collectives import reduce_from_tp
from mpcore.parallel.state import ProcessGroup, group_size

__all__ = ["global_mean_loss", "global_valid_count", "loss_share", "sum_over_group",
           "valid_mask"]


def valid_mask(labels_or_valid_mask: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Bool mask of valid labels: a bool tensor as is, integer labels ``!= ignore_index``."""
    if not isinstance(labels_or_valid_mask, torch.Tensor):
        raise ValueError(f"labels must be a torch.Tensor, got "
                         f"{type(labels_or_valid_mask).__name__}")
    if labels_or_valid_mask.dtype == torch.bool:
        return labels_or_valid_mask
    if labels_or_valid_mask.is_floating_point() or labels_or_valid_mask.is_complex():
        raise ValueError(f"labels must be integer labels or a bool valid mask, got dtype "
                         f"{labels_or_valid_mask.dtype}; pass labels (int64) or (weights > 0)")
    return labels_or_valid_mask != ignore_index


def sum_over_group(value: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """SUM all-reduce of a copy of ``value`` over ``group`` (identity for a world of one)."""
    out = value.detach().clone()
    if group_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def global_valid_count(labels_or_masks: torch.Tensor | Sequence[torch.Tensor],
                       group: ProcessGroup | None, ignore_index: int = -100) -> torch.Tensor:
    """N: valid labels of all given micro-batches, summed over ``group`` (dp_cp) in ONE all-reduce.

    ``labels_or_masks``: one tensor or a sequence of them (this rank's micro-batches of the
    step, local shards). Returns an int64 scalar on their device, identical on every rank.
    """
    tensors = [labels_or_masks] if isinstance(labels_or_masks, torch.Tensor) else list(
        labels_or_masks)
    if not tensors:
        raise ValueError("no labels given; pass this rank's labels of every micro-batch")
    count = sum(valid_mask(t, ignore_index).sum(dtype=torch.int64) for t in tensors)
    return sum_over_group(count, group)


def loss_share(per_token_loss: torch.Tensor, labels_or_valid_mask: torch.Tensor,
               global_count: torch.Tensor | int, ignore_index: int = -100) -> torch.Tensor:
    """This rank's share of the global mean: sum of valid local losses / ``global_count``.

    ``per_token_loss`` and ``labels_or_valid_mask`` must have the same shape (any, e.g.
    ``[T_local]``); nothing is broadcast or truncated. Differentiable; no communication.
    """
    valid = valid_mask(labels_or_valid_mask, ignore_index)
    if not isinstance(per_token_loss, torch.Tensor) or per_token_loss.shape != valid.shape:
        shape = getattr(per_token_loss, "shape", None)
        raise ValueError(f"per_token_loss has shape {tuple(shape) if shape else shape} but the "
                         f"labels have shape {tuple(valid.shape)}; compute one loss per local "
                         f"label (split labels with the same ContextPlan as the hidden states)")
    if not per_token_loss.is_floating_point():
        raise ValueError(f"per_token_loss must be floating point, got {per_token_loss.dtype}")
    count = torch.as_tensor(global_count, device=per_token_loss.device).clamp(min=1)
    masked = torch.where(valid, per_token_loss, torch.zeros_like(per_token_loss))
    return masked.sum() / count.to(per_token_loss.dtype)


def global_mean_loss(per_token_loss: torch.Tensor, labels_or_valid_mask: torch.Tensor,
                     group: ProcessGroup | None, ignore_index: int = -100) -> torch.Tensor:
    """Global mean over valid labels of one micro-batch step, over ``group`` (dp_cp).

    Two SUM all-reduces of scalars: the count and the shares. The value is the global mean on
    every rank; its gradient on each rank is that of this rank's :func:`loss_share`, so sum
    gradients over ``group`` (or backpropagate ``W * loss`` under DDP/FSDP averaging over W).
    For several micro-batches use :func:`global_valid_count` and :func:`loss_share`.
    """
    count = global_valid_count(labels_or_valid_mask, group, ignore_index)
    share = loss_share(per_token_loss, labels_or_valid_mask, count, ignore_index)
    # Megatron's g over dp_cp: forward sum of the shares, backward identity (each rank keeps
    # the gradient of its own share).
    return reduce_from_tp(share, group)
