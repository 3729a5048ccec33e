"""The load-balancing loss as a GLOBAL statistic of the step (and the router z-loss).

transformers (``load_balancing_loss_func``, Switch Transformer eq. 4-6) pools every MoE layer's
router rows of the batch: with L layers, N real tokens, p_lte the router probability of token
t for expert e in layer l and c_le the number of top-k slots of layer l given to expert e,

    f_e = (sum_l c_le) / (L N)            fraction of rows routed to e (sums to k)
    P_e = (sum_l sum_t p_lte) / (L N)     mean router probability of e
    aux = E * sum_e f_e * P_e

and the training loss is ``ce_mean + router_aux_loss_coef * aux``.

Global version. Every sum above runs over every token of the step: all micro-batches, all
dp x cp ranks (tp ranks hold the same tokens and are not counted again; ep does not change
which rank routes a token). With ``C_e = sum over the step of c`` (detached), ``R = L N`` the
rows of the step and ``S_e`` the step's probability sum, aux = E * sum_e C_e S_e / R^2. Each
rank and micro-batch backpropagates its share

    share = E * sum_e C_e * S_e(this micro-batch, this rank) / R^2

(``aux_share``): the shares add up to aux and so do their gradients, under the project's
convention that gradients are SUMMED over dp x cp (``mpcore.parallel.loss``). For one process on the
whole batch, C, S and R are exactly transformers' sums, so share == aux there.

C and R must be the step's, not the micro-batch's: with one micro-batch per step they are
known after the forward (``global_counts`` all-reduces them over dp x cp, one [E + 1] SUM);
with gradient accumulation the trainer runs a counting forward of the step's micro-batches
first (no grad), because the gradient of micro-batch 1 depends on the loads of micro-batch 2.
An average of per-rank or per-micro-batch ``aux`` values is a different function (the MoE twin
of averaging per-rank mean losses); ``tests/dist/test_qwen3_moe_dist.py`` shows it fails.

Router z-loss (optional, ``router_z_loss_coef``): the mean over the same rows of
``logsumexp(logits)^2``; its share is ``z_sum / R``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from mpcore.models.common.moe import RouterStats
from mpcore.parallel.state import ProcessGroup


def pool_layers(stats: Iterable[RouterStats]) -> RouterStats:
    """The sum over MoE layers of their forwards' statistics (transformers pools layers)."""
    stats = list(stats)
    assert stats, "no MoE layer ran"
    return RouterStats(sum(s.counts for s in stats), sum(s.prob_sum for s in stats),
                       sum(s.tokens for s in stats), sum(s.z_sum for s in stats),
                       sum(s.dropped for s in stats))


def global_counts(stats: Iterable[RouterStats], group: ProcessGroup | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C [E], R ())``: the expert loads and rows of every given micro-batch's pooled stats,
    summed over ``group`` (dp x cp). Collective; detached."""
    stats = list(stats)
    packed = torch.cat([sum(s.counts for s in stats), sum(s.tokens for s in stats)[None]])
    packed = packed.detach().clone()
    if group is not None and dist.is_initialized():
        dist.all_reduce(packed, group=group)
    return packed[:-1], packed[-1]


def aux_share(stats: RouterStats, counts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step's load-balancing loss (module docstring)."""
    num_experts = counts.numel()
    rows = rows.clamp(min=1.0)
    return num_experts * (counts * stats.prob_sum).sum() / rows.square()


def z_share(stats: RouterStats, rows: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step's router z-loss."""
    return stats.z_sum / rows.clamp(min=1.0)


def load_balancing_loss(counts: torch.Tensor, prob_sum: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
    """``aux`` of the module docstring from the step's sums (e.g. to log)."""
    rows = rows.clamp(min=1.0)
    return counts.numel() * ((counts / rows) * (prob_sum / rows)).sum()
