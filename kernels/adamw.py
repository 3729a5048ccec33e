"""AdamW's update, one Triton pass over all the parameters: decoupled weight decay,
bias-corrected moments, the gradient divided by a device scalar (the clip) and the whole update
skipped by another (a non-finite step), with no host sync.

Math, per element, in float32 (the per-step scalars come in float64-computed, rounded once):

    g  = grad / grad_scale
    p -= lr * weight_decay * p
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

which is ``torch.optim.AdamW``'s update (its fused CUDA kernel keeps some products in float64
where this one rounds to float32: the two agree to a few ulp). Nothing changes where
``found_inf`` is 1; the caller then leaves the step count as it was.

Bytes: each element's parameter, gradient and two moments are read and the parameter and
moments written, 28 bytes for fp32 state. PyTorch's fused kernel, given a ``grad_scale``, also
writes the divided gradient back in place (32 bytes: ``fused_adam_utils.cuh`` does so for
GradScaler's sake); this one leaves the gradient as it was, which the trainer discards anyway.
One launch for all the tensors, over a table of their addresses (``copy_to``: pinned, no
sync) and a cached table of which tensor and block each program updates. Full blocks go
unmasked (16-byte vector accesses where every address is 16-byte aligned, as the caching
allocator's are); only the last block of a tensor is masked. On the H200 (bench_adamw.py,
Llama-3.2-1B's 98 tensors) this ran at 8.3 ms per step against 10.4 ms for a first version
with one masked launch per tensor, and 11.7 ms for PyTorch's fused AdamW.

``adamw_step_`` runs the kernel on CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``);
``adamw_step_reference_`` is the same update in PyTorch, for every other device.
"""

from __future__ import annotations

import torch

from mpcore.kernels._triton import HAVE_TRITON, tl, triton
from mpcore.kernels.host_checked import copy_to

# Elements per program: 8 per thread at 4 warps, two 16-byte accesses per tensor. On the H200
# (bench_adamw.py) 1024 / 4 warps ran at 87% of the bytes floor, 2048 / 8 at 83%, 2048 / 4 at
# 82%, 4096 / 8 at 64%.
BLOCK = 1024
NUM_WARPS = 4
_STATE_DTYPE = torch.float32
_GRAD_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
                torch.float16: tl.float16} if HAVE_TRITON else {}
_BLOCKS_KEPT = 8  # block tables cached (one per set of tensor sizes: a run has one or two)
_blocks_cache: dict[tuple, torch.Tensor] = {}


@triton.jit
def _update(p_ptrs, g_ptrs, m_ptrs, v_ptrs, mask, MASKED: tl.constexpr, step_size, bc2_sqrt,
            lr_wd, scale, beta1, beta2, eps):
    if MASKED:
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptrs, mask=mask, other=0.0)
        m = tl.load(m_ptrs, mask=mask, other=0.0)
        v = tl.load(v_ptrs, mask=mask, other=0.0)
    else:
        g = tl.load(g_ptrs).to(tl.float32)
        p = tl.load(p_ptrs)
        m = tl.load(m_ptrs)
        v = tl.load(v_ptrs)
    g = tl.div_rn(g, scale)
    p = p - lr_wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    # IEEE square root and division, as PyTorch's (tl.sqrt and / are the approximate ones).
    p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    if MASKED:
        tl.store(p_ptrs, p, mask=mask)
        tl.store(m_ptrs, m, mask=mask)
        tl.store(v_ptrs, v, mask=mask)
    else:
        tl.store(p_ptrs, p)
        tl.store(m_ptrs, m)
        tl.store(v_ptrs, v)


@triton.jit
def _adamw_kernel(
    table_ptr, blocks_ptr, coef_ptr, scale_ptr, skip_ptr, beta1, beta2, eps,
    GRAD: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # blocks: per program [table row, first element]; table: per tensor 6 int64s, the
    # parameter's, gradient's, exp_avg's and exp_avg_sq's addresses, numel, coef row; coef
    # rows: [lr / (1 - beta1^t), sqrt(1 - beta2^t), lr * weight_decay].
    pid = tl.program_id(0).to(tl.int64)
    # A skipped step reads and writes nothing.
    if tl.load(skip_ptr) == 0:
        row = tl.load(blocks_ptr + 2 * pid)
        start = tl.multiple_of(tl.load(blocks_ptr + 2 * pid + 1), BLOCK)
        entry = table_ptr + 6 * row
        p_base = tl.load(entry).to(tl.pointer_type(tl.float32))
        g_base = tl.load(entry + 1).to(tl.pointer_type(GRAD))
        m_base = tl.load(entry + 2).to(tl.pointer_type(tl.float32))
        v_base = tl.load(entry + 3).to(tl.pointer_type(tl.float32))
        if ALIGNED:  # every address a multiple of 16 bytes (checked on the host)
            p_base = tl.multiple_of(p_base, 16)
            g_base = tl.multiple_of(g_base, 16)
            m_base = tl.multiple_of(m_base, 16)
            v_base = tl.multiple_of(v_base, 16)
        n = tl.load(entry + 4)
        coef = coef_ptr + 3 * tl.load(entry + 5)
        offs = start + tl.arange(0, BLOCK)
        p_ptrs, g_ptrs, m_ptrs, v_ptrs = p_base + offs, g_base + offs, m_base + offs, v_base + offs
        args = (tl.load(coef), tl.load(coef + 1), tl.load(coef + 2), tl.load(scale_ptr),
                beta1, beta2, eps)
        if start + BLOCK <= n:  # a full block: unmasked, so 16-byte vector accesses
            _update(p_ptrs, g_ptrs, m_ptrs, v_ptrs, offs < n, False, *args)
        else:
            _update(p_ptrs, g_ptrs, m_ptrs, v_ptrs, offs < n, True, *args)


def step_coefficients(steps: list[torch.Tensor], lr: float | torch.Tensor, beta1: float,
                      beta2: float, weight_decay: float) -> torch.Tensor:
    """``[P, 3]`` float32 on the steps' device: per parameter ``lr / (1 - beta1^t)``,
    ``sqrt(1 - beta2^t)`` and ``lr * weight_decay``, computed in float64 from the (already
    incremented) step counts ``t``; a handful of small kernels, no host sync."""
    t = torch.stack([s.reshape(()) for s in steps]).double()
    if isinstance(lr, torch.Tensor):
        lr = lr.to(t.device, torch.float64)
    # A Python lr stays a scalar operand: a tensor made of it would be copied to the device
    # from pageable memory, which waits for the device (a sync per step).
    step_size = lr / (1.0 - torch.pow(beta1, t))
    bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, t))
    lr_wd = torch.zeros_like(t) + lr * weight_decay
    return torch.stack([step_size, bc2_sqrt, lr_wd], dim=1).float()


