"""Triton RoPE on CUDA (bf16, fp16, fp32) against float64 math and the eager rotation: forward,
dx, the autocast case (bf16 x, fp32 tables, bf16 out) against eager (one bf16 ulp plus the fp32
rounding of the products: see ``_check_against_eager``), the memory
it allocates, and torch.compile. bf16 is covered here only: the CPU interpreter truncates
float32 -> bfloat16 casts (tests/unit/test_rope_kernel.py)."""

import pytest
import torch

from mpcore.kernels.rope import rope, rope_reference
from mpcore.models.common.rope import RotaryEmbedding

pytestmark = pytest.mark.gpu

# Norm-wise relative tolerance per rounded dtype: one rounding of an fp32 value.
_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 5e-3}


def _eager(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _tables(num_tokens, head_dim, dtype, kind="random"):
    """Real cos/sin of random positions, or arbitrary rows whose two halves differ."""
    if kind == "real":
        rotary = RotaryEmbedding(head_dim, theta=500000.0).cuda()
        rotary.reset_parameters()
        return rotary(torch.randint(0, 131072, (num_tokens,), device="cuda"), dtype)
    cos = torch.randn(num_tokens, head_dim, device="cuda").to(dtype)
    return cos, torch.randn(num_tokens, head_dim, device="cuda").to(dtype)


def _check_against_float64(x, cos, sin, out_dtype=None):
    x.requires_grad_()
    y = rope(x, cos, sin, out_dtype)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = _eager(x64, cos.double(), sin.double())
    y64.backward(dy.double())

    want_dtype = out_dtype or torch.result_type(x, cos)
    label = f"{tuple(x.shape)} x {x.dtype} tables {cos.dtype} out {want_dtype}"
    assert y.dtype == want_dtype and y.shape == x.shape, label
    assert x.grad.dtype == x.dtype and x.grad.shape == x.shape, label
    for name, got, want, tol in [("y", y, y64, _TOL[want_dtype]),
                                 ("dx", x.grad, x64.grad, _TOL[x.dtype])]:
        err = _rel_err(got, want)
        assert err <= tol, f"{name} {label}: rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tables", ["fp32", "same"])
@pytest.mark.parametrize("shape", [(2048, 32, 128), (1000, 8, 64), (37, 3, 24), (5, 1, 8)])
def test_triton_matches_float64(dtype, tables, shape):
    table_dtype = torch.float32 if tables == "fp32" else dtype
    cos, sin = _tables(shape[0], shape[2], table_dtype)
    _check_against_float64(torch.randn(shape, device="cuda").to(dtype), cos, sin)


@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, torch.bfloat16),
                                              (torch.bfloat16, torch.float32),
                                              (torch.float16, torch.bfloat16)])
def test_out_dtype_differs_from_x(dtype, out_dtype):
    cos, sin = _tables(333, 96, torch.float32)
    _check_against_float64(torch.randn(333, 5, 96, device="cuda").to(dtype), cos, sin, out_dtype)


def test_strided_q_from_fused_projection():
    """q as attention.py gets it: a column slice of the qkv output, token stride != H * D."""
    qkv = torch.randn(777, (16 + 2 * 4) * 128, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : 16 * 128].view(777, 16, 128)
    cos, sin = _tables(777, 128, torch.float32, "real")
    _check_against_float64(q, cos, sin, torch.bfloat16)


