"""TritonAdamW (``mpcore.kernels.adamw``) on CUDA against PyTorch's fused AdamW and float64 math:
several steps with weight decay, a changing learning rate, a clip divisor and a skipped step,
the gradient left as it was; a fused AdamW's state dict (as a checkpoint holds it) resumed;
the kernel against its PyTorch reference with fp32 and bf16 gradients."""

import pytest
import torch

from mpcore.kernels.adamw import adamw_step_, adamw_step_reference_, step_coefficients
from mpcore.optim import TritonAdamW

pytestmark = pytest.mark.gpu

# Ragged sizes around block multiples (1024, 2048), a Llama-1B-sized matrix, a norm weight.
SHAPES = [(3072, 2048), (2047,), (2049,), (5, 7), (1,), (2048,), (1023,)]
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
LRS = [1e-3, 8e-4, 3e-4, 5e-4, 1e-4]
SCALES = [1.0, 2.5, 1.0, 0.7, 4.0]


def _rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _params(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, device="cuda", generator=g) * 0.02).to(dtype))
            for s in SHAPES]


def _grads(step, dtype):
    g = torch.Generator(device="cuda").manual_seed(10 + step)
    return [(torch.randn(s, device="cuda", generator=g) * 10.0 ** (i % 4 - 4)).to(dtype)
            for i, s in enumerate(SHAPES)]


def _groups(params):
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _train(opt, params, skip=3, device_decides=True, steps=range(5)):
    """``steps`` (of five); step ``skip`` is non-finite. With ``device_decides`` the optimizer reads
    ``grad_scale`` and ``found_inf``; else (float64 AdamW, which has neither) the host divides
    the gradients and leaves the step out. Returns the gradients of the last step."""
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = LRS[step]
        grads = _grads(step, params[0].dtype)
        if device_decides:
            opt.grad_scale = torch.tensor(SCALES[step], device="cuda")
            opt.found_inf = torch.tensor(float(step == skip), device="cuda")
        elif step == skip:
            continue
        for p, g in zip(params, grads, strict=True):
            p.grad = g if device_decides else g / SCALES[step]
        opt.step()
    return grads


def test_matches_fused_adamw_and_float64():
    ours = _params(torch.float32)
    opt = TritonAdamW(_groups(ours), **HYPER)
    last = _train(opt, ours)
    fused = _params(torch.float32)
    _train(torch.optim.AdamW(_groups(fused), fused=True, **HYPER), fused)
    exact = _params(torch.float64)
    _train(torch.optim.AdamW(_groups(exact), foreach=False, **HYPER), exact,
           device_decides=False)
    start = _params(torch.float32)
    for i, (a, b, c, s) in enumerate(zip(ours, fused, exact, start, strict=True)):
        assert _rel_err(a, b) < 1e-6, f"param {i} vs fused"
        assert _rel_err(a, c) < 1e-6, f"param {i} vs float64"
        assert _rel_err(a, s) > 1e-6, f"param {i} did not move"
        assert opt.state[a]["step"].item() == 4 and opt.state[a]["step"].is_cuda
        assert torch.equal(a.grad, last[i]), "the gradient is not the optimizer's to change"


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_on_cuda(grad_dtype):
    """fp32 and bf16 gradients (a kernel caller may pass either), ragged sizes."""
    shapes = [(4096 * 3 + 5,), (2048,), (33, 65)]
    g = torch.Generator(device="cuda").manual_seed(3)
    state = [[torch.randn(s, device="cuda", generator=g) for s in shapes] for _ in range(3)]
    state[2] = [v.abs() for v in state[2]]
    runs = [[[t.clone() for t in part] for part in state] for _ in range(2)]
    for run in runs:  # the first tensors at an odd offset: not 16-byte aligned
        for part in run:
            buf = torch.empty(part[0].numel() + 1, device="cuda")
            buf[1:].copy_(part[0])
            part[0] = buf[1:]
    coefs = step_coefficients([torch.tensor(7.0, device="cuda")] * 3, 1e-3, 0.9, 0.95, 0.1)
    grads = [torch.randn(s, device="cuda", generator=g).to(grad_dtype) for s in shapes]
    scale, skip = torch.tensor(3.0, device="cuda"), torch.tensor(0.0, device="cuda")
    for fn, (p, m, v) in zip((adamw_step_, adamw_step_reference_), runs, strict=True):
        fn(p, grads, m, v, coefs, scale, skip, 0.9, 0.95, 1e-8)
    for a, b in zip(*runs, strict=True):
        for x, y in zip(a, b, strict=True):
            # The kernel contracts its multiply-adds (FMA), the reference rounds twice: 1-2
            # ulp of the operands (O(1) here), also where m cancels towards 0.
            assert torch.allclose(x, y, rtol=2e-6, atol=1e-6)


def test_state_dict_from_fused_adamw_resumes():
    straight = _params(torch.float32)
    _train(torch.optim.AdamW(_groups(straight), fused=True, **HYPER), straight, skip=-1)
    params = _params(torch.float32)
    first = torch.optim.AdamW(_groups(params), fused=True, **HYPER)
    _train(first, params, skip=-1, steps=range(2))
    sd = first.state_dict()
    sd = {"state": {k: {n: t.cpu() for n, t in v.items()} for k, v in sd["state"].items()},
          "param_groups": sd["param_groups"]}  # as a checkpoint holds it
    second = TritonAdamW(_groups(params), **HYPER)
    second.load_state_dict(sd)
    _train(second, params, skip=-1, steps=range(2, 5))
    for i, (a, b) in enumerate(zip(params, straight, strict=True)):
        assert _rel_err(a, b) < 1e-6, f"param {i}"
