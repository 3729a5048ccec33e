"""fla-core's Gated DeltaNet kernels against our PyTorch reference on CUDA (bf16 operands):
the short convolution and the chunked gated delta rule, forward and backward, on packed
documents of lengths 1, 2, 3, odd and long. Skipped without CUDA (conftest) or fla-core.
Tolerance: norm-wise relative error <= 2e-2 (bf16 operands; the reference runs in fp32 on the
same bf16 inputs); the whole tiny decoder under bf16 autocast: loss 1e-2, gradients 5e-2."""

import pytest
import torch
import torch.nn.functional as F

from mpcore.models.common.hybrid import deltanet, kernels
from mpcore.models.common.hybrid.model import build
from mpcore.models.common.inputs import local_text_inputs
from mpcore.models.qwen3_5 import Qwen35Config
from mpcore.parallel.state import ParallelState

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(kernels.fla_ops() is None,
                                 reason=f"fla-core not installed ({kernels.INSTALL_HINT})")]


def _fla_rule_or_skip():
    """fla refuses some GPU / Triton pairs at run time (``kernels.fla_refusal``): then there is
    no fla delta rule to compare, and ``auto`` runs the reference (the test below)."""
    refusal = kernels.fla_refusal(torch.cuda.current_device())
    if refusal is not None:
        pytest.skip(f"fla-core refuses this GPU and Triton: {refusal}")


def test_auto_falls_back_where_fla_refuses():
    """Where fla cannot run the backward, ``auto`` picks the reference (and ``fla``, named,
    is refused at build time with fla's reason); where it can, ``auto`` picks fla."""
    x = torch.zeros(4, 2, 8, device="cuda", dtype=torch.bfloat16)
    refusal = kernels.fla_refusal(torch.cuda.current_device())
    if refusal is None:
        assert kernels.resolve("auto", x) == "fla"
        return
    with pytest.warns(UserWarning, match="cannot run the gated delta rule"):
        assert kernels.resolve("auto", x) == "reference"
    with pytest.raises(ValueError, match="refuses this GPU and Triton"):
        kernels.check_available("fla", "cuda")
LENGTHS = [1, 2, 3, 77, 1000, 333, 5]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _cu():
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda")


def _grads(out, inputs, weights):
    return torch.autograd.grad((out.float() * weights).sum(), inputs)


def test_conv_fla_matches_reference_forward_backward():
    torch.manual_seed(0)
    cu = _cu()
    t, c = sum(LENGTHS), 96
    x = torch.randn(t, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(c, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = deltanet.segment_positions(cu, t)
    ours = kernels.short_conv(x, w, pos, cu, "reference")
    fla = kernels.short_conv(x, w, pos, cu, "fla")
    assert _rel(fla, ours) < 2e-2
    weights = torch.randn(t, c, device="cuda")
    for a, b in zip(_grads(fla, (x, w), weights), _grads(ours, (x, w), weights), strict=True):
        assert _rel(a, b) < 2e-2


@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])
def test_delta_rule_fla_matches_reference_forward_backward(heads):
    _fla_rule_or_skip()
    torch.manual_seed(1)
    hk, hv = heads
    cu = _cu()
    t, dk, dv = sum(LENGTHS), 64, 64
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(t, hk, dk, **bf).requires_grad_()
    k = torch.randn(t, hk, dk, **bf).requires_grad_()
    v = torch.randn(t, hv, dv, **bf).requires_grad_()
    g = (-F.softplus(torch.randn(t, hv, device="cuda")) * 0.2).requires_grad_()
    beta = torch.rand(t, hv, **bf).requires_grad_()
    inputs = (q, k, v, g, beta)
    ours = kernels.gated_delta_rule(*inputs, cu, "reference")
    fla = kernels.gated_delta_rule(*inputs, cu, "fla")
    assert _rel(fla, ours) < 2e-2
    weights = torch.randn(t, hv, dv, device="cuda")
    for a, b in zip(_grads(fla, inputs, weights), _grads(ours, inputs, weights), strict=True):
        assert _rel(a, b) < 2e-2


def test_model_fla_matches_reference_under_bf16_autocast():
    """The whole tiny decoder (3 DeltaNet layers, 1 gated attention) with each kernel, on a
    packed stream: loss and every gradient agree."""
    _fla_rule_or_skip()
    cfg = Qwen35Config(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64, intermediate_size=512,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=64, linear_value_head_dim=64)
    ids = torch.randint(0, 512, (sum(LENGTHS),), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    cu = _cu()
    results = []
    for kernel in ("reference", "fla"):
        state = ParallelState()
        model = build(cfg, state, seed=3, device="cuda", gdn_kernel=kernel)
        _, inputs = local_text_inputs(state, ids, cu)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**inputs, output="loss").sum() / ids.numel()
        loss.backward()
        results.append((float(loss), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (fla_loss, fla_grads) = results
    assert abs(fla_loss - ref_loss) / ref_loss < 1e-2
    for name, grad in fla_grads.items():
        assert _rel(grad, ref_grads[name]) < 5e-2, name
