"""RoPE: the PyTorch reference against float64 math and its autograd, bitwise equality with the
eager rotation the model used before, bad inputs, the tensors saved for backward, and the
Triton kernels run on CPU tensors by the Triton interpreter (this file re-runs itself in a
subprocess with TRITON_INTERPRET=1, because triton reads that variable when the kernels are
defined). The interpreter checks are fp32 and fp16: its float32 -> bfloat16 casts truncate
instead of rounding to nearest, so bf16 is left to tests/gpu/test_rope_kernel_gpu.py."""

import os

import pytest
import torch

from mpcore.kernels.rope import rope, rope_reference, rope_triton
from mpcore.models.common.rope import RotaryEmbedding, apply_rope
from tests.unit.interpret import needs_triton, run_under_interpreter

# Norm-wise relative tolerance per rounded dtype: one rounding of an fp32 (or exact) value.
_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.float64: 1e-12}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _eager(x, cos, sin):
    """The rotation as models/rope.py wrote it before the fused op."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _make_x(num_tokens, num_heads, head_dim, dtype, view):
    """x [T, H, D]; "strided" is a column slice of a wider projection (token stride != H * D),
    as q is of the fused qkv output; "heads_major" has head stride > token stride."""
    if view == "strided":
        wide = torch.randn(num_tokens, num_heads * head_dim + 40).to(dtype)
        return wide[:, 8 : 8 + num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    if view == "heads_major":
        return torch.randn(num_heads, num_tokens, head_dim).to(dtype).transpose(0, 1)
    return torch.randn(num_tokens, num_heads, head_dim).to(dtype)


def _make_tables(num_tokens, head_dim, dtype):
    """Arbitrary cos/sin rows (not real angles): the two halves differ, so a kernel that mixes
    up c[i] and c[i + D/2] fails."""
    cos = torch.randn(num_tokens, head_dim).to(dtype)
    sin = torch.randn(num_tokens, head_dim).to(dtype)
    return cos, sin


def _check_against_float64(fn, shape, dtype, table_dtype, out_dtype, view):
    """Forward and dx of fn against float64 eager math and its autograd."""
    num_tokens, _, head_dim = shape
    x = _make_x(*shape, dtype, view).requires_grad_()
    cos, sin = _make_tables(num_tokens, head_dim, table_dtype)
    y = fn(x, cos, sin, out_dtype)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = _eager(x64, cos.double(), sin.double())
    y64.backward(dy.double())

    want_dtype = out_dtype or torch.result_type(x, cos)
    label = f"{shape} x {dtype} tables {table_dtype} out {want_dtype} {view}"
    assert y.shape == shape and y.dtype == want_dtype, label
    assert x.grad.shape == shape and x.grad.dtype == dtype, label
    for name, got, want, tol in [("y", y, y64, _TOL[want_dtype]),
                                 ("dx", x.grad, x64.grad, _TOL[dtype])]:
        err = _rel_err(got, want)
        assert err <= tol, f"{name} {label}: rel err {err:.2e} > {tol:.0e}"


f32, f16 = torch.float32, torch.float16
_CASES = [
    ((37, 3, 24), f32, f32, None, "plain"),
    ((15, 3, 24), f16, f16, None, "strided"),
    ((9, 3, 24), f16, f32, f16, "plain"),
    ((13, 5, 8), f32, f32, f16, "heads_major"),
    ((11, 1, 8), f16, f16, f32, "strided"),
    ((6, 4, 128), f16, f32, None, "heads_major"),
    ((5, 3, 128), f32, f16, None, "plain"),
]


@pytest.mark.parametrize("shape, dtype, table_dtype, out_dtype, view", _CASES)
def test_reference_matches_float64(shape, dtype, table_dtype, out_dtype, view):
    _check_against_float64(rope_reference, shape, dtype, table_dtype, out_dtype, view)


@pytest.mark.parametrize("dtype, table_dtype", [(torch.float64, f32), (f32, torch.float64)])
def test_reference_keeps_float64_precision(dtype, table_dtype):
    _check_against_float64(rope_reference, (7, 3, 24), dtype, table_dtype, None, "plain")


def _real_tables(num_tokens, head_dim, dtype=torch.float32):
    rotary = RotaryEmbedding(head_dim, theta=10000.0)
    rotary.reset_parameters()
    positions = torch.randint(0, 8192, (num_tokens,))
    return rotary(positions, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("tables", ["real", "random"])
def test_equals_eager_on_cpu(dtype, out_dtype, tables):
    """fp32 x, and bf16 x with fp32 tables (the autocast case): bitwise eager's rotation then
    ``.to(out_dtype)``, through rope, rope_reference and apply_rope."""
    x = (torch.randn(64, 4, 128) * 4.0).to(dtype)
    cos, sin = _real_tables(64, 128) if tables == "real" else _make_tables(64, 128, f32)
    want = _eager(x, cos, sin)
    want = want if out_dtype is None else want.to(out_dtype)
    for fn in (rope, rope_reference, apply_rope):
        got = fn(x, cos, sin, out_dtype)
        assert got.dtype == want.dtype
        assert torch.equal(got, want), f"{fn.__name__} {dtype} -> {want.dtype} differs from eager"
    assert torch.equal(apply_rope(x, cos, sin), _eager(x, cos, sin))


def test_dispatch_on_cpu_is_the_reference():
    x = torch.randn(9, 2, 16, dtype=torch.float16)
    cos, sin = _make_tables(9, 16, f32)
    assert torch.equal(rope(x, cos, sin, f16), rope_reference(x, cos, sin, f16))


def test_empty_input():
    for shape in [(0, 3, 8), (4, 0, 8)]:
        x = torch.randn(shape, requires_grad=True)
        cos, sin = _make_tables(shape[0], 8, f32)
        y = rope(x, cos, sin, torch.bfloat16)
        assert y.shape == shape and y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert x.grad.shape == shape


_x, (_cos, _sin) = torch.randn(5, 2, 8), _make_tables(5, 8, f32)


@pytest.mark.parametrize(
    "x, cos, sin, out_dtype, match",
    [
        (torch.randn(5, 16), _cos, _sin, None, r"\[T, heads, head_dim\].*\(5, 16\)"),
        (torch.randn(5, 2, 7), _cos[:, :7], _sin[:, :7], None, "even"),
        (_x, _cos[:4], _sin, None, r"cos must be \[T, head_dim\] = \(5, 8\).*\(4, 8\)"),
        (_x, _cos, _sin[:, :6], None, r"sin must be \[T, head_dim\].*\(5, 6\)"),
        (_x, _cos[:, None], _sin, None, r"cos must be \[T, head_dim\]"),
        (_x, _cos.clone().requires_grad_(), _sin, None, r"cos requires grad.*detach"),
        (_x, _cos, _sin.clone().requires_grad_(), None, r"sin requires grad.*detach"),
        (_x.int(), _cos, _sin, None, "floating point.*torch.int32"),
        (_x, _cos.half(), _sin, None, "share a dtype.*float16.*float32"),
        (_x, _cos, _sin, torch.int64, "out_dtype must be a floating-point dtype"),
    ],
)
def test_bad_input_raises(x, cos, sin, out_dtype, match):
    for fn in (rope, rope_reference, rope_triton, apply_rope):
        with pytest.raises(ValueError, match=match):
            fn(x, cos, sin, out_dtype)


def test_triton_rejects_float64_with_the_fix():
    cos, sin = _make_tables(3, 8, torch.float64)
    with pytest.raises(ValueError, match="rope_reference"):
        rope_triton(torch.randn(3, 2, 8), cos, sin)


def _saved_tensors(fn, x, cos, sin) -> list[torch.Tensor]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, cos, sin)
    return saved


def _check_saves_only_tables(fn):
    x = torch.randn(40, 4, 24, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _make_tables(40, 24, f32)
    saved = _saved_tensors(fn, x, cos, sin)
    assert len(saved) == 2, [tuple(t.shape) for t in saved]
    # The tables themselves (no copies), and neither x nor y.
    assert saved[0].data_ptr() == cos.data_ptr() and saved[1].data_ptr() == sin.data_ptr()
    assert [t.shape for t in saved] == [cos.shape, sin.shape]


def test_saves_only_cos_and_sin_for_backward():
    _check_saves_only_tables(rope)


def _check_compiles(fn):
    x = torch.randn(6, 16)
    weight = torch.randn(16, 2 * 8, requires_grad=True)
    cos, sin = _make_tables(6, 8, f32)

    def step(x, weight):
        y = fn((x @ weight).view(6, 2, 8), cos, sin, torch.float16)
        return (y.float() ** 2).sum()

    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, weight)
    want = step(x, weight)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        torch.autograd.grad(got, weight)[0], torch.autograd.grad(want, weight)[0]
    )


def test_torch_compile_fullgraph_matches_eager():
    _check_compiles(rope)


@needs_triton
@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    run_under_interpreter(__name__, f"interpreter checks passed: {len(_CASES) + 3}")


def _check_triton_equals_reference():
    """fp32 tables, fp16 x and output, D = 128 (4 column tiles of the interpreter's 16): the
    kernels do the reference's fp32 math and round once, so forward and dx agree value by value
    (the interpreter does not fuse multiply-adds)."""
    x = torch.randn(9, 3, 128).half()
    cos, sin = _real_tables(9, 128)
    dy = torch.randn(9, 3, 128).half()
    results = []
    for fn in (rope_triton, rope_reference):
        leaf = x.clone().requires_grad_()
        y = fn(leaf, cos, sin, f16)
        y.backward(dy)
        results.append((y.detach(), leaf.grad))
    for name, got, want in zip(("y", "dx"), *results, strict=True):
        assert torch.equal(got, want), f"{name}: triton differs from the reference"


def _interpreter_checks():
    from triton.runtime.interpreter import InterpretedFunction

    from mpcore.kernels import rope as module

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(module._rope_fwd_kernel, InterpretedFunction), "not interpreted"
    torch.manual_seed(0)
    # CPU tensors reach the kernels here; compiled Triton would refuse them. The CPU tiles are
    # at most 16 columns, 2 heads and 2-8 tokens, so the cases have ragged tails.
    for case in _CASES:
        _check_against_float64(rope_triton, *case)
    _check_triton_equals_reference()
    _check_saves_only_tables(rope_triton)
    _check_compiles(rope_triton)
    print(f"interpreter checks passed: {len(_CASES) + 3}")


if __name__ == "__main__":
    _interpreter_checks()
