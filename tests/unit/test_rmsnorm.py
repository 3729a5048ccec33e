"""RMSNorm: the PyTorch reference against float64 math and Hugging Face, and the Triton kernels
run on CPU tensors by the Triton interpreter (this file re-runs itself in a subprocess with
TRITON_INTERPRET=1, because triton reads that variable when the kernels are defined)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpcore.kernels.rmsnorm import (
    MAX_HIDDEN,
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm,
    rms_norm_reference,
    rms_norm_triton,
)
from tests.unit.interpret import needs_triton


def _rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The math, in float64, with no intermediate rounding."""
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def test_reference_matches_float64_math():
    # eps comparable to mean(x^2), so dropping or misplacing it shows.
    x = torch.randn(3, 5, 96) * 0.5
    weight = torch.randn(96)
    got = rms_norm_reference(x, weight, eps=0.1)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), _rms_norm_f64(x, weight, 0.1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module", ["llama", "qwen2"])
def test_reference_matches_transformers(module):
    if module == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFNorm
    else:
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm as HFNorm
    hidden, eps = 80, 0.1
    hf = HFNorm(hidden, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden))
    x = torch.randn(4, 7, hidden)
    torch.testing.assert_close(rms_norm_reference(x, hf.weight, eps), hf(x), rtol=0, atol=1e-6)
    # HF keeps an fp32 weight under bf16 activations: the normalised value is rounded to bf16,
    # then multiplied by the fp32 weight, giving fp32.
    x_bf16 = x.bfloat16()
    ours = rms_norm_reference(x_bf16, hf.weight, eps)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf(x_bf16), rtol=0, atol=1e-6)


def test_dispatch_on_cpu_is_the_reference():
    x = torch.randn(6, 33)
    weight = torch.randn(33)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize(
    "x_shape, w_shape", [((4, 8), (7,)), ((4, 8), (1, 8)), ((2, 3, 8), (2, 8)), ((), (1,))]
)
def test_bad_weight_shape_raises(x_shape, w_shape):
    x, weight = torch.randn(x_shape), torch.randn(w_shape)
    for fn in (rms_norm, rms_norm_reference, rms_norm_triton):
        with pytest.raises(ValueError, match="rms_norm") as info:
            fn(x, weight)
        assert str(tuple(w_shape)) in str(info.value)
        if x_shape:
            assert str(tuple(x_shape)) in str(info.value)


def test_out_dtype_is_one_cast_of_the_result():
    x, weight = torch.randn(6, 40), torch.randn(40)
    got = rms_norm_reference(x, weight, 0.1, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, rms_norm_reference(x, weight, 0.1).bfloat16())


def test_add_rms_norm_reference_is_the_add_then_the_norm():
    x, delta, weight = torch.randn(5, 24), torch.randn(5, 24).bfloat16(), torch.randn(24)
    s, y = add_rms_norm(x, delta, weight, 0.1, out_dtype=torch.bfloat16)
    assert s.dtype == torch.float32 and torch.equal(s, x + delta)
    assert torch.equal(y, rms_norm_reference(x + delta, weight, 0.1).bfloat16())
    for fn in (add_rms_norm, add_rms_norm_reference, add_rms_norm_triton):
        with pytest.raises(ValueError, match="delta must be"):
            fn(x, delta[:4], weight)


def test_weight_on_other_device_raises():
    with pytest.raises(ValueError, match="one device"):
        rms_norm(torch.randn(2, 4, device="meta"), torch.randn(4))


def test_triton_rejects_rows_wider_than_the_kernel():
    hidden = MAX_HIDDEN + 1
    with pytest.raises(ValueError, match=str(MAX_HIDDEN)):
        rms_norm_triton(torch.randn(1, hidden), torch.randn(hidden))


@needs_triton
def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", __name__], cwd=Path(__file__).resolve().parents[2], env=env,
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreter checks passed: 10" in proc.stdout, proc.stdout + proc.stderr


# Interpreter cases: (leading shape, H, dtype, view). H is never a power of two; row
# counts are not multiples of the backward's rows per program; "strided" feeds rows that are
# not adjacent in memory, "transposed" a last dim with stride != 1.
_INTERPRETER_CASES = [
    ((37,), 300, torch.float32, "plain"),
    ((5, 7), 130, torch.float16, "plain"),
    ((3,), 1000, torch.float32, "plain"),
    ((11,), 96, torch.float32, "strided"),
    ((9,), 24, torch.float16, "transposed"),
    ((2, 3), 5, torch.float32, "plain"),
]


