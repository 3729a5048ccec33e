"""SwiGLU: the PyTorch reference against float64 math and eager ``F.silu(g) * u``, the bytes
saved for backward, and the Triton kernels run on CPU tensors by the Triton interpreter (this
file re-runs itself in a subprocess with TRITON_INTERPRET=1, because triton reads that variable
when the kernels are defined). The interpreter checks are fp32 and fp16: its float32 -> bfloat16
casts truncate instead of rounding to nearest, so bf16 is left to tests/gpu/test_swiglu_gpu.py."""

import os

import pytest
import torch
import torch.nn.functional as F

from mpcore.kernels.swiglu import swiglu, swiglu_reference, swiglu_triton
from tests.unit.interpret import needs_triton, run_under_interpreter

# Norm-wise relative tolerance per dtype: fp32 to rounding, fp16 a few ulps of two roundings.
_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.float64: 1e-12}


def _swiglu_f64(gate_up: torch.Tensor) -> torch.Tensor:
    """The math in float64, no intermediate rounding; differentiable in gate_up."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _make_input(lead, inter, dtype, view):
    """gate_up [*lead, 2 * inter]; "strided" rows are not adjacent in memory, "transposed" has a
    last-dim stride != 1. Scaled so that both silu's tail and its curved middle are sampled."""
    if view == "strided":
        return (torch.randn(*lead, 2 * inter + 9) * 3.0)[..., : 2 * inter].to(dtype)
    if view == "transposed":
        return (torch.randn(2 * inter, *lead) * 3.0).to(dtype).transpose(0, -1)
    return (torch.randn(*lead, 2 * inter) * 3.0).to(dtype)


def _check_against_float64(fn, lead, inter, dtype, view):
    """Forward and the (d_gate | d_up) gradient of fn against float64 autograd."""
    gate_up = _make_input(lead, inter, dtype, view).requires_grad_()
    y = fn(gate_up)
    dy = torch.randn_like(y)
    y.backward(dy)
    gu64 = gate_up.detach().double().requires_grad_()
    y64 = _swiglu_f64(gu64)
    y64.backward(dy.double())

    assert y.shape == (*lead, inter) and y.dtype == dtype
    assert gate_up.grad.shape == gate_up.shape and gate_up.grad.dtype == dtype
    tol = _TOL[dtype]
    for name, got, want in [("y", y, y64), ("d_gate|d_up", gate_up.grad, gu64.grad)]:
        err = _rel_err(got, want)
        assert err <= tol, f"{name} {dtype} {view} {lead} I={inter}: rel err {err:.2e} > {tol:.0e}"


_CASES = [
    ((37,), 100, torch.float32, "plain"),
    ((37,), 100, torch.float16, "plain"),
    ((2, 3), 5, torch.float32, "plain"),
    ((2, 3), 5, torch.float16, "plain"),
    ((11,), 48, torch.float32, "strided"),
    ((9,), 24, torch.float16, "transposed"),
]


@pytest.mark.parametrize("lead, inter, dtype, view", _CASES)
def test_reference_matches_float64(lead, inter, dtype, view):
    _check_against_float64(swiglu_reference, lead, inter, dtype, view)


def test_reference_keeps_float64_precision():
    _check_against_float64(swiglu_reference, (7,), 33, torch.float64, "plain")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_rounds_like_eager(dtype):
    """Forward and d_up equal eager autograd's bitwise (silu(g) rounded before the multiply);
    d_gate differs only by eager's extra rounding of dy * up (and, in fp32, by how the sigmoid
    is evaluated), so stays within an ulp of the dtype, norm-wise."""
    gate_up = (torch.randn(64, 2 * 96) * 3.0).to(dtype)
    dy = torch.randn(64, 96).to(dtype)
    ours = gate_up.clone().requires_grad_()
    eager = gate_up.clone().requires_grad_()
    y = swiglu_reference(ours)
    gate, up = eager.chunk(2, dim=-1)
    y_eager = F.silu(gate) * up
    torch.autograd.backward([y, y_eager], [dy, dy])

    assert torch.equal(y, y_eager)
    assert torch.equal(ours.grad[:, 96:], eager.grad[:, 96:])
    err = _rel_err(ours.grad[:, :96], eager.grad[:, :96])
    assert err <= torch.finfo(dtype).eps, f"d_gate vs eager {dtype}: rel err {err:.2e}"


