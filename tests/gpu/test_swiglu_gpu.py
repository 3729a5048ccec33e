"""Triton SwiGLU on CUDA (bf16, fp16, fp32) against float64 math and eager ``F.silu(g) * u``:
forward, the (d_gate | d_up) gradient, the memory kept for backward, and torch.compile."""

import pytest
import torch
import torch.nn.functional as F

from mpcore.kernels.swiglu import swiglu, swiglu_reference

pytestmark = pytest.mark.gpu

# Relative (norm-wise) tolerance per dtype: fp32 to rounding, 16-bit within the numerics policy.
_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _swiglu_f64(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


def _eager_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _check_against_float64(gate_up: torch.Tensor) -> None:
    gate_up.requires_grad_()
    y = swiglu(gate_up)
    dy = torch.randn_like(y)
    y.backward(dy)
    gu64 = gate_up.detach().double().requires_grad_()
    y64 = _swiglu_f64(gu64)
    y64.backward(dy.double())

    dtype, shape = gate_up.dtype, tuple(gate_up.shape)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1] // 2)
    assert gate_up.grad.dtype == dtype and gate_up.grad.shape == gate_up.shape
    tol = _TOL[dtype]
    for name, got, want in [("y", y, y64), ("d_gate|d_up", gate_up.grad, gu64.grad)]:
        err = _rel_err(got, want)
        assert err <= tol, f"{name} {dtype} {shape}: rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape", [(2, 1500, 2 * 2048), (333, 2 * 1792), (4, 3, 2 * 896), (97, 2 * 5), (1, 2 * 14336)]
)
def test_triton_matches_float64(dtype, shape):
    _check_against_float64((torch.randn(shape, device="cuda") * 3.0).to(dtype))


def test_large_bf16_matches_float64_and_eager():
    """16k tokens x I = 8192: offsets past 2^31 bytes, and eager's rounding almost bitwise."""
    gate_up = (torch.randn(16384, 2 * 8192, device="cuda") * 3.0).bfloat16()
    _check_against_float64(gate_up)
    y = swiglu(gate_up.detach())
    same = (y == _eager_swiglu(gate_up.detach())).float().mean().item()
    assert same >= 0.99, f"only {same:.3f} of outputs equal eager F.silu(g) * u"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_rounds_like_eager(dtype):
    """Forward and d_up nearly bitwise equal to eager autograd; d_gate within the tolerance."""
    gate_up = (torch.randn(512, 2 * 2048, device="cuda") * 3.0).to(dtype)
    dy = torch.randn(512, 2048, device="cuda").to(dtype)
    ours = gate_up.clone().requires_grad_()
    eager = gate_up.clone().requires_grad_()
    y, y_eager = swiglu(ours), _eager_swiglu(eager)
    torch.autograd.backward([y, y_eager], [dy, dy])
    for name, got, want in [("y", y, y_eager), ("d_up", ours.grad[:, 2048:], eager.grad[:, 2048:])]:
        same = (got == want).float().mean().item()
        assert same >= 0.99, f"{name} {dtype}: only {same:.3f} equal eager"
    assert _rel_err(ours.grad[:, :2048], eager.grad[:, :2048]) <= _TOL[dtype]
    torch.testing.assert_close(y, swiglu_reference(gate_up), rtol=1e-2, atol=1e-2)


def _retained_bytes(fn, gate_up: torch.Tensor) -> int:
    """CUDA memory still allocated after fn's forward, with its graph alive."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fn(gate_up)
    torch.cuda.synchronize()
    retained = torch.cuda.memory_allocated() - before
    del y
    return retained


def test_keeps_one_intermediate_less_than_eager():
    gate_up = torch.randn(16384, 2 * 8192, device="cuda", dtype=torch.bfloat16)
    gate_up.requires_grad_()
    y_bytes = gate_up.numel() * gate_up.element_size() // 2  # 256 MiB
    assert _retained_bytes(swiglu, gate_up) == y_bytes  # the output only
    assert _retained_bytes(_eager_swiglu, gate_up) == 2 * y_bytes  # the output and silu(gate)


def test_torch_compile_fullgraph_matches_eager():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, 2 * 384, device="cuda", dtype=torch.bfloat16) / 16
    weight.requires_grad_()

    def step(x, weight):
        return swiglu(x @ weight).float().square().sum()

    got = torch.compile(step, fullgraph=True)(x, weight)
    want = step(x, weight)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    grad_got = torch.autograd.grad(got, weight)[0]
    grad_want = torch.autograd.grad(want, weight)[0]
    torch.testing.assert_close(grad_got, grad_want, rtol=2e-2, atol=2e-2)