def _make_input(lead, hidden, dtype, view):
    if view == "strided":
        return (torch.randn(*lead, hidden + 17) * 2.0)[..., :hidden].to(dtype)
    if view == "transposed":
        return (torch.randn(hidden, *lead) * 2.0).to(dtype).transpose(0, -1)
    return (torch.randn(*lead, hidden) * 2.0).to(dtype)


def _check_case(lead, hidden, dtype, view):
    x = _make_input(lead, hidden, dtype, view).requires_grad_()
    weight = torch.randn(hidden).to(dtype).requires_grad_()
    eps = 0.5  # large enough that an error in its handling fails the checks
    y = rms_norm_triton(x, weight, eps)
    dy = torch.randn_like(y)
    y.backward(dy)

    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    y64 = _rms_norm_f64(x64, w64, eps)
    y64.backward(dy.double())

    assert y.dtype == dtype and y.shape == x.shape
    assert x.grad.dtype == dtype and weight.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, got, want in [("y", y, y64), ("dx", x.grad, x64.grad), ("dw", weight.grad, w64.grad)]:
        err = _rel_err(got, want)
        assert err <= tol, f"{name} {dtype} {view} H={hidden}: rel err {err:.2e} > {tol:.0e}"
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    else:
        # HF rounding order (normalise, round to x.dtype, then multiply): nearly bitwise equal
        # to the reference, which a kernel that skipped the intermediate rounding would not be.
        same = (y == rms_norm_reference(x.detach(), weight.detach(), eps)).float().mean().item()
        assert same >= 0.99, f"only {same:.3f} of outputs equal the reference"


# Fused add + norm: (x dtype, delta dtype, out_dtype, whether s has a use of its own). fp16
# stands in for bf16 (the interpreter's bf16 is not trusted here).
_ADD_CASES = [
    (torch.float32, torch.float16, torch.float16, True),
    (torch.float32, torch.float16, torch.float16, False),
    (torch.float16, torch.float16, None, True),
    (torch.float32, torch.float32, None, True),
]


def _check_add_case(x_dtype, delta_dtype, out_dtype, s_used, rows=29, hidden=200):
    """The fused kernels against the unfused graph (torch's add, the reference norm, the cast),
    forward and every gradient, including the gradient that reaches s from its own use."""
    x0 = torch.randn(rows, hidden).to(x_dtype)
    d0 = torch.randn(rows, hidden).to(delta_dtype)
    w0 = (1 + 0.1 * torch.randn(hidden)).to(x_dtype)
    g_s, g_y = torch.randn(rows, hidden), torch.randn(rows, hidden)
    results = []
    for fn in (add_rms_norm_triton, add_rms_norm_reference):
        x, d, w = (t.clone().requires_grad_() for t in (x0, d0, w0))
        s, y = fn(x, d, w, 0.5, out_dtype)
        loss = (y.float() * g_y).sum() + ((s.float() * g_s).sum() if s_used else 0)
        loss.backward()
        results.append((s, y, x.grad, d.grad, w.grad))
    case = f"{x_dtype} + {delta_dtype} -> {out_dtype}, s used: {s_used}"
    for name, got, want in zip(("s", "y", "dx", "ddelta", "dw"), *results, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{case}: {name}"
        if name == "s":
            assert torch.equal(got, want), f"{case}: s"
        else:
            tol = 1e-5 if got.dtype == torch.float32 else 2e-3
            err = _rel_err(got, want)
            assert err <= tol, f"{case}: {name} rel err {err:.2e} > {tol:.0e}"


def _interpreter_checks():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.manual_seed(0)
    # CPU tensors reach the kernels here; compiled Triton would refuse them.
    for case in _INTERPRETER_CASES:
        _check_case(*case)
    for case in _ADD_CASES:
        _check_add_case(*case)
    print(f"interpreter checks passed: {len(_INTERPRETER_CASES) + len(_ADD_CASES)}")


if __name__ == "__main__":
    _interpreter_checks()
