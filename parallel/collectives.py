"""Collectives with autograd: Megatron's f/g mappings, SP along the token dim, Ulysses all-to-all.

Layout: packed token streams, token dim 0 (``[T, ...]``); hidden/feature dim last. Each mapping
is an autograd Function whose docstring states its forward and backward; the backward of each
is the adjoint of its forward, so a chain of them differentiates exactly. ``group=None`` (or a
group of one, or no torch.distributed) makes every mapping the identity.

Names: ``tp``-group mappings (f, g, last-dim gather/scatter, SP token-dim ops) and the ``cp``-group
all-to-all are the same code; the caller passes the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpcore.parallel.state import ProcessGroup, group_rank, group_size

# torch 2.13 renamed the tensor collectives; torch 2.11 (the GPU machine) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> None:
    if x.shape[dim] % world != 0:
        raise ValueError(
            f"{what}: dim {dim} of shape {tuple(x.shape)} is not divisible by the group size "
            f"{world}; pad the token stream (or the feature dim) to a multiple of {world}")


def all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over ``group`` (no autograd); returns a new tensor."""
    if group_size(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)  # one copy, contiguous
    dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's equal slice along ``dim`` (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "reduce_scatter")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)


def split(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim`` (no communication, no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "split")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int,
               group: ProcessGroup | None) -> torch.Tensor:
    """Split ``x`` into ``world`` pieces along ``scatter_dim``, send piece j to rank j, and
    concatenate the received pieces along ``gather_dim`` in rank order (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, scatter_dim, world, "all_to_all")
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()  # (world, ...piece)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f. forward: identity; backward: all-reduce (sum) over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g. forward: all-reduce (sum) over the group; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Mapping(torch.autograd.Function):
    """forward: ``forward_op(x, dim, group)``; backward: ``backward_op(grad, dim, group)``, its
    adjoint. Each public mapping below names its pair (all-gather/split, split/all-gather,
    all-gather/reduce-scatter, reduce-scatter/all-gather)."""

    @staticmethod
    def forward(ctx, x, dim, group, forward_op, backward_op):
        ctx.dim, ctx.group, ctx.backward_op = dim, group, backward_op
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all scattering ``scatter_dim`` and gathering ``gather_dim``;
    backward: the inverse all-to-all (scatter ``gather_dim``, gather ``scatter_dim``)."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """f: forward identity, backward all-reduce over ``group`` (input of a column-parallel op)."""
    return x if group_size(group) == 1 else _CopyToParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """g: forward all-reduce over ``group``, backward identity (output of a row-parallel op)."""
    return x if group_size(group) == 1 else _ReduceFromParallel.apply(x, group)


def gather_along(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Forward all-gather along ``dim`` in rank order, backward keep this rank's slice: for a
    result that every rank of ``group`` then uses identically."""
    return x if group_size(group) == 1 else _Mapping.apply(x, dim % x.dim(), group, all_gather, split)


def gather_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[..., F/tp] -> [..., F]``: forward all-gather on the last dim, backward split."""
    return gather_along(x, -1, group)


def scatter_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[..., F] -> [..., F/tp]``: forward keep this rank's slice, backward all-gather."""
    return x if group_size(group) == 1 else _Mapping.apply(x, x.dim() - 1, group, split, all_gather)


def sp_scatter(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[T, ...] -> [T/tp, ...]``: forward keep this rank's token slice, backward all-gather."""
    return x if group_size(group) == 1 else _Mapping.apply(x, 0, group, split, all_gather)


def sp_all_gather(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[T/tp, ...] -> [T, ...]``: forward all-gather tokens, backward reduce-scatter."""
    return x if group_size(group) == 1 else _Mapping.apply(x, 0, group, all_gather, reduce_scatter)


def sp_gather(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[T/tp, ...] -> [T, ...]``: forward all-gather tokens, backward keep own slice. For
    outputs that each rank then uses identically (e.g. a replicated final result)."""
    return gather_along(x, 0, group)


def sp_reduce_scatter(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[T, ...] -> [T/tp, ...]``: forward sum over the group and keep this rank's tokens,
    backward all-gather tokens (output of a row-parallel op under SP)."""
    return x if group_size(group) == 1 else _Mapping.apply(x, 0, group, reduce_scatter, all_gather)


def all_to_all_tokens_to_heads(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Ulysses: ``[T_local, H, D] -> [T_local * cp, H / cp, D]``. The gathered tokens are in
    rank order (rank 0's local tokens first). Backward: the inverse all-to-all."""
    if x.dim() != 3:
        raise ValueError(f"expected [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    return x if group_size(group) == 1 else _AllToAll.apply(x, 1, 0, group)


def all_to_all_heads_to_tokens(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Ulysses inverse: ``[T_local * cp, H / cp, D] -> [T_local, H, D]``. Backward: the
    forward all-to-all."""
    if x.dim() != 3:
        raise ValueError(f"expected [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    return x if group_size(group) == 1 else _AllToAll.apply(x, 0, 1, group)
