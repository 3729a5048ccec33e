"""Triton LayerNorm on CUDA against eager autocast's float32 ``F.layer_norm`` and float64:
forward (float32 out, and bf16 out as the next matmul would round it) and the gradients of x,
weight and bias, at the vision towers' widths."""

import pytest
import torch
import torch.nn.functional as F

from mpcore.kernels.layernorm import layer_norm
from tests.gpu.gpu_checks import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, hidden", [(16500, 1280), (16500, 1024), (4125, 5120), (7, 100)])
def test_matches_autocast_eager_and_float64(rows, hidden, dtype):
    torch.manual_seed(0)
    x = (torch.randn(rows, hidden, device="cuda") * 3 + 1).to(dtype)
    weight = 1 + 0.3 * torch.randn(hidden, device="cuda")
    bias = 0.2 * torch.randn(hidden, device="cuda")
    ours = [t.clone().requires_grad_() for t in (x, weight, bias)]
    eager = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = layer_norm(*ours, 1e-6)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_eager = F.layer_norm(eager[0], (hidden,), eager[1], eager[2], 1e-6)
    assert y.dtype == y_eager.dtype == torch.float32
    assert rel_err(y, y_eager) <= 1e-6
    same = (layer_norm(x, weight, bias, 1e-6, torch.bfloat16) == y_eager.bfloat16())
    assert same.float().mean().item() >= 0.999
    dy = torch.randn_like(y)
    y.backward(dy)
    y_eager.backward(dy)
    ref = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    F.layer_norm(ref[0], (hidden,), ref[1], ref[2], 1e-6).backward(dy.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, e, r in zip(("dx", "dweight", "dbias"), ours, eager, ref, strict=True):
        assert a.grad.dtype == e.grad.dtype
        err, err_eager = rel_err(a.grad, r.grad), rel_err(e.grad, r.grad)
        assert err <= tol and err <= err_eager + torch.finfo(dtype).eps, (name, err, err_eager)
