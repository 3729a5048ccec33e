"""AdamW's update, one Triton pass per parameter: decoupled weight decay, bias-corrected moments,
the gradient divided by a device scalar (the clip) and the whole update skipped by another (a
non-finite step), with no host sync.

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
One launch per parameter (a model's few hundred tensors cost well under a millisecond of host
time, while its device time is the bandwidth's).

``adamw_step_`` runs the kernel on CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``);
``adamw_step_reference_`` is the same update in PyTorch, for every other device.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton

BLOCK = 2048  # elements per program: 8 per thread at 8 warps, two 16-byte accesses per tensor
NUM_WARPS = 8
_STATE_DTYPE = torch.float32
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, scale_ptr, skip_ptr, n, beta1, beta2, eps,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # coef: this parameter's [lr / (1 - beta1^t), sqrt(1 - beta2^t), lr * weight_decay].
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # A skipped step masks every access off: nothing is read or written.
    keep = tl.full([BLOCK], 0.0, tl.float32) + tl.load(skip_ptr) == 0.0
    mask = (offs < n) & keep
    step_size = tl.load(coef_ptr)
    bc2_sqrt = tl.load(coef_ptr + 1)
    lr_wd = tl.load(coef_ptr + 2)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(scale_ptr)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p - lr_wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def step_coefficients(steps: list[torch.Tensor], lr: float | torch.Tensor, beta1: float,
                      beta2: float, weight_decay: float) -> torch.Tensor:
    """``[P, 3]`` float32 on the steps' device: per parameter ``lr / (1 - beta1^t)``,
    ``sqrt(1 - beta2^t)`` and ``lr * weight_decay``, computed in float64 from the (already
    incremented) step counts ``t``; a handful of small kernels, no host sync."""
    t = torch.stack([s.reshape(()) for s in steps]).double()
    lr = torch.as_tensor(lr, dtype=torch.float64, device=t.device)
    step_size = lr / (1.0 - torch.pow(beta1, t))
    bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, t))
    return torch.stack([step_size, bc2_sqrt, (lr * weight_decay).expand_as(t)], dim=1).float()


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


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor],
                exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                coefs: torch.Tensor, grad_scale: torch.Tensor, found_inf: torch.Tensor,
                beta1: float, beta2: float, eps: float) -> None:
    """The update (module docstring) in place, one Triton launch per parameter. ``coefs``:
    :func:`step_coefficients`; ``grad_scale`` and ``found_inf``: float32 scalars on the
    parameters' device."""
    _check(params, grads, exp_avgs, exp_avg_sqs)
    scale = grad_scale.reshape(1).float()
    skip = found_inf.reshape(1).float()
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        n = p.numel()
        if n == 0:
            continue
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            p, g, m, v, coefs[i], scale, skip, n, beta1, beta2, eps, BLOCK=BLOCK,
            num_warps=NUM_WARPS)


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
