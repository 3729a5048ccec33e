"""LayerNorm (``mpcore.kernels.layernorm``): the reference against float64 ``F.layer_norm`` and eager
autocast's float32 LayerNorm, the Triton kernels on CPU tensors under Triton's interpreter (this
file re-runs itself with TRITON_INTERPRET=1; fp32 and fp16, since the interpreter's bf16 casts
truncate), and the kernels compiled for sm_90 without a GPU (16-byte vector accesses)."""

import os

import pytest
import torch
import torch.nn.functional as F

from mpcore.kernels.layernorm import layer_norm, layer_norm_reference, layer_norm_triton
from tests.unit.interpret import global_accesses, needs_triton, run_under_interpreter, sm90_ptx

_TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.float64: 1e-12}
# (rows, H, x dtype): ragged widths, and more rows than the interpreter's 4 backward programs
# so that each walks a slab of several rows.
_CASES = [(37, 100, torch.float32), (37, 100, torch.float16), (5, 64, torch.float32),
          (19, 33, torch.float16)]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _inputs(rows, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 3 + 1.5).to(dtype)
    wdtype = torch.promote_types(dtype, torch.float32)  # fp32 master weights; f64 with f64
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(wdtype)
    bias = (0.2 * torch.randn(hidden, generator=gen)).to(wdtype)
    return x, weight, bias


def _check_against_float64(fn, rows, hidden, dtype, out_dtype=None):
    x, weight, bias = _inputs(rows, hidden, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = fn(*leaves, 1e-5, out_dtype)
    dy = torch.randn(y.shape).to(y.dtype)
    y.backward(dy)
    ref = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    y64 = F.layer_norm(ref[0], (hidden,), ref[1], ref[2], 1e-5)
    y64.backward(dy.double())
    want = out_dtype or torch.promote_types(dtype, torch.float32)
    assert y.dtype == want and y.shape == x.shape
    assert [t.grad.dtype for t in leaves] == [dtype, weight.dtype, weight.dtype]
    tol = max(_TOL[dtype], _TOL.get(want, 0.0))
    for name, got, exp in [("y", y, y64), ("dx", leaves[0].grad, ref[0].grad),
                           ("dweight", leaves[1].grad, ref[1].grad),
                           ("dbias", leaves[2].grad, ref[2].grad)]:
        err = _rel_err(got, exp)
        assert err <= tol, f"{name} {dtype} ({rows}, {hidden}): rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("rows, hidden, dtype", _CASES)
def test_reference_matches_float64(rows, hidden, dtype):
    _check_against_float64(layer_norm_reference, rows, hidden, dtype)


def test_reference_keeps_float64_precision():
    _check_against_float64(layer_norm_reference, 7, 33, torch.float64)


def test_reference_is_float32_layer_norm():
    """What CUDA autocast runs for a bf16 input (``F.layer_norm`` on its float32 upcast, a
    float32 result), bit for bit; with ``out_dtype`` the same result rounded once, as the next
    matmul would round it."""
    x, weight, bias = _inputs(16, 48, torch.bfloat16)
    eager = F.layer_norm(x.float(), (48,), weight, bias, 1e-6)
    assert torch.equal(layer_norm_reference(x, weight, bias, 1e-6), eager)
    assert torch.equal(layer_norm_reference(x, weight, bias, 1e-6, torch.bfloat16),
                       eager.bfloat16())


def test_dispatch_on_cpu_is_the_reference():
    x, weight, bias = _inputs(6, 17, torch.float32)
    assert torch.equal(layer_norm(x, weight, bias), layer_norm_reference(x, weight, bias))


@pytest.mark.parametrize("args, match", [
    ((torch.randn(4, 8), torch.ones(7), torch.zeros(8)), r"weight must have shape \[H\] = \(8,\)"),
    ((torch.randn(4, 8), torch.ones(8), torch.zeros(3)), r"bias must have shape \[H\] = \(8,\)"),
    ((torch.ones(4, 8, dtype=torch.int32), torch.ones(8), torch.zeros(8)), "float tensor"),
])
def test_bad_inputs_raise(args, match):
    for fn in (layer_norm, layer_norm_reference, layer_norm_triton):
        with pytest.raises(ValueError, match=match):
            fn(*args)


def test_triton_refuses_float64_with_the_fix():
    with pytest.raises(ValueError, match="layer_norm_reference"):
        layer_norm_triton(*_inputs(3, 8, torch.float64))


@needs_triton
@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_kernels_compile_for_sm90_with_vector_accesses(which):
    """Triton lowers the kernels to PTX for an H100/H200 here (no GPU needed): bf16 rows of a
    width divisible by 16 must load and store in vectors (``.v4`` / ``.v2``: 16 or 8 bytes),
    not one 2-byte element at a time."""
    from mpcore.kernels import layernorm

    if which == "fwd":
        sig = {"x_ptr": "*bf16", "w_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16",
               "rstd_ptr": "*fp32", "x_row_stride": "i32", "y_row_stride": "i32", "H": "i32",
               "eps": "fp32"}
    else:
        sig = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*fp32", "rstd_ptr": "*fp32",
               "dx_ptr": "*bf16", "dw_partial_ptr": "*fp32", "db_partial_ptr": "*fp32",
               "dy_row_stride": "i32", "x_row_stride": "i32", "dx_row_stride": "i32",
               "M": "i32", "H": "i32", "rows_per_program": "i32"}
    kernel = getattr(layernorm, f"_layer_norm_{which}_kernel")
    ptx = sm90_ptx(kernel, sig, {"BLOCK_H": 2048}, num_warps=8)
    scalar = sorted(a for a in global_accesses(ptx) if a.endswith("b16"))
    assert not scalar, f"scalar 2-byte accesses: {scalar}"


@needs_triton
@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    run_under_interpreter(__name__, f"interpreter checks passed: {len(_CASES) + 2}")


def _interpreter_checks():
    from triton.runtime.interpreter import InterpretedFunction

    from mpcore.kernels import layernorm as module

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(module._layer_norm_fwd_kernel, InterpretedFunction), "not interpreted"
    torch.manual_seed(0)
    for case in _CASES:
        _check_against_float64(layer_norm_triton, *case)
    _check_against_float64(layer_norm_triton, 23, 40, torch.float32, out_dtype=torch.float16)
    # Leading dims and a non-contiguous view (rows not adjacent in memory): the same as the
    # reference, in its shape.
    x, weight, bias = _inputs(3 * 5, 24, torch.float32)
    x = x.view(3, 5, 24).transpose(0, 1)
    got, want = layer_norm_triton(x, weight, bias), layer_norm_reference(x, weight, bias)
    assert got.shape == x.shape and _rel_err(got, want) <= 1e-6
    print(f"interpreter checks passed: {len(_CASES) + 2}")


if __name__ == "__main__":
    _interpreter_checks()
