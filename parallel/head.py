"""Vocab-parallel output head: per-token loss, log-probs/entropy, or (for tests) logits.

Layout: ``hidden [L, H]`` replicated over the tp group (under SP the caller all-gathers the
token shards first), ``weight [V_pad / tp, H]``: rank r holds vocab rows
``[r * V_pad / tp, (r + 1) * V_pad / tp)``, rows at or past the true vocab are zero padding that
never enters the softmax. Labels ``[L]`` are global vocab ids, shifted before any split, or
``ignore_index``. The ``[L, V]`` logits are never built except for ``output="logits"``.

The fused kernels return this rank's PARTIAL gradient of ``hidden`` (its vocab shard's share);
the caller feeds them ``hidden`` through ``copy_to_tp`` (or ``sp_all_gather``, whose backward
reduce-scatters) so the partial gradients are summed over the tp group.
"""

from __future__ import annotations

import torch
from torch import nn

from mpcore.kernels.linear_cross_entropy import linear_cross_entropy, linear_logprobs
from mpcore.parallel.layers import pad_vocab_rows
from mpcore.parallel.random import init_shard_, normal_init
from mpcore.parallel.state import ProcessGroup, group_rank, group_size

OUTPUTS = ("loss", "loss_sum", "logprobs", "logits")


class OutputWeight(nn.Module):
    """The untied head's weight ``[V_pad / tp, H]`` (the tied model uses the embedding's)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, group: ProcessGroup | None,
                 init_std: float = 0.02, device=None, dtype=None):
        super().__init__()
        self.tp, self.tp_rank = group_size(group), group_rank(group)
        self.vocab_size, self.hidden_size, self.init_std = vocab_size, hidden_size, init_std
        local = -(-vocab_size // self.tp)
        self.weight = nn.Parameter(torch.empty(local, hidden_size, device=device, dtype=dtype))

    def reset_parameters(self, seed: int) -> None:
        init_shard_(self.weight, (self.vocab_size, self.hidden_size),
                    lambda full: pad_vocab_rows(full, self.tp).chunk(self.tp)[self.tp_rank],
                    normal_init(self.init_std), seed)


def head_forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None, *,
                 output: str, vocab_size: int, group: ProcessGroup | None,
                 temperature: float = 1.0, ignore_index: int = -100):
    """Per-token outputs of ``hidden [L, H]`` (see module docstring; group: tp).

    ``output="loss"``: fp32 ``[L]`` cross entropy, 0 where ``labels == ignore_index``.
    ``output="loss_sum"``: fp32 scalar, the sum of that over the L tokens (training).
    ``output="logprobs"``: ``(logprobs [L], entropy [L])`` fp32; logprob 0 where ignored.
    ``output="logits"``: ``[L, V_pad / tp]`` in ``hidden``'s dtype, divided by ``temperature``.
    """
    # Under autocast the loss kernels run their GEMMs in the autocast dtype (bf16), as the
    # logits matmul here does.
    if output == "logits":
        return (hidden @ weight.t()) / temperature
    if labels is None:
        raise ValueError(f"output={output!r} needs labels [L] (shifted next-token ids from "
                         f"LabelShifter, split like the input ids)")
    if output in ("loss", "loss_sum"):
        # "loss_sum" takes the kernels' fast path: with a scalar upstream gradient they compute
        # the gradients inside the forward (3 GEMMs) instead of recomputing logits (4 GEMMs).
        return linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index,
                                    reduction="none" if output == "loss" else "sum",
                                    temperature=temperature, vocab_size=vocab_size, group=group)
    return linear_logprobs(hidden, weight, labels, temperature=temperature,
                           vocab_size=vocab_size, group=group, ignore_index=ignore_index)
