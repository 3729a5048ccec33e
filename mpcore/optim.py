"""AdamW, the learning-rate schedule, and gradient clipping by the true global norm.

Parameters are fp32 (master weights); on CUDA the forward runs under bf16 autocast. AdamW is
PyTorch's (``fused=True`` on CUDA), ours in Triton (:class:`TritonAdamW`, the same update with
less memory traffic) or apex's FusedAdam (``mpcore.backends``); weight decay applies to tensors
with 2 or more dims (matrices, embeddings), not to norms and biases.

Global gradient norm. A parameter is held as a tp shard (``mpcore.logical``: pieces of HF
tensors), possibly further sharded on dim 0 over dp x cp by FSDP2 (a DTensor), or replicated
over dp x cp by DDP. Every logical element must be counted once:

    norm^2 = sum over ranks R of sum_p sum_i w_p[i] * g_p[i]^2

with ``w = 1 / (tp ranks holding the element)`` (``LogicalLayout.norm_weight``) and R = the tp
group (gradients replicated over dp x cp) or the whole world (FSDP: each dp x cp rank holds a
disjoint dim-0 slice). One all-gather of one fp32 scalar per rank per step, summed in rank order
(bit-reproducible across runs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from mpcore.backends import adam_backend, apex_fused_adam
from mpcore.config import Config
from mpcore.kernels.adamw import adamw_step_, adamw_step_reference_, step_coefficients
from mpcore.logical import LogicalLayout
from mpcore.parallel.collectives import all_gather
from mpcore.parallel.state import ProcessGroup, group_size


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2 shard), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def build_optimizer(model: nn.Module, cfg: Config, device_type: str) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters (after any FSDP2/DDP wrapping); lr set per step."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    opt = cfg.optimizer
    groups = [{"params": decay, "weight_decay": opt.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps)
    backend = adam_backend(opt.backend, device_type)
    if backend == "apex":
        return apex_fused_adam()(groups, adam_w_mode=True, **kwargs)
    if backend == "triton":
        return TritonAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, fused=device_type == "cuda" or None, **kwargs)


class TritonAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay) whose step is ``mpcore.kernels.adamw``: one
    Triton pass over all the parameters of a group that reads each parameter, gradient and
    moment once and writes the parameter and moments (28 bytes per fp32 element; PyTorch's
    fused step also writes the divided gradient back, 32). Like PyTorch's fused step it reads
    ``grad_scale`` (every gradient is divided by it) and ``found_inf`` (1: nothing changes, the
    step counts stay) from attributes set before :meth:`step`, so clipping and skipping need no
    host sync.

    Its state and ``state_dict`` are AdamW's (``step``, ``exp_avg``, ``exp_avg_sq`` per
    parameter, the step a float32 scalar on the parameter's device), so checkpoints move freely
    between this and ``optimizer.backend=torch``. Off CUDA the same update runs in PyTorch
    (``adamw_step_reference_``). ``amsgrad``, ``maximize`` and ``differentiable`` are not
    supported; parameters and moments are float32."""

    def __init__(self, params, **kwargs):
        for flag in ("amsgrad", "maximize", "differentiable", "fused", "foreach", "capturable"):
            if kwargs.get(flag):
                raise ValueError(f"TritonAdamW does not support {flag}=True; use "
                                 f"optimizer.backend=torch (torch.optim.AdamW) for it")
        super().__init__(params, foreach=False, fused=False, **kwargs)
        self._scalars: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _defaults(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``grad_scale`` 1 and ``found_inf`` 0 on ``device``, for a step without them."""
        if device not in self._scalars:
            self._scalars[device] = (torch.ones((), device=device),
                                     torch.zeros((), device=device))
        return self._scalars[device]

    def _group_tensors(self, group: dict) -> tuple[list[torch.Tensor], ...]:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError("TritonAdamW does not support sparse gradients")
            state = self.state[p]
            local = _local(p)
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != local.device:  # loaded from a CPU state dict
                state["step"] = state["step"].to(local.device, torch.float32)
            params.append(local)
            grads.append(_local(p.grad).contiguous())
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        return params, grads, exp_avgs, exp_avg_sqs, steps

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = self._group_tensors(group)
            if not params:
                continue
            device = params[0].device
            if any(t.device != device for t in params):
                raise ValueError("TritonAdamW: a parameter group spans devices; keep one "
                                 "device per group")
            scale_one, no_inf = self._defaults(device)
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
            grad_scale = scale_one if grad_scale is None else grad_scale.to(device)
            found_inf = no_inf if found_inf is None else found_inf.to(device)
            torch._foreach_add_(steps, 1)
            beta1, beta2 = (float(b) for b in group["betas"])
            coefs = step_coefficients(steps, group["lr"], beta1, beta2, group["weight_decay"])
            update = adamw_step_ if device.type == "cuda" else adamw_step_reference_
            update(params, grads, exp_avgs, exp_avg_sqs, coefs, grad_scale, found_inf, beta1,
                   beta2, group["eps"])
            if found_inf is not no_inf:
                torch._foreach_sub_(steps, [found_inf.reshape(())] * len(steps))
        return loss


def decides_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can skip and clip an update without the host: PyTorch's fused
    AdamW and :class:`TritonAdamW` read two tensors at their step, ``grad_scale`` (every
    gradient is divided by it) and ``found_inf`` (1: no parameter or moment changes and the
    step counts stay), so the step needs no CPU-GPU sync to decide (``mpcore.train``)."""
    if isinstance(optimizer, TritonAdamW):
        return True
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.param_groups) and all(
        g.get("fused") for g in optimizer.param_groups)


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate of optimizer step ``step`` (1-based).

    Warmup: ``lr * step / warmup`` for ``step <= warmup`` (warmup capped at total_steps). Then cosine or linear decay from
    ``lr`` at ``warmup`` to ``min_lr_ratio * lr`` at ``total_steps``, and constant after.
    """
    base, s = cfg.optimizer.lr, cfg.schedule
    total = cfg.total_steps
    warmup = min(s.warmup_steps, total)
    if warmup and step <= warmup:
        return base * step / warmup
    if step >= total:
        return base * s.min_lr_ratio
    progress = (step - warmup) / max(total - warmup, 1)
    factor = 0.5 * (1 + math.cos(math.pi * progress)) if s.decay == "cosine" else 1 - progress
    return base * (s.min_lr_ratio + (1 - s.min_lr_ratio) * factor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _sum_in_rank_order(value: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum of a scalar over ``group`` (None: the world), added in rank order on every rank.

    An all-reduce may add the partial sums in an order that depends on the backend's algorithm
    and timing; the clipping coefficient would then differ in the last bits between two runs of
    the same seed (seen across two Slurm nodes with gloo). Gathering the few scalars and adding
    them in a fixed order makes the norm bit-reproducible for the same cost (one collective).
    """
    parts = all_gather(value.reshape(1), 0, dist.group.WORLD if group is None else group)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


