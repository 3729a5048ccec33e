"""mpcore.kernels.master_linear on the CPU: the autograd math against float64, and when the layers
use it (CUDA only: the fp32-output GEMM is a CUDA op; tests/gpu/test_master_linear_gpu.py runs
it there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpcore.kernels.master_linear import master_linear, master_linear_applies
from mpcore.parallel.layers import linear


def _data(seed: int, rows: int = 37, k: int = 48, m: int = 24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(m, k, generator=g) * 0.1
    b = torch.randn(m, generator=g)
    dy = torch.randn(rows, m, generator=g)
    return x, w, b, dy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_and_dx_are_the_compute_dtype_gemms(dtype):
    x, w, b, dy = _data(0)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = master_linear(xr, wr, br, dtype)
    y.backward(dy.to(dtype))
    # The same GEMMs in the compute dtype, as autocast runs them.
    xc, wc = x.to(dtype).requires_grad_(), w.to(dtype)
    ref = F.linear(xc, wc, b.to(dtype))
    ref.backward(dy.to(dtype))
    assert y.dtype == dtype and torch.equal(y, ref)
    assert xr.grad.dtype == torch.float32 and torch.equal(xr.grad, xc.grad.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_and_bias_grads_are_fp32_and_not_rounded(dtype):
    x, w, b, dy = _data(1, rows=301)
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    master_linear(x, wr, br, dtype).backward(dy.to(dtype))
    xc, dyc = x.to(dtype).double(), dy.to(dtype).double()
    exact_dw, exact_db = dyc.t() @ xc, dyc.sum(0)
    assert wr.grad.dtype == torch.float32 and br.grad.dtype == torch.float32
    # fp32 accumulation of exactly representable products: within fp32 rounding of the sum.
    assert (wr.grad.double() - exact_dw).abs().max() < 1e-4
    assert (br.grad.double() - exact_db).abs().max() < 1e-4
    # The autocast way rounds dw to the compute dtype: visibly worse than this.
    rounded = exact_dw.to(dtype).double()
    assert (rounded - exact_dw).abs().max() > 10 * (wr.grad.double() - exact_dw).abs().max()


def test_leading_dims_and_no_bias():
    x, w, _, _ = _data(2)
    x3 = x[:36].reshape(4, 9, -1).requires_grad_()
    wr = w.clone().requires_grad_()
    y = master_linear(x3, wr, None, torch.bfloat16)
    assert y.shape == (4, 9, w.shape[0])
    y.float().sum().backward()
    assert x3.grad.shape == x3.shape and wr.grad.shape == w.shape


def test_bad_arguments_raise():
    x, w, b, _ = _data(3)
    with pytest.raises(ValueError, match="fp32 master weight"):
        master_linear(x, w.bfloat16(), None, torch.bfloat16)
    with pytest.raises(ValueError, match="compute dtype"):
        master_linear(x, w, None, torch.float32)
    with pytest.raises(ValueError, match="input width"):
        master_linear(x[:, :5], w, None, torch.bfloat16)


def test_not_used_off_cuda():
    x, w, b, _ = _data(4)
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert master_linear_applies(x, w) is None
        y = linear(x, w, b)
    assert y.grad_fn is not None and "MasterLinear" not in type(y.grad_fn).__name__
