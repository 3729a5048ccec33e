"""Tensor-parallel layers (Megatron-style) with optional sequence parallelism (SP).

Layout: token-major activations ``[T, features]`` (a packed stream; a leading batch dim also
works). Under SP the activations between TP regions are split along the token dim:
``[T / tp, features]`` per rank of the tp group.

- ``ColumnParallelLinear``: weight ``[out / tp, in]``. Input replicated (f: identity forward,
  all-reduce backward) or, under SP, token-sharded and all-gathered first. Output sharded on
  the last dim, or all-gathered with ``gather_output``.
- ``RowParallelLinear``: weight ``[out, in / tp]``. Input sharded on the last dim. Output
  all-reduced (g), or reduce-scattered to token shards under SP. Bias added after the reduction.
- ``VocabParallelEmbedding``: weight ``[V_pad / tp, dim]`` with ``V_pad = ceil(V / tp) * tp``;
  rank r owns ids ``[r * V_pad / tp, (r + 1) * V_pad / tp)``; other ids are masked to zero rows
  and the partial embeddings summed over tp (all-reduce, or reduce-scatter under SP).

FP8 (``fp8="tensorwise"``, Hopper): the local matmul of the two linear layers runs its three
GEMMs in FP8 (``mpcore.kernels.fp8_linear``); the collectives around it are unchanged and move the
activations in their own dtype (bf16 under autocast), so TP, SP and CP work as they do without
it. ``"none"``: ``F.linear``.

TransformerEngine (``mpcore.parallel.te.use_te``, after the build): the same two layers run their local
GEMM through TE (bf16, or TE's FP8 recipes ``te_delayed`` / ``te_current``); the layer keeps its
parameters, collectives and checkpoint keys, only ``gemm`` (the local ``x @ W.T``) changes.

Init: ``reset_parameters(seed)`` draws the logical full weight from ``seed`` and keeps this
rank's slice, so the layer is the same function at every TP degree. Replicated parameters used
on token-sharded activations (a bias under SP) pass through ``copy_to_tp`` so their gradient is
summed over the tp group by autograd itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mpcore.kernels import host_checked
from mpcore.kernels.fp8_linear import check_fp8, fp8_linear
from mpcore.kernels.master_linear import master_linear, master_linear_applies
from mpcore.parallel.collectives import (
    copy_to_tp,
    gather_last_dim,
    reduce_from_tp,
    sp_all_gather,
    sp_reduce_scatter,
)
from mpcore.parallel.random import init_shard_, normal_init
from mpcore.parallel.state import ProcessGroup, group_rank, group_size


def divide(n: int, tp: int, what: str) -> int:
    """``n // tp``, raising ``ValueError`` naming ``what`` when it does not divide."""
    if n % tp != 0:
        raise ValueError(f"{what} = {n} is not divisible by tp = {tp}; choose a tp that divides "
                         f"{n} (or change {what})")
    return n // tp


