"""Context split and loss reduction on real gloo cp / dp x cp groups, against one-process math.

Every rank draws the same global data from fixed seeds, so the single-process reference (the
unsplit stream, float64) is computed on each rank and compared there.
"""

import torch
import torch.distributed as dist

from mpcore.parallel import (
    ContextPlan,
    LabelShifter,
    global_mean_loss,
    global_valid_count,
    loss_share,
)
from mpcore.parallel.loss import sum_over_group
from mpcore.parallel.state import ParallelState, group_size
from tests.dist.harness import run_distributed

IGNORE = -100
CASES = [  # (document lengths, layout, pad_multiple)
    ([5, 1, 8, 3], "zigzag", 1),
    ([7, 2], "contiguous", 2),
    ([1], "zigzag", 2),
    ([9, 4, 6], "contiguous", 1),
    ([3, 3, 11], "zigzag", 2),
]


def _stream(seed, lengths, hidden=4):
    """Global packed stream: ids, cu_seqlens, labels with a loss mask, features [T, H]."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = int(cu[-1])
    ids = torch.randint(1, 50, (total,), generator=gen)
    labels = LabelShifter()(ids, cu, torch.rand(total, generator=gen) > 0.3)
    feats = torch.randn(total, hidden, generator=gen, dtype=torch.float64)
    return cu, ids, labels, feats


def _per_token_loss(feats, theta):
    return (feats @ theta).sin() + 2.0  # (T,), any smooth function of a shared parameter


def _check_cp(state):
    """Split on each rank, gather back, gradient of the gather, one-step global mean loss."""
    cp, rank, group = state.cp, state.cp_rank, state.cp_group
    for seed, (lengths, layout, multiple) in enumerate(CASES):
        cu, ids, labels, feats = _stream(seed, lengths)
        plan = ContextPlan(cu, None, cp, layout, multiple)
        assert torch.equal(plan.gather(plan.split(ids, rank), group), ids)
        mrope = torch.stack([ids, ids * 2, ids * 3])  # (3, T)
        assert torch.equal(plan.gather(plan.split(mrope, rank), group), mrope)

        # Gather backward: each rank gets its own tokens' gradient; ranks together cover all.
        x = feats.clone().requires_grad_()
        gathered = plan.gather(plan.split(x, rank, dim=0), group, dim=0)
        torch.testing.assert_close(gathered, feats, rtol=0, atol=0)
        weight = torch.randn(feats.shape, generator=torch.Generator().manual_seed(99),
                             dtype=torch.float64)
        (gathered * weight).sum().backward()
        mine = torch.zeros(feats.shape[0], dtype=torch.bool)
        own = plan.rank_layout(rank).global_index
        mine[own[own >= 0]] = True
        torch.testing.assert_close(x.grad[mine], weight[mine], rtol=0, atol=0)
        assert (x.grad[~mine] == 0).all()
        total_grad = sum_over_group(x.grad, group)
        torch.testing.assert_close(total_grad, weight, rtol=0, atol=0)

        # One-step global mean over the cp group, value and gradient.
        theta_ref = torch.randn(feats.shape[1], dtype=torch.float64,
                                generator=torch.Generator().manual_seed(7)).requires_grad_()
        ref = _per_token_loss(feats, theta_ref)[labels != IGNORE].sum()
        ref = ref / max(int((labels != IGNORE).sum()), 1)  # no valid label: loss 0
        ref.backward()
        theta = theta_ref.detach().clone().requires_grad_()
        local_loss = _per_token_loss(plan.split(feats, rank, dim=0), theta)
        local_labels = plan.split(labels, rank, pad_value=IGNORE)
        loss = global_mean_loss(local_loss, local_labels, group)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=0)
        loss.backward()
        torch.testing.assert_close(sum_over_group(theta.grad, group), theta_ref.grad,
                                   rtol=1e-12, atol=1e-15)


def _micro_batches(dp_rank):
    """Two micro-batches of different lengths (and so different valid counts) per dp rank."""
    return [_stream(1000 + 10 * dp_rank + k, lengths)
            for k, lengths in enumerate([[6, 9], [3, 1, 12, 5]] if dp_rank == 0
                                        else [[4], [13, 2, 7]])]


def _check_dp_cp(state):
    """dp x cp with gradient accumulation and DDP-style averaging over the dp_cp group."""
    group, world = state.dp_cp_group, group_size(state.dp_cp_group)
    theta0 = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    # Reference: every micro-batch of every dp rank, unsplit, in one process.
    theta_ref = theta0.clone().requires_grad_()
    losses = [_per_token_loss(f, theta_ref)[lab != IGNORE]
              for d in range(state.dp) for _, _, lab, f in _micro_batches(d)]
    ref = torch.cat(losses).mean()
    ref.backward()

    theta = theta0.clone().requires_grad_()
    local = []
    for cu, _, labels, feats in _micro_batches(state.dp_rank):
        plan = ContextPlan(cu, None, state.cp, "zigzag", 2)
        local.append((plan.split(feats, state.cp_rank, dim=0),
                      plan.split(labels, state.cp_rank, pad_value=IGNORE)))
    n = global_valid_count([lab for _, lab in local], group)  # the one all-reduce of N
    assert int(n) == sum(x.numel() for x in losses)
    logged, local_sum, local_count = torch.zeros((), dtype=torch.float64), 0.0, 0
    for feats, labels in local:
        share = loss_share(_per_token_loss(feats, theta), labels, n)
        (share * world).backward()  # DDP/FSDP average over W ranks: scale by W
        logged = logged + share.detach()
        local_sum += float(_per_token_loss(feats, theta0)[labels != IGNORE].sum())
        local_count += int((labels != IGNORE).sum())
    dist.all_reduce(theta.grad, group=group)
    theta.grad /= world  # what DDP does
    torch.testing.assert_close(sum_over_group(logged, group), ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(theta.grad, theta_ref.grad, rtol=1e-12, atol=1e-15)
    # The field bug (a mean per rank, then averaged over ranks) gives another number here, so
    # the check above can tell them apart.
    assert local_count > 0
    naive = sum_over_group(torch.tensor(local_sum / local_count), group) / world
    assert abs(float(naive) - float(ref.detach())) > 1e-3


def _run(rank, world):
    _check_cp(ParallelState.build(cp=4))
    state = ParallelState.build(cp=2, dp=2)
    _check_cp(state)  # cp = 2, two cp groups side by side
    _check_dp_cp(state)
    return True


def test_cp4_cp2_and_dp2_cp2():
    assert run_distributed(_run, 4) == [True] * 4
