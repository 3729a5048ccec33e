"""The sparse mixture-of-experts block: router, top-k, SwiGLU experts, optional shared expert.

Layout: ``x [T, hidden]``, the tokens of this rank (replicated over tp: every tp rank routes
and computes the same tokens; experts are not tp-sharded). Per token t:

    p_t   = softmax(x_t @ gate.T)                      [E] fp32 (router probabilities)
    top-k experts K_t of p_t, weights w_te = p_te (divided by sum_{K_t} p when norm_topk_prob)
    y_t   = sum_{e in K_t} w_te * expert_e(x_t)         expert_e(x) = down_e(silu(g_e x) * u_e x)
          (+ sigmoid(x_t . shared_gate) * shared(x_t) with a shared expert: Qwen2/3.5-MoE)

Dropless: every token reaches its k experts (no capacity, so ``dropped`` is always 0).
Experts: the ``E`` of the layer split over the ep group (``mpcore.parallel.experts``): ep rank r holds
``w13 [E / ep, 2 * I, hidden]`` (gate rows then up rows, transformers 5.x's ``gate_up_proj``)
and ``w2 [E / ep, hidden, I]``. Rows are sorted by expert; the reference then runs one matmul
pair per local expert, ``grouped`` two grouped GEMMs for all of them (``torch._grouped_mm``,
detected at run time; ``auto`` takes it on CUDA). Host syncs: at ep = 1 the grouped path has
none, forward or backward (the per-expert counts stay a device tensor and the GEMMs take their
offsets from it); the loop copies the counts to the host once per layer forward; at ep > 1 the
dispatch copies its split sizes once (``mpcore.parallel.experts``) and both paths reuse them.

Each forward leaves ``last_stats`` (``RouterStats``, over the tokens where ``token_mask`` is
true: padding excluded) for the load-balancing loss (``mpcore.models.common.moe_loss``) and the
trainer's metrics (tokens per expert, dropped tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mpcore.parallel.experts import combine, dispatch
from mpcore.parallel.random import init_shard_, normal_init
from mpcore.parallel.state import ProcessGroup, group_rank, group_size


class RouterStats(NamedTuple):
    """One forward's routing statistics over its real tokens (sums, so they add up)."""

    counts: torch.Tensor  # [E] fp32, detached: top-k assignments per expert (the load)
    prob_sum: torch.Tensor  # [E] fp32, differentiable: router probabilities summed over tokens
    tokens: torch.Tensor  # () fp32: tokens routed (rows of the statistic)
    z_sum: torch.Tensor  # () fp32, differentiable: sum of logsumexp(logits)^2 (router z-loss)
    dropped: int  # tokens that did not reach all their k experts (0: dropless)


def swiglu_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   counts: list[int]) -> torch.Tensor:
    """Rows ``x [N, hidden]`` grouped by local expert (``counts[e]`` rows each) through their
    expert's SwiGLU: ``[N, hidden]``. The reference: one matmul pair per expert."""
    outs = []
    for e, rows in zip(range(w13.shape[0]), x.split(counts), strict=True):
        gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, w2[e]))
    return torch.cat(outs) if outs else x.new_zeros(x.shape)


EXPERT_BACKENDS = ("auto", "reference", "grouped")


GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what _grouped_mm takes


def _grouped_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the grouped GEMM runs in: autocast's where it is on (``grouped_swiglu_experts``
    casts to it), else ``x``'s."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def grouped_available(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` (PyTorch's grouped GEMM, 2.8+) takes these operands: it
    exists in this torch, the dtype it would run in (``_grouped_dtype``) is one it takes (not
    float64: a float64 model runs the loop) and every row stride in that dtype is a multiple
    of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    dtype = _grouped_dtype(x)
    if dtype not in GROUPED_DTYPES:
        return False
    size = dtype.itemsize
    return all(n * size % 16 == 0 for n in (w13.shape[-1], w13.shape[-2], w2.shape[-1]))


