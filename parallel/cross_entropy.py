"""Vocab-parallel cross-entropy on materialised logits: the plain-PyTorch reference.

Layout: ``logits [N, V_local]`` on each rank of the tp group, rank r holding global vocab
columns ``[r * V_local, (r + 1) * V_local)``; ``labels [N]`` global ids (already shifted by the
LabelShifter) or ``ignore_index``. Columns at or past ``vocab_size`` are padding (the vocab
padded to a multiple of tp) and are excluded from the softmax.

Forward (fp32): local row max -> all-reduce MAX; local sum of exp(z - max) and the target
logit (only the owning rank contributes) -> one all-reduce SUM of both. Loss = log(sum) + max -
target. Backward needs no communication: d loss / d z = softmax - onehot, local columns only.

The fused Triton head (``mpcore.kernels.linear_cross_entropy``) computes the same thing without
materialising logits; this reference exists for tests and small models.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpcore.parallel.state import ProcessGroup, group_rank, group_size


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_size, ignore_index, group):
        tp, rank = group_size(group), group_rank(group)
        n, v_local = logits.shape
        z = logits.float()
        start = rank * v_local
        pad_cols = max(0, start + v_local - vocab_size)
        if pad_cols:
            z = z.clone()
            z[:, v_local - pad_cols:] = float("-inf")
        row_max = z.max(dim=1).values
        if tp > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = torch.exp(z - row_max.unsqueeze(1))  # (N, V_local); padding columns are 0
        valid = labels != ignore_index
        local = labels - start
        mine = valid & (local >= 0) & (local < v_local)
        idx = local.clamp(0, v_local - 1).unsqueeze(1)
        target = torch.where(mine, z.gather(1, idx).squeeze(1), 0.0)
        stats = torch.stack([exp.sum(dim=1), target])  # (2, N)
        if tp > 1:
            dist.all_reduce(stats, group=group)
        sum_exp, target = stats
        loss = torch.where(valid, torch.log(sum_exp) + row_max - target, 0.0)
        ctx.save_for_backward(exp, sum_exp, idx, mine, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, idx, mine, valid = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(1)
        grad.scatter_add_(1, idx, -mine.to(grad.dtype).unsqueeze(1))
        grad *= (grad_loss * valid).unsqueeze(1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *,
                                 vocab_size: int | None = None, ignore_index: int = -100,
                                 group: ProcessGroup | None = None) -> torch.Tensor:
    """Per-token cross-entropy ``[N]`` fp32 (0 where ignored) from vocab-sharded logits.

    ``logits [N, V_local]`` (any float dtype; computed in fp32), ``labels [N]`` int64 global ids
    in ``[0, vocab_size)`` or ``ignore_index``; ``vocab_size`` defaults to ``V_local * tp``.
    Communication: two all-reduces over ``group`` (tp) in forward, none in backward.
    """
    if logits.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"expected logits [N, V_local] and labels [N], got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"logits have {logits.shape[0]} tokens but labels have "
                         f"{labels.shape[0]}; shift labels on the global stream (LabelShifter) "
                         f"and split them with the same plan as the hidden states")
    tp = group_size(group)
    padded = logits.shape[1] * tp
    vocab_size = padded if vocab_size is None else vocab_size
    if not padded - logits.shape[1] < vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} does not fit {tp} shards of "
                         f"{logits.shape[1]} columns; shards must cover the vocab with less "
                         f"than one shard of padding")
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):  # CPU-GPU sync point; this is the reference path
        raise ValueError(f"label {int(labels[bad][0])} is outside [0, {vocab_size}) and is not "
                         f"ignore_index={ignore_index}")
    return _VocabParallelCE.apply(logits, labels, vocab_size, ignore_index, group)
