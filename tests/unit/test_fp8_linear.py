"""FP8 linear on CPU: the autograd math of ``mpcore.kernels.fp8_linear`` through its PyTorch
reference (FP8 casts, fp32 matmuls) against float64, and the errors for machines and shapes
FP8 cannot run. The Triton + ``torch._scaled_mm`` path runs in tests/gpu/test_fp8_linear_gpu.py."""

import pytest
import torch

from mpcore.kernels.fp8_linear import check_fp8, fp8_linear, fp8_linear_reference, quantize
from mpcore.models import ModelConfig, build_model
from mpcore.parallel.layers import ColumnParallelLinear
from mpcore.parallel.state import ParallelState


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_quantize_maps_amax_to_the_format_max():
    t = torch.randn(64, 32) * 3
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t8, inv = quantize(t, dtype, "torch")
        assert t8.dtype == dtype and t8.float().abs().max() == torch.finfo(dtype).max
        assert _rel(t8.float() * inv, t) < (0.04 if dtype == torch.float8_e4m3fn else 0.08)


def test_reference_matches_float64_within_fp8_rounding():
    """e4m3 rounds to 3 mantissa bits: a relative error uniform in +-2^-4, rms 2^-4/sqrt(3)
    = 0.036 per operand; y has two rounded operands (rms ~0.05 on random data), the gradients
    one e5m2 operand (rms 0.072) and one e4m3 (~0.08 together). Bounds: 1.5x those."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 64, generator=g, dtype=torch.float64)  # 70 rows: padded to 80
    w = torch.randn(48, 64, generator=g, dtype=torch.float64) * 0.05
    dy = torch.randn(70, 48, generator=g, dtype=torch.float64)
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    y = fp8_linear_reference(xf, wf)
    y.backward(dy.float())
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    (x64 @ w64.t()).backward(dy)
    assert y.dtype == xf.grad.dtype == wf.grad.dtype == torch.float32
    assert _rel(y, x64 @ w64.t()) < 0.075
    assert _rel(xf.grad, x64.grad) < 0.12 and _rel(wf.grad, w64.grad) < 0.12


def test_fp8_needs_a_capable_gpu_and_shapes():
    with pytest.raises(ValueError, match="unknown fp8 recipe"):
        check_fp8("delayed")
    check_fp8("none", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU with FP8"):
            fp8_linear(torch.randn(16, 32), torch.randn(16, 32))
        cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                          num_kv_heads=1, intermediate_size=64)
        with pytest.raises(ValueError, match="compute capability >= 8.9"):
            build_model(cfg, ParallelState(), fp8="tensorwise")
    with pytest.raises(ValueError, match="multiples of 16"):
        ColumnParallelLinear(32, 24, fp8="tensorwise", device="meta")
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear_reference(torch.randn(4, 24), torch.randn(16, 24))
