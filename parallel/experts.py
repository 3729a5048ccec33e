"""Expert parallelism: token dispatch to the ranks that own the experts, and the way back.

The ``E`` experts of a MoE layer are split over the ``ep`` ranks of ``state.ep_group``
(``mpcore.parallel.state``): ep rank r owns experts ``[r * E / ep, (r + 1) * E / ep)``. Each rank
routes its own tokens (T of them, k experts each) and then:

    sort the T * k (token, expert) assignments by expert      -> x_sorted [T * k, hidden]
    all-to-all with per-rank counts (variable sizes)           -> x_recv   [R, hidden]
        (from every source rank: its rows for my experts, in expert order)
    regroup source-major -> expert-major                       -> x_grouped, counts per expert
    ... the local experts run on their row groups ...
    the inverse regroup, the inverse all-to-all                -> y_sorted [T * k, hidden]

and the caller weights ``y_sorted`` and adds it back into its tokens. Every rank joins every
all-to-all, also one that sends or receives no row. The per-expert counts travel first (one
fixed-size all-to-all of ``E`` int64), then the host needs them as split sizes: ONE device to
host copy per dispatch (send, receive and per-expert sizes in one tensor), as in Megatron's
all-to-all dispatcher; nothing after it waits for the device again (the regroup's
``repeat_interleave`` is told its output size). The autograd function's backward is the same
all-to-all with the split sizes swapped (the adjoint of a permutation of rows), so the
backward needs no sync at all. ep = 1 (no group) skips the exchange and never syncs: the
counts stay a device tensor (the grouped GEMM takes its offsets from it on the device).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from mpcore.parallel.state import ProcessGroup, group_size


class _AllToAllV(torch.autograd.Function):
    """forward: rows ``x`` split by ``send`` go to each rank, ``recv`` rows come from each;
    backward: the same exchange with the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int],
                    group: ProcessGroup | None) -> torch.Tensor:
    """Differentiable variable-size row all-to-all (``send[r]`` rows to rank r)."""
    return _AllToAllV.apply(x, send, recv, group)


class Dispatch(NamedTuple):
    """How one rank's sorted rows were sent, and how the received ones are grouped."""

    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    order: torch.Tensor | None  # received rows -> expert-major (None: ep = 1)
    counts: torch.Tensor  # [E / ep] int64 on the rows' device: rows of each local expert
    sizes: list[int] | None  # ``counts`` on the host where the dispatch had them (ep > 1)


def dispatch(x_sorted: torch.Tensor, counts: torch.Tensor, group: ProcessGroup | None
             ) -> tuple[torch.Tensor, Dispatch]:
    """Send rows ``x_sorted [N, hidden]`` (sorted by global expert, ``counts [E]`` int64 rows
    of each, on the rows' device) to the ranks owning those experts. Returns the local
    experts' rows, expert-major ``[R, hidden]``, and the plan for :func:`combine`. Collective
    over ``group`` (ep); one device to host copy at ep > 1, none at ep = 1."""
    ep = group_size(group)
    if ep == 1:
        return x_sorted, Dispatch([], [], None, counts, None)
    local = counts.numel() // ep
    recv_counts = torch.empty_like(counts)  # [source rank, local expert]
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)
    by_source = recv_counts.view(ep, local)
    per_expert = by_source.sum(0)
    # CPU-GPU sync point (the only one): the split sizes of both all-to-alls.
    host = torch.cat([counts.view(ep, local).sum(1), by_source.sum(1), per_expert]).tolist()
    send, recv, sizes = host[:ep], host[ep:2 * ep], host[2 * ep:]
    x_recv = all_to_all_rows(x_sorted, send, recv, group)
    # Segment (source s, expert e) holds by_source[s, e] rows; expert-major key e * ep + s.
    seg = torch.repeat_interleave(torch.arange(ep * local, device=counts.device),
                                  by_source.reshape(-1), output_size=sum(recv))
    key = (seg % local) * ep + seg // local
    order = torch.argsort(key, stable=True)
    return x_recv[order], Dispatch(send, recv, order, per_expert, sizes)


def combine(y_grouped: torch.Tensor, plan: Dispatch, group: ProcessGroup | None
            ) -> torch.Tensor:
    """The inverse of :func:`dispatch`: the experts' outputs back to the rows' source ranks,
    in the order of ``x_sorted``. Collective over ``group``."""
    if plan.order is None:
        return y_grouped
    return all_to_all_rows(_unpermute(y_grouped, plan.order), plan.recv, plan.send, group)


def _unpermute(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y[inverse]
