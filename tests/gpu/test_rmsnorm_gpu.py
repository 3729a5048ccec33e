"""Triton RMSNorm on CUDA (bf16, fp16, fp32) against float64 math: forward, dx and dweight."""

import pytest
import torch

from kernels.rmsnorm import rms_norm, rms_norm_reference

pytestmark = pytest.mark.gpu

# Relative (norm-wise) tolerance per dtype: fp32 to rounding, 16-bit within the numerics policy.
_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 1500, 4096), (333, 5120), (97, 16384), (4, 3, 896)])
def test_triton_matches_float64(dtype, shape):
    hidden, eps = shape[-1], 1e-2
    x = (torch.randn(shape, device="cuda") * 0.3).to(dtype).requires_grad_()
    weight = (1.0 + 0.5 * torch.randn(hidden, device="cuda")).to(dtype).requires_grad_()
    y = rms_norm(x, weight, eps)
    dy = torch.randn_like(y)
    y.backward(dy)

    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    y64 = _rms_norm_f64(x64, w64, eps)
    y64.backward(dy.double())

    assert y.dtype == dtype and x.grad.dtype == dtype and weight.grad.dtype == dtype
    tol = _TOL[dtype]
    for name, got, want in [("y", y, y64), ("dx", x.grad, x64.grad), ("dw", weight.grad, w64.grad)]:
        err = _rel_err(got, want)
        assert err <= tol, f"{name} {dtype} {shape}: rel err {err:.2e} > {tol:.0e}"
    if dtype == torch.float32:
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "x_dtype, w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_triton_follows_hf_rounding(x_dtype, w_dtype):
    """Forward matches the HF-order reference almost bitwise, fp32 weights included."""
    x = torch.randn(512, 2048, device="cuda").to(x_dtype)
    weight = torch.randn(2048, device="cuda").to(w_dtype)
    y = rms_norm(x, weight, 1e-6)
    ref = rms_norm_reference(x, weight, 1e-6)
    assert y.dtype == ref.dtype == torch.promote_types(x_dtype, w_dtype)
    same = (y == ref).float().mean().item()
    assert same >= 0.99, f"only {same:.3f} of outputs equal the reference"
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2)