def shard_parts(full: torch.Tensor, dim: int, parts: Sequence[int], tp: int, rank: int):
    """This rank's slice of each logical part of ``full`` along ``dim``, concatenated.

    A fused projection (``[q; k; v]`` or ``[gate; up]``) is sharded part by part so that rank r
    holds ``[q_r; k_r; v_r]``.
    """
    pieces = full.split(list(parts), dim=dim)
    return torch.cat([p.chunk(tp, dim=dim)[rank] for p in pieces], dim=dim)


Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [..., in], w [out, in]) -> y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fp8: str = "none", gemm: Gemm | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: ``gemm(x, weight)`` when given (TransformerEngine's), else
    ``F.linear``, or FP8 GEMMs when ``fp8 == "tensorwise"``. Outside ``F.linear`` the bias is
    added after, in the output dtype. Under CUDA autocast an fp32 master weight goes through
    ``mpcore.kernels.master_linear`` instead of ``F.linear``: the same bf16 GEMMs, with the weight
    gradient written in fp32 by the GEMM (no bf16 -> fp32 cast pass)."""
    if gemm is not None:
        y = gemm(x, weight)
    elif fp8 == "none":
        dtype = master_linear_applies(x, weight)
        if dtype is not None:
            return master_linear(x, weight, bias, dtype)
        return F.linear(x, weight, bias)
    else:
        y = fp8_linear(x, weight)
    return y if bias is None else y + bias.to(y.dtype)


def _check_fp8_shape(fp8: str, weight: torch.Tensor, what: str) -> None:
    check_fp8(fp8)
    check_fp8_dims(fp8, weight, what)


def check_fp8_dims(fp8: str, weight: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` when recipe ``fp8`` (ours or TransformerEngine's) cannot take the
    local ``weight``: FP8 GEMMs need both dims multiples of 16."""
    if fp8 != "none" and (weight.shape[0] % 16 or weight.shape[1] % 16):
        raise ValueError(f"fp8={fp8!r}: the FP8 GEMM needs the local weight's dims multiples of "
                         f"16, {what} has {tuple(weight.shape)} on each of the tp ranks; set "
                         f"fp8 to 'none' or change the shape")


def pad_vocab_rows(full: torch.Tensor, tp: int) -> torch.Tensor:
    """``[V, ...] -> [ceil(V / tp) * tp, ...]`` with zero rows appended (vocab padding)."""
    padded_rows = -(-full.shape[0] // tp) * tp
    return torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])])


class ColumnParallelLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` split along the output dim over ``group`` (tp).

    Args:
        in_features, out_features: logical sizes. ``out_features`` (each of ``partition_sizes``
            for fused projections) must be divisible by tp.
        partition_sizes: logical output parts sharded separately (default: one part).
        gather_output: all-gather the output to ``[T, out]`` (default: keep ``[T, out / tp]``).
        sequence_parallel: the input is ``[T / tp, in]`` and is all-gathered first.
        fp8: ``"none"`` or ``"tensorwise"`` (module docstring).
    Attribute ``gemm``: ``None`` (ours) or the local GEMM that ``mpcore.parallel.te.use_te`` sets.
    Shapes: x ``[T, in]`` (``[T / tp, in]`` under SP) -> ``[T, out / tp]`` or ``[T, out]``.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 group: ProcessGroup | None = None, gather_output: bool = False,
                 sequence_parallel: bool = False, partition_sizes: Sequence[int] | None = None,
                 init_std: float = 0.02, fp8: str = "none", device=None, dtype=None):
        super().__init__()
        self.group, self.tp, self.tp_rank = group, group_size(group), group_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.partition_sizes = list(partition_sizes or [out_features])
        if sum(self.partition_sizes) != out_features:
            raise ValueError(f"partition_sizes {self.partition_sizes} must sum to "
                             f"out_features = {out_features}")
        for size in self.partition_sizes:
            divide(size, self.tp, "ColumnParallelLinear output size")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.init_std = init_std
        local_out = out_features // self.tp
        self.weight = nn.Parameter(torch.empty(local_out, in_features, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(local_out, device=device, dtype=dtype))
                     if bias else None)
        _check_fp8_shape(fp8, self.weight, "ColumnParallelLinear")
        self.fp8 = fp8
        self.gemm: Gemm | None = None

    def reset_parameters(self, seed: int) -> None:
        take = lambda full: shard_parts(full, 0, self.partition_sizes, self.tp, self.tp_rank)  # noqa: E731
        init_shard_(self.weight, (self.out_features, self.in_features), take,
                    normal_init(self.init_std), seed)
        if self.bias is not None:
            init_shard_(self.bias, (self.out_features,), take, normal_init(self.init_std),
                        seed + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input width {x.shape[-1]} != in_features {self.in_features}")
        x = sp_all_gather(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        y = linear(x, self.weight, self.bias, self.fp8, self.gemm)
        return gather_last_dim(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp}, "
                f"sp={self.sequence_parallel}, parts={self.partition_sizes}, fp8={self.fp8}"
                + (f", gemm={self.gemm}" if self.gemm is not None else ""))


class RowParallelLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` split along the input dim over ``group`` (tp).

    The input is already split on its last dim (the output of a ColumnParallelLinear).
    Shapes: x ``[T, in / tp]`` -> ``[T, out]`` (all-reduced) or ``[T / tp, out]`` under SP
    (reduce-scattered over tokens; T must be divisible by tp). ``fp8``: as in
    ``ColumnParallelLinear``.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 group: ProcessGroup | None = None, sequence_parallel: bool = False,
                 init_std: float = 0.02, fp8: str = "none", device=None, dtype=None):
        super().__init__()
        self.group, self.tp, self.tp_rank = group, group_size(group), group_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.init_std = sequence_parallel, init_std
        local_in = divide(in_features, self.tp, "RowParallelLinear input size")
        self.weight = nn.Parameter(torch.empty(out_features, local_in, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
                     if bias else None)
        _check_fp8_shape(fp8, self.weight, "RowParallelLinear")
        self.fp8 = fp8
        self.gemm: Gemm | None = None

    def reset_parameters(self, seed: int) -> None:
        init_shard_(self.weight, (self.out_features, self.in_features),
                    lambda full: full.chunk(self.tp, dim=1)[self.tp_rank],
                    normal_init(self.init_std), seed)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"input width {x.shape[-1]} != local in_features "
                             f"{self.weight.shape[1]} (= {self.in_features} / tp {self.tp})")
        y = linear(x, self.weight, fp8=self.fp8, gemm=self.gemm)
        if self.sequence_parallel:
            y = sp_reduce_scatter(y, self.group)
            bias = copy_to_tp(self.bias, self.group) if self.bias is not None else None
        else:
            y = reduce_from_tp(y, self.group)
            bias = self.bias
        return y + bias if bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp}, "
                f"sp={self.sequence_parallel}, fp8={self.fp8}"
                + (f", gemm={self.gemm}" if self.gemm is not None else ""))


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocab split over ``group`` (tp); the vocab is padded to a multiple of tp.

    Shapes: ids ``[T]`` (any shape) int64 -> ``[T, dim]`` (all-reduced), or ``[T / tp, dim]``
    under SP (reduce-scattered over tokens).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 group: ProcessGroup | None = None, sequence_parallel: bool = False,
                 init_std: float = 0.02, device=None, dtype=None):
        super().__init__()
        self.group, self.tp, self.tp_rank = group, group_size(group), group_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_vocab = -(-num_embeddings // self.tp) * self.tp
        self.local_vocab = self.padded_vocab // self.tp
        self.vocab_start = self.tp_rank * self.local_vocab
        self.sequence_parallel, self.init_std = sequence_parallel, init_std
        self.weight = nn.Parameter(torch.empty(self.local_vocab, embedding_dim, device=device,
                                               dtype=dtype))

    def reset_parameters(self, seed: int) -> None:
        # Padding rows are zero and never looked up.
        init_shard_(self.weight, (self.num_embeddings, self.embedding_dim),
                    lambda full: pad_vocab_rows(full, self.tp).chunk(self.tp)[self.tp_rank],
                    normal_init(self.init_std), seed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"token ids must be int32/int64, got {ids.dtype}")
        if ids.numel():
            # An id outside the vocab must raise, not embed zeros. Ids that came through
            # mpcore.kernels.host_checked.to_device were measured on the host; others cost one
            # CPU-GPU sync per call here.
            lo, hi = host_checked.value_range(ids)
            if lo < 0 or hi >= self.num_embeddings:
                raise ValueError(f"token id {hi if hi >= self.num_embeddings else lo} is outside "
                                 f"the vocab [0, {self.num_embeddings}); check the tokenizer and "
                                 f"model.vocab_size")
        if self.tp == 1:
            out = F.embedding(ids, self.weight)
        else:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.local_vocab)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return sp_reduce_scatter(out, self.group)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (padded {self.padded_vocab}), "
                f"dim={self.embedding_dim}, tp={self.tp}, sp={self.sequence_parallel}")