def grouped_swiglu_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           counts: torch.Tensor | list[int]) -> torch.Tensor:
    """``swiglu_experts`` with two grouped GEMMs (``torch._grouped_mm``, one launch each for
    all local experts; its own backward) instead of a loop. ``counts``: ``[E_local]`` int64
    on ``x``'s device, so the group offsets are a cumsum on the device and nothing waits for
    it (a list is copied there first). Under autocast the operands are cast to its dtype as
    ``F.linear`` would be (autocast does not cast ``_grouped_mm``)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = _grouped_dtype(x)
        x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(counts, device=x.device)
    offs = counts.cumsum(0).to(torch.int32)  # [E_local] end row of each expert's group
    h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)  # [N, 2I]
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(-2, -1), offs=offs)


def run_experts(x, w13, w2, counts: torch.Tensor | list[int], backend: str = "auto",
                sizes: list[int] | None = None) -> torch.Tensor:
    """The local experts on their grouped rows: ``grouped`` (PyTorch's grouped GEMM),
    ``reference`` (the loop), or ``auto``: grouped on CUDA where this torch has it, else the
    reference (CPU runs the reference). ``counts``: rows of each local expert, ``[E_local]``
    int64 on ``x``'s device (or a list); ``sizes``: the same on the host where the caller
    already has them. The grouped path keeps the counts on the device; the loop needs them
    on the host (a device to host copy unless ``sizes`` is given)."""
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"experts backend must be one of {EXPERT_BACKENDS}, got {backend!r}")
    use = backend == "grouped" or (backend == "auto" and x.is_cuda)
    if use and grouped_available(x, w13, w2):
        return grouped_swiglu_experts(x, w13, w2, counts)
    if backend == "grouped" and x.shape[0]:
        raise ValueError("experts backend 'grouped' needs torch._grouped_mm (PyTorch 2.8+), "
                         f"operands in {[str(d) for d in GROUPED_DTYPES]} (these run in "
                         f"{_grouped_dtype(x)}) and 16-byte aligned expert widths; use 'auto' "
                         "or 'reference'")
    if sizes is None:
        sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    return swiglu_experts(x, w13, w2, sizes)


class _Weights(nn.Module):
    """A plain holder of named parameters (initialised by the block that owns it)."""

    def __init__(self, **shapes):
        super().__init__()
        kw = shapes.pop("kw")
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, **kw)))


class Experts(_Weights):
    """The local experts' ``w13`` and ``w2``; a module of its own whose forward runs them, so
    FSDP2 can shard it over the expert-data-parallel group (its hooks fire on the call)."""

    def __init__(self, local: int, hidden: int, intermediate: int, backend: str, kw: dict):
        super().__init__(w13=(local, 2 * intermediate, hidden),
                         w2=(local, hidden, intermediate), kw=kw)
        self.backend = backend

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                sizes: list[int] | None = None) -> torch.Tensor:
        """``run_experts`` on this module's weights and backend."""
        return run_experts(x, self.w13, self.w2, counts, self.backend, sizes)


def expert_param_names(model: nn.Module) -> set[str]:
    """Names (as ``model.named_parameters`` gives them) of the expert weights: the tensors
    split on dim 0 over the ep group (each ``Experts`` module's ``w13`` and ``w2``)."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() if isinstance(module, Experts)
            for name, _ in module.named_parameters(recurse=False)}


class MoeBlock(nn.Module):
    """The block of the module docstring. ``ep_group``: the ranks splitting the experts (None:
    all here); ``shared_intermediate``: width of a shared expert gated by
    ``sigmoid(shared_expert_gate)`` (None: none)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, *,
                 norm_topk_prob: bool, ep_group: ProcessGroup | None = None,
                 shared_intermediate: int | None = None, init_std: float = 0.02,
                 experts_backend: str = "auto", device=None, dtype=None):
        super().__init__()
        ep = group_size(ep_group)
        if num_experts % ep:
            raise ValueError(f"num_experts {num_experts} is not divisible by ep {ep}; choose an "
                             f"ep that divides {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts = "
                             f"{num_experts}]")
        if experts_backend not in EXPERT_BACKENDS:
            raise ValueError(f"experts backend must be one of {EXPERT_BACKENDS}, got "
                             f"{experts_backend!r}")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.experts_backend = experts_backend
        self.ep_group, self.ep, self.ep_rank = ep_group, ep, group_rank(ep_group)
        self.hidden, self.intermediate, self.init_std = hidden, intermediate, init_std
        local = num_experts // ep
        kw = dict(device=device, dtype=dtype)
        self.gate = _Weights(weight=(num_experts, hidden), kw=kw)  # router (replicated)
        self.experts = Experts(local, hidden, intermediate, experts_backend, kw)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate is not None:
            self.shared_expert = _Weights(w13=(2 * shared_intermediate, hidden),
                                          w2=(hidden, shared_intermediate), kw=kw)
            self.shared_expert_gate = _Weights(weight=(1, hidden), kw=kw)
        self.token_mask: torch.Tensor | None = None  # set per forward by the model (padding)
        self.last_stats: RouterStats | None = None

    def reset_parameters(self, seed: int) -> None:
        """Logical full tensors from ``seed`` (the same function at any ep), this rank's slice."""
        local = self.num_experts // self.ep
        take = lambda full: full[self.ep_rank * local:(self.ep_rank + 1) * local]  # noqa: E731
        init = normal_init(self.init_std)
        whole = lambda full: full  # noqa: E731
        init_shard_(self.gate.weight, tuple(self.gate.weight.shape), whole, init, seed)
        init_shard_(self.experts.w13, (self.num_experts, *self.experts.w13.shape[1:]), take,
                    init, seed + 1)
        init_shard_(self.experts.w2, (self.num_experts, *self.experts.w2.shape[1:]), take,
                    init, seed + 2)
        if self.shared_expert is not None:
            for i, p in enumerate((self.shared_expert.w13, self.shared_expert.w2,
                                   self.shared_expert_gate.weight)):
                init_shard_(p, tuple(p.shape), whole, init, seed + 3 + i)

    def route(self, x: torch.Tensor):
        """``(logits [T, E], probs [T, E] fp32, weights [T, k], experts [T, k])``."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; sets ``last_stats``."""
        logits, probs, weights, experts = self.route(x)
        flat = experts.reshape(-1)  # [T * k], token-major
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        # [E] rows per expert; not bincount, which reads its input's max on the host on CUDA.
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        grouped, plan = dispatch(x[token_of], counts, self.ep_group)
        y_grouped = self.experts(grouped, plan.counts, plan.sizes)
        y_sorted = combine(y_grouped, plan, self.ep_group)
        y_sorted = y_sorted * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add(0, token_of, y_sorted.to(x.dtype))
        if self.shared_expert is not None:
            gate, up = F.linear(x, self.shared_expert.w13).chunk(2, dim=-1)
            shared = F.linear(F.silu(gate) * up, self.shared_expert.w2)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
        self.last_stats = self._stats(logits, probs, flat)
        return out

    def _stats(self, logits, probs, flat) -> RouterStats:
        mask = self.token_mask
        keep = (torch.ones(probs.shape[0], device=probs.device) if mask is None
                else mask.to(probs.dtype))
        assert keep.shape == probs.shape[:1], (keep.shape, probs.shape)
        per_assignment = keep[:, None].expand(-1, self.top_k).reshape(-1)  # [T * k]
        counts = torch.zeros(self.num_experts, device=probs.device).index_add(
            0, flat, per_assignment).detach()
        z = torch.logsumexp(logits.float(), dim=-1).square()
        return RouterStats(counts, (probs * keep[:, None]).sum(0), keep.sum().detach(),
                           (z * keep).sum(), 0)