class GradNorm:
    """The true global gradient norm of ``model`` (module docstring) and clipping by it.

    ``names``: parameter object id -> our parameter name (the logical layout's key).
    ``skip``: parameters left out of the norm, still clipped (a pipeline's second copy of a
    tied head's embedding).
    ``fsdp``: parameters are FSDP2 DTensors sharded on dim 0 over dp x cp (sum over the world);
    otherwise gradients are whole per tp rank (sum over ``tp_group``).
    """

    def __init__(self, model: nn.Module, names: dict[int, str], layout: LogicalLayout,
                 tp_group: ProcessGroup | None, fsdp: bool, device: torch.device,
                 skip: Iterable[nn.Parameter] = ()):
        # Every parameter is clipped; a weight another rank also holds (pipeline) is not
        # counted in the norm twice.
        self.params = [p for p in model.parameters() if p.requires_grad]
        skipped = {id(p) for p in skip}
        self.group = None if fsdp else tp_group
        self.world_reduce = fsdp
        self.device = device
        # Most parameters weigh every element the same (1, or 1/tp for replicated ones): those
        # go through one fused norm per weight value; the rest (replicated kv rows, vocab
        # padding) multiply by their per-row weights.
        self.uniform: dict[float, list[nn.Parameter]] = {}
        self.weighted: list[tuple[nn.Parameter, torch.Tensor]] = []
        for p in self.params:
            if id(p) in skipped:
                continue
            name = names[id(p)]
            w = layout.norm_weight(name)
            if bool((w == w[0]).all()):
                self.uniform.setdefault(float(w[0]), []).append(p)
                continue
            dim = layout.dim(name)
            if fsdp and dim == 0:  # this rank's dim-0 chunk, as FSDP2 shards it
                mesh = p.device_mesh
                chunks = w.chunk(mesh.size())
                rank = mesh.get_local_rank()
                w = chunks[rank] if rank < len(chunks) else w[:0]
            shape = [1] * p.dim()
            shape[dim] = -1
            self.weighted.append((p, w.view(shape).to(device)))

    def __call__(self) -> torch.Tensor:
        """fp32 scalar: the global gradient norm (one all-reduce). Missing gradients count 0."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for weight, params in self.uniform.items():
            grads = [_local(p.grad) for p in params if p.grad is not None]
            grads = [g for g in grads if g.numel()]
            if grads:
                norms = torch._foreach_norm([g.float() for g in grads])
                total = total + weight * torch.stack(norms).square().sum()
        for p, w in self.weighted:
            if p.grad is not None and _local(p.grad).numel():
                total = total + (_local(p.grad).float().square() * w).sum()
        if self.world_reduce and dist.is_initialized():
            total = _sum_in_rank_order(total, None)
        elif group_size(self.group) > 1:
            total = _sum_in_rank_order(total, self.group)
        return total.sqrt()

    @staticmethod
    def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
        """:meth:`clip_` as a divisor on the device, for a fused AdamW's ``grad_scale``:
        ``(norm + 1e-6) / max_norm`` when ``norm > max_norm`` (> 0), else 1; fp32 scalar.
        Dividing by it scales as ``clip_`` does, to fp32 rounding (``clip_`` multiplies by
        the quotient computed in float64: the two differ by a few ulp)."""
        one = torch.ones((), dtype=torch.float32, device=norm.device)
        if max_norm <= 0:
            return one
        norm = norm.float()
        return torch.where(norm > max_norm, (norm + 1e-6) / max_norm, one)

    @torch.no_grad()
    def clip_(self, norm: float, max_norm: float) -> None:
        """Scale every gradient by ``max_norm / norm`` when ``norm > max_norm`` (> 0)."""
        if max_norm <= 0 or norm <= max_norm:
            return
        coef = max_norm / (norm + 1e-6)
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        torch._foreach_mul_([g for g in grads if g.numel()], coef)