def _check(params, grads, exp_avgs, exp_avg_sqs):
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError("adamw_step_: params, grads, exp_avgs and exp_avg_sqs must be lists of "
                         "one length")
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if p.dtype != _STATE_DTYPE or m.dtype != _STATE_DTYPE or v.dtype != _STATE_DTYPE:
            raise ValueError(f"adamw_step_ updates float32 parameters and moments (master "
                             f"weights); got {p.dtype}, {m.dtype}, {v.dtype}: use "
                             f"optimizer.backend=torch for other dtypes")
        if g.dtype not in _GRAD_DTYPES or not (p.shape == g.shape == m.shape == v.shape):
            raise ValueError(f"adamw_step_: a gradient of {g.dtype} {tuple(g.shape)} for a "
                             f"parameter of {tuple(p.shape)}")
        if not all(t.is_contiguous() for t in (p, g, m, v)):
            raise ValueError("adamw_step_ needs contiguous parameters, gradients and moments")


def _blocks(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[programs, 2]`` int64 on ``device``: each program's table row and first element, for
    tensors of ``numels`` (cached: a model's sizes do not change between steps)."""
    key = (numels, BLOCK, device)
    if key not in _blocks_cache:
        if len(_blocks_cache) >= _BLOCKS_KEPT:  # the oldest goes
            del _blocks_cache[next(iter(_blocks_cache))]
        counts = torch.tensor([triton.cdiv(n, BLOCK) for n in numels])
        rows = torch.repeat_interleave(torch.arange(len(numels)), counts)
        first = torch.cat([torch.arange(c) * BLOCK for c in counts.tolist()])
        _blocks_cache[key] = torch.stack([rows, first], dim=1).to(device)  # once per run
    return _blocks_cache[key]


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor],
                exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                coefs: torch.Tensor, grad_scale: torch.Tensor, found_inf: torch.Tensor,
                beta1: float, beta2: float, eps: float) -> None:
    """The update (module docstring) in place: one Triton launch for all the tensors (per
    gradient dtype), over a table of their addresses. ``coefs``: :func:`step_coefficients`;
    ``grad_scale`` and ``found_inf``: float32 scalars on the parameters' device."""
    _check(params, grads, exp_avgs, exp_avg_sqs)
    if not params:
        return
    device = params[0].device
    scale = grad_scale.reshape(1).float()
    skip = found_inf.reshape(1).float()
    launches: dict[tuple, list[tuple[int, list[int]]]] = {}
    for i, tensors in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        n = tensors[0].numel()
        if n == 0:
            continue
        addresses = [t.data_ptr() for t in tensors]
        key = (tensors[1].dtype, all(a % 16 == 0 for a in addresses))
        launches.setdefault(key, []).append((n, [*addresses, n, i]))
    for (grad_dtype, aligned), entries in launches.items():
        blocks = _blocks(tuple(n for n, _ in entries), device)
        table = copy_to(torch.tensor([entry for _, entry in entries], dtype=torch.int64), device)
        _adamw_kernel[(blocks.shape[0],)](
            table, blocks, coefs, scale, skip, beta1, beta2, eps, GRAD=_GRAD_DTYPES[grad_dtype],
            ALIGNED=aligned, BLOCK=BLOCK, num_warps=NUM_WARPS)


def adamw_step_reference_(params: list[torch.Tensor], grads: list[torch.Tensor],
                          exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                          coefs: torch.Tensor, grad_scale: torch.Tensor, found_inf: torch.Tensor,
                          beta1: float, beta2: float, eps: float) -> None:
    """:func:`adamw_step_` in PyTorch (any device, float32 math; float64 state in float64).
    Skipping costs no sync: the new values are selected against the old ones on the device."""
    keep = found_inf.reshape(()) == 0
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        step_size, bc2_sqrt, lr_wd = coefs[i].to(p.dtype).unbind()
        g = g.to(p.dtype) / grad_scale.to(p.dtype)
        new_p = p - lr_wd * p
        new_m = beta1 * m + (1.0 - beta1) * g
        new_v = beta2 * v + (1.0 - beta2) * g * g
        new_p = new_p - step_size * new_m / (new_v.sqrt() / bc2_sqrt + eps)
        p.copy_(torch.where(keep, new_p, p))
        m.copy_(torch.where(keep, new_m, m))
        v.copy_(torch.where(keep, new_v, v))