def _bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |t| (8 significand bits)."""
    magnitude = t.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - 7)


def _check_against_eager(x, cos, sin):
    """bf16 x, fp32 tables, bf16 out (training under autocast): eager and the kernel both
    compute ``y1 = x1 c1 - x2 s1`` in fp32 and round once to bf16, but the kernel may fuse a
    multiply-add, so the two fp32 values differ by rounding errors of the PRODUCTS, not of y.

    Each evaluation of ``p + q`` (p, q the two products) is within ``2u (|p| + |q|)`` of the
    exact value (u = 2^-24: eager rounds p, q and the sum; the fused form rounds q and the
    sum), so they differ by at most ``2^-22 (|p| + |q|)``; rounding both to bf16 adds at most
    one bf16 ulp. Where p and q nearly cancel, |y| is far below |p| + |q| and that fp32 term
    is many bf16 ulps of y (seen: 7 ulps at |y| = 3e-6, |p| + |q| = 5): "one ulp of y" is
    not a bound any fp32 evaluation order meets. Elsewhere the bound is one ulp, and at
    least 99% of the outputs must be bitwise equal to eager."""
    got = rope(x, cos, sin, torch.bfloat16)
    want = _eager(x, cos, sin).to(torch.bfloat16)
    diff = (got.float() - want.float()).abs()
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([xf[..., half:], xf[..., :half]], dim=-1).abs()
    products = xf.abs() * cos.abs()[:, None, :] + rotated * sin.abs()[:, None, :]
    larger = torch.maximum(got.float().abs(), want.float().abs())
    bound = _bf16_ulp(larger) + 2.0**-22 * products
    excess = (diff - bound).max().item()
    assert excess <= 0, f"max diff {diff.max().item():.3e}, over the bound by {excess:.3e}"
    same = (got == want).float().mean().item()
    assert same >= 0.99, f"only {same:.4f} of outputs equal eager"


def test_large_bf16_matches_float64_and_eager():
    """16k tokens x 32 heads x 64: the autocast case, against float64 and eager."""
    x = torch.randn(16384, 32, 64, device="cuda").bfloat16()
    cos, sin = _tables(16384, 64, torch.float32, "real")
    _check_against_float64(x, cos, sin, torch.bfloat16)
    _check_against_eager(x.detach(), cos, sin)


@pytest.mark.parametrize("tables", ["real", "random"])
def test_bf16_with_fp32_tables_within_one_ulp_of_eager(tables):
    x = (torch.randn(4096, 8, 128, device="cuda") * 4.0).bfloat16()
    _check_against_eager(x, *_tables(4096, 128, torch.float32, tables))


def test_fp32_close_to_reference_on_cuda():
    x = torch.randn(500, 6, 128, device="cuda")
    cos, sin = _tables(500, 128, torch.float32, "real")
    torch.testing.assert_close(rope(x, cos, sin), rope_reference(x, cos, sin),
                               rtol=1e-6, atol=1e-6)


def _peak_bytes(fn, x, cos, sin) -> int:
    """CUDA memory allocated at the peak of fn's forward, beyond what existed before."""
    fn(x, cos, sin)  # warm up: compile the kernels outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = fn(x, cos, sin)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del y
    return peak


def test_allocates_only_the_output():
    x = torch.randn(16384, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _tables(16384, 64, torch.float32, "real")
    y_bytes = x.numel() * x.element_size()  # 64 MiB

    def fused(x, cos, sin):
        return rope(x, cos, sin, torch.bfloat16)

    def eager(x, cos, sin):
        return _eager(x, cos, sin).to(torch.bfloat16)

    assert _peak_bytes(fused, x, cos, sin) == y_bytes
    # Eager holds fp32 x * cos, rot(x) * sin and their sum at once: 6x the output.
    assert _peak_bytes(eager, x, cos, sin) >= 4 * y_bytes


def test_saves_only_cos_and_sin():
    x = torch.randn(64, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _tables(64, 128, torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rope(x, cos, sin, torch.bfloat16)
    assert [t.data_ptr() for t in saved] == [cos.data_ptr(), sin.data_ptr()]


def test_torch_compile_fullgraph_matches_eager():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, 4 * 64, device="cuda", dtype=torch.bfloat16) / 16
    weight.requires_grad_()
    cos, sin = _tables(64, 64, torch.float32, "real")

    def step(x, weight):
        q = (x @ weight).view(64, 4, 64)
        return rope(q, cos, sin, torch.bfloat16).float().square().sum()

    got = torch.compile(step, fullgraph=True)(x, weight)
    want = step(x, weight)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    grad_got = torch.autograd.grad(got, weight)[0]
    grad_want = torch.autograd.grad(want, weight)[0]
    torch.testing.assert_close(grad_got, grad_want, rtol=2e-2, atol=2e-2)