def test_dispatch_on_cpu_is_the_reference():
    gate_up = torch.randn(6, 2 * 17)
    assert torch.equal(swiglu(gate_up), swiglu_reference(gate_up))


def test_empty_input():
    for shape in [(0, 8), (3, 0), (2, 0, 6)]:
        gate_up = torch.randn(shape, requires_grad=True)
        y = swiglu(gate_up)
        assert y.shape == (*shape[:-1], shape[-1] // 2)
        y.sum().backward()
        assert gate_up.grad.shape == shape


@pytest.mark.parametrize(
    "gate_up, match",
    [
        (torch.randn(4, 7), r"\[\.\.\., 2 \* I\].*\(4, 7\)"),
        (torch.tensor(1.0), r"\[\.\.\., 2 \* I\]"),
        (torch.ones(4, 8, dtype=torch.int32), "floating-point.*torch.int32"),
    ],
)
def test_bad_input_raises(gate_up, match):
    for fn in (swiglu, swiglu_reference, swiglu_triton):
        with pytest.raises(ValueError, match=match):
            fn(gate_up)


def test_triton_rejects_float64_with_the_fix():
    with pytest.raises(ValueError, match="swiglu_reference"):
        swiglu_triton(torch.randn(3, 8, dtype=torch.float64))


def _saved_bytes(fn, gate_up: torch.Tensor) -> int:
    """Bytes of every tensor that fn's autograd graph saves for backward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(gate_up)
    return total


def _eager_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _check_saves_only_gate_up(fn):
    gate_up = torch.randn(40, 2 * 24, dtype=torch.bfloat16, requires_grad=True)
    gu_bytes = gate_up.numel() * gate_up.element_size()
    # Eager keeps gate (silu's input), silu(gate) and up (the product's operands).
    assert _saved_bytes(_eager_swiglu, gate_up) == gu_bytes * 3 // 2
    assert _saved_bytes(fn, gate_up) == gu_bytes


def test_saves_only_gate_up_for_backward():
    _check_saves_only_gate_up(swiglu)


def test_torch_compile_fullgraph_matches_eager():
    x = torch.randn(2, 5, 8)
    weight = torch.randn(8, 2 * 13, requires_grad=True)

    def step(x, weight):
        return (swiglu(x @ weight) ** 2).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got, want = compiled(x, weight), step(x, weight)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    grad_got = torch.autograd.grad(got, weight)[0]
    grad_want = torch.autograd.grad(want, weight)[0]
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    run_under_interpreter(__name__, f"interpreter checks passed: {len(_CASES) + 3}")


def _check_triton_rounds_like_reference():
    """fp16: the kernels round silu(g) before it multiplies up (y) and dy (d_up), as the
    reference does; compared value by value, which a kernel without that rounding fails."""
    gate_up = (torch.randn(50, 2 * 70) * 3.0).half()
    dy = torch.randn(50, 70).half()
    grads = []
    for fn in (swiglu_triton, swiglu_reference):
        leaf = gate_up.clone().requires_grad_()
        y = fn(leaf)
        y.backward(dy)
        grads.append((y.detach(), leaf.grad[:, 70:]))
    for name, got, want in zip(("y", "d_up"), *grads, strict=True):
        same = (got == want).float().mean().item()
        assert same >= 0.99, f"{name}: only {same:.3f} equal the reference"


def _check_triton_compiles():
    x = torch.randn(3, 8)
    weight = torch.randn(8, 2 * 21, requires_grad=True)

    def step(x, weight):
        return (swiglu_triton(x @ weight) ** 2).sum()

    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, weight)
    want = step(x, weight)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        torch.autograd.grad(got, weight)[0], torch.autograd.grad(want, weight)[0]
    )


def _interpreter_checks():
    from triton.runtime.interpreter import InterpretedFunction

    from mpcore.kernels import swiglu as module

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(module._swiglu_fwd_kernel, InterpretedFunction), "not interpreted"
    torch.manual_seed(0)
    # CPU tensors reach the kernels here; compiled Triton would refuse them. The CPU tiles are
    # at most 32 columns by 2-8 rows, so every case has ragged row and column tails.
    for case in _CASES:
        _check_against_float64(swiglu_triton, *case)
    _check_triton_rounds_like_reference()
    _check_saves_only_gate_up(swiglu_triton)
    _check_triton_compiles()
    print(f"interpreter checks passed: {len(_CASES) + 3}")


if __name__ == "__main__":
    _interpreter_checks()
