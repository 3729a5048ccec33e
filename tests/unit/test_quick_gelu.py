"""QuickGELU (``x * sigmoid(1.702 x)``): the PyTorch reference against float64 math and eager
PyTorch (transformers' ``QuickGELUActivation``), the bytes saved for backward, torch.compile,
the Triton kernels on CPU tensors under Triton's interpreter (this file re-runs itself with
TRITON_INTERPRET=1; fp32 and fp16 there, since the interpreter's bf16 casts truncate: bf16 is
tests/gpu/test_quick_gelu_gpu.py's), and the kernels compiled for sm_90 without a GPU."""

import os

import pytest
import torch

from mpcore.kernels.quick_gelu import quick_gelu, quick_gelu_reference, quick_gelu_triton
from tests.unit.interpret import global_accesses, needs_triton, run_under_interpreter, sm90_ptx

# Norm-wise relative tolerance per dtype: fp32 to rounding, fp16 a few ulps of its roundings.
_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.float64: 1e-12}
_CASES = [((37,), torch.float32), ((37,), torch.float16), ((3, 5, 7), torch.float32),
          ((3, 5, 7), torch.float16), ((2, 129), torch.float32)]


def _eager(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _make_input(shape, dtype):
    """Scaled so that the sigmoid's two tails and its curved middle are all sampled."""
    return (torch.randn(shape) * 4.0).to(dtype)


def _check_against_float64(fn, shape, dtype):
    x = _make_input(shape, dtype).requires_grad_()
    y = fn(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    _eager(x64).backward(dy.double())
    assert y.shape == x.shape and y.dtype == dtype and x.grad.dtype == dtype
    for name, got, want in [("y", y, _eager(x64)), ("dx", x.grad, x64.grad)]:
        err = _rel_err(got, want)
        assert err <= _TOL[dtype], f"{name} {dtype} {shape}: rel err {err:.2e}"


@pytest.mark.parametrize("shape, dtype", _CASES)
def test_reference_matches_float64(shape, dtype):
    _check_against_float64(quick_gelu_reference, shape, dtype)


def test_reference_keeps_float64_precision():
    _check_against_float64(quick_gelu_reference, (7, 9), torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_rounds_like_eager(dtype):
    """The forward equals eager's bitwise (1.702 x and the sigmoid rounded where eager rounds
    them); the gradient, the exact derivative rounded once, within an ulp of eager's norm-wise
    (eager rounds each intermediate product)."""
    x = _make_input((64, 96), dtype)
    dy = torch.randn(64, 96).to(dtype)
    ours, eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_eager = quick_gelu_reference(ours), _eager(eager)
    torch.autograd.backward([y, y_eager], [dy, dy])
    assert torch.equal(y, y_eager)
    err = _rel_err(ours.grad, eager.grad)
    assert err <= torch.finfo(dtype).eps, f"dx vs eager {dtype}: rel err {err:.2e}"


def test_dispatch_on_cpu_is_the_reference():
    x = torch.randn(6, 17)
    assert torch.equal(quick_gelu(x), quick_gelu_reference(x))


def test_empty_input():
    x = torch.randn(0, 8, requires_grad=True)
    quick_gelu(x).sum().backward()
    assert x.grad.shape == (0, 8)


def test_bad_input_raises():
    for fn in (quick_gelu, quick_gelu_reference, quick_gelu_triton):
        with pytest.raises(ValueError, match="floating-point.*torch.int32"):
            fn(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="quick_gelu_reference"):
        quick_gelu_triton(torch.randn(3, dtype=torch.float64))


def _saved_bytes(fn, x: torch.Tensor) -> int:
    """Bytes of the distinct tensors fn's autograd graph saves for backward."""
    saved = {}

    def pack(t):
        saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(saved.values())


def _check_saves_only_x(fn):
    x = torch.randn(40, 24, dtype=torch.bfloat16, requires_grad=True)
    nbytes = x.numel() * x.element_size()
    assert _saved_bytes(_eager, x) == 2 * nbytes  # eager keeps x and the sigmoid
    assert _saved_bytes(fn, x) == nbytes


def test_saves_only_x_for_backward():
    _check_saves_only_x(quick_gelu)


def _check_compiles(fn):
    x = torch.randn(3, 8)
    weight = torch.randn(8, 21, requires_grad=True)

    def step(x, weight):
        return (fn(x @ weight) ** 2).sum()

    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, weight)
    want = step(x, weight)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.autograd.grad(got, weight)[0],
                               torch.autograd.grad(want, weight)[0])


def test_torch_compile_fullgraph_matches_eager():
    _check_compiles(quick_gelu)


@needs_triton
@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_bf16_accesses_compile_to_16_byte_vectors(which):
    """For sm_90 (no GPU needed) the kernels' bf16 loads and stores are 16-byte vectors. That
    needs ``n`` specialised on its divisibility by 16: the kernels mask ``offs < n``, and Triton
    vectorises a masked access only where it knows the mask constant over a vector. Opted out
    (``do_not_specialize``), every access was 2 bytes wide and the forward ran at a quarter of
    the copy bandwidth on the H200 (302 us for the Qwen2-VL-2B tower's 338 MB per block)."""
    from mpcore.kernels import quick_gelu as module

    kernel = getattr(module, f"_quick_gelu_{which}_kernel")
    assert not kernel.do_not_specialize, "n must stay specialised"
    pointers = ["x_ptr", "y_ptr"] if which == "fwd" else ["x_ptr", "dy_ptr", "dx_ptr"]
    accesses = global_accesses(sm90_ptx(kernel, {**{p: "*bf16" for p in pointers}, "n": "i32"},
                                        {"BLOCK": 4096}))
    assert accesses and all(".v4." in a for a in accesses), sorted(accesses)


@needs_triton
@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    run_under_interpreter(__name__, f"interpreter checks passed: {len(_CASES) + 3}")


def _check_triton_rounds_like_reference():
    """fp16: the kernel's forward rounds where the reference (and eager) round; compared value
    by value, which a kernel computing in fp32 throughout fails."""
    x = _make_input((50, 70), torch.float16)
    same = (quick_gelu_triton(x) == quick_gelu_reference(x)).float().mean().item()
    assert same >= 0.99, f"only {same:.3f} equal the reference"


def _interpreter_checks():
    from triton.runtime.interpreter import InterpretedFunction

    from mpcore.kernels import quick_gelu as module

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(module._quick_gelu_fwd_kernel, InterpretedFunction), "not interpreted"
    torch.manual_seed(0)
    # CPU tensors reach the kernels here (64 elements per program: ragged tails everywhere).
    for case in _CASES:
        _check_against_float64(quick_gelu_triton, *case)
    _check_triton_rounds_like_reference()
    _check_saves_only_x(quick_gelu_triton)
    _check_compiles(quick_gelu_triton)
    print(f"interpreter checks passed: {len(_CASES) + 3}")


if __name__ == "__main__":
    _interpreter_checks()
