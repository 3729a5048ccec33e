"""Every collective mapping, forward and backward, against the math on the full tensors."""

import torch

import mpcore.parallel.collectives as C
from tests.dist.harness import run_distributed


def _same(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check(name, got, want):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


def _collectives(rank, world):
    group = torch.distributed.new_group(list(range(world)))
    per_rank = [_same(100 + r, 4 * world, 3 * world) for r in range(world)]  # (T, F) per rank
    grads = [_same(200 + r, 4 * world, 3 * world) for r in range(world)]
    full = _same(1, 4 * world, 3 * world)

    # f: identity forward, all-reduce backward.
    x = per_rank[rank].clone().requires_grad_()
    y = C.copy_to_tp(x, group)
    y.backward(grads[rank])
    _check("f fwd", y, per_rank[rank])
    _check("f bwd", x.grad, sum(grads))

    # g: all-reduce forward, identity backward.
    x = per_rank[rank].clone().requires_grad_()
    y = C.reduce_from_tp(x, group)
    y.backward(grads[rank])
    _check("g fwd", y, sum(per_rank))
    _check("g bwd", x.grad, grads[rank])

    # Last-dim gather / scatter.
    x = full.chunk(world, dim=-1)[rank].clone().requires_grad_()
    y = C.gather_last_dim(x, group)
    y.backward(grads[0])
    _check("gather fwd", y, full)
    _check("gather bwd", x.grad, grads[0].chunk(world, dim=-1)[rank])

    x = full.clone().requires_grad_()
    y = C.scatter_last_dim(x, group)
    y.backward(grads[rank].chunk(world, dim=-1)[rank])
    _check("scatter fwd", y, full.chunk(world, dim=-1)[rank])
    _check("scatter bwd", x.grad,
           torch.cat([grads[r].chunk(world, dim=-1)[r] for r in range(world)], dim=-1))

    # SP along tokens.
    x = full.clone().requires_grad_()
    y = C.sp_scatter(x, group)
    y.backward(grads[rank].chunk(world)[rank])
    _check("sp_scatter fwd", y, full.chunk(world)[rank])
    _check("sp_scatter bwd", x.grad, torch.cat([grads[r].chunk(world)[r] for r in range(world)]))

    x = full.chunk(world)[rank].clone().requires_grad_()
    y = C.sp_all_gather(x, group)
    y.backward(grads[rank])
    _check("sp_all_gather fwd", y, full)
    _check("sp_all_gather bwd", x.grad, sum(grads).chunk(world)[rank])

    x = full.chunk(world)[rank].clone().requires_grad_()
    y = C.sp_gather(x, group)
    y.backward(grads[0])
    _check("sp_gather fwd", y, full)
    _check("sp_gather bwd", x.grad, grads[0].chunk(world)[rank])

    x = per_rank[rank].clone().requires_grad_()
    y = C.sp_reduce_scatter(x, group)
    y.backward(grads[rank].chunk(world)[rank])
    _check("sp_reduce_scatter fwd", y, sum(per_rank).chunk(world)[rank])
    _check("sp_reduce_scatter bwd", x.grad,
           torch.cat([grads[r].chunk(world)[r] for r in range(world)]))

    # Ulysses all-to-all: tokens sharded -> heads sharded, and back.
    tokens = _same(2, 3 * world, 2 * world, 5)  # (T, H, D)
    head_grads = [_same(300 + r, 3 * world, 2, 5) for r in range(world)]  # (T, H/cp, D)
    x = tokens.chunk(world)[rank].clone().requires_grad_()
    y = C.all_to_all_tokens_to_heads(x, group)
    y.backward(head_grads[rank])
    _check("a2a fwd", y, tokens.chunk(world, dim=1)[rank])
    want = torch.cat([head_grads[j].chunk(world)[rank] for j in range(world)], dim=1)
    _check("a2a bwd", x.grad, want)

    x = tokens.chunk(world)[rank].clone().requires_grad_()
    back = C.all_to_all_heads_to_tokens(C.all_to_all_tokens_to_heads(x, group), group)
    g = _same(400 + rank, *back.shape)
    back.backward(g)
    _check("a2a round trip", back, x.detach())
    _check("a2a round trip bwd", x.grad, g)
    return True


def test_collectives_match_math():
    for world in (2, 4):
        assert all(run_distributed(_collectives, world))


def test_world_of_one_is_identity():
    x = torch.randn(4, 6)
    for fn in (C.copy_to_tp, C.reduce_from_tp, C.gather_last_dim, C.scatter_last_dim,
               C.sp_scatter, C.sp_all_gather, C.sp_reduce_scatter):
        assert fn(x, None) is x
    assert C.all_to_all_tokens_to_heads(x.view(4, 2, 3), None).shape == (4, 2, 3)


def _indivisible(rank, world):
    group = torch.distributed.group.WORLD
    try:
        C.sp_reduce_scatter(torch.randn(5, 3), group)
    except ValueError as e:
        return "not divisible by the group size 2" in str(e)
    return False


def test_indivisible_token_dim_raises():
    assert all(run_distributed(_indivisible, 2))
