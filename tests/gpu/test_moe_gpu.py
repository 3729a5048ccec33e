"""The MoE block on CUDA: ``auto`` takes PyTorch's grouped GEMM (``torch._grouped_mm``) when
this torch has it, and equals the per-expert reference in bf16 (forward and every gradient,
empty experts included) and in float64 math; at ep = 1 that path never makes the host wait
for the device, forward or backward (CUDA's sync debug mode raises on any sync; the CPU twin
is tests/dist/test_moe_host_syncs.py). Not run on the CPU machine (no device)."""

import pytest
import torch

from mpcore.models.common.moe import MoeBlock, grouped_available, swiglu_experts

pytestmark = pytest.mark.gpu


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_block_matches_reference_on_cuda(dtype):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm: the block runs the reference")
    torch.manual_seed(0)
    blocks = {}
    for backend in ("auto", "reference"):
        block = MoeBlock(256, 16, 4, 128, norm_topk_prob=True, experts_backend=backend,
                         device="cuda", dtype=dtype)
        block.reset_parameters(7)
        blocks[backend] = block
    x = torch.randn(1000, 256, device="cuda", dtype=dtype)
    x[:, 0] += 10.0  # a skewed router: some experts get few or no rows
    g = torch.randn_like(x)
    out = {}
    for backend, block in blocks.items():
        xi = x.clone().requires_grad_()
        y = block(xi)
        (y.float() * g.float()).sum().backward()
        out[backend] = [y, xi.grad] + [p.grad for p in block.parameters()]
    assert grouped_available(x, blocks["auto"].experts.w13, blocks["auto"].experts.w2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(out["auto"], out["reference"], strict=True):
        assert _rel(a, b) < tol


def test_reference_is_float64_math_on_cuda():
    torch.manual_seed(1)
    w13 = torch.randn(4, 64, 32, device="cuda", dtype=torch.float64)
    w2 = torch.randn(4, 32, 32, device="cuda", dtype=torch.float64)
    x = torch.randn(20, 32, device="cuda", dtype=torch.float64)
    y = swiglu_experts(x, w13, w2, [5, 0, 10, 5])
    gate, up = (x[5:15] @ w13[2].T).chunk(2, -1)
    assert torch.allclose(y[5:15], (torch.nn.functional.silu(gate) * up) @ w2[2].T)


@pytest.mark.parametrize("weights", ["bf16", "fp32_autocast"])
def test_ep1_grouped_block_never_syncs_on_cuda(weights):
    """Forward and backward of an ep = 1 block on the grouped path under
    ``torch.cuda.set_sync_debug_mode("error")``: bf16 weights, and training's fp32 weights
    under bf16 autocast."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm: the block runs the reference")
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    block = MoeBlock(256, 16, 4, 128, norm_topk_prob=True, shared_intermediate=128,
                     experts_backend="grouped", device="cuda", dtype=dtype)
    block.reset_parameters(3)
    x = torch.randn(1000, 256, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=weights != "bf16")

    def step():
        with autocast:
            y = block(x)
        (y.float() * g.float()).sum().backward()

    step()  # warm-up: lazy CUDA and cuBLAS setup may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())
