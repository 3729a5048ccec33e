"""fla-core's Gated DeltaNet kernels against our PyTorch reference on CUDA (bf16 operands):
the short convolution and the chunked gated delta rule, forward and backward, on packed
documents of lengths 1, 2, 3, odd and long. Skipped without CUDA (conftest) or fla-core.
Tolerance: norm-wise relative error <= 2e-2 (bf16 operands; the reference runs in fp32 on the
same bf16 inputs); the whole tiny decoder under bf16 autocast: loss 1e-2, gradients 5e-2."""

import pytest
import torch
import torch.nn.functional as F

from mpcore.models.common.hybrid import deltanet, kernels
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.hybrid.model import build
from mpcore.models.common.inputs import local_text_inputs
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


def _model_grads(cfg, ids, cu, kernel: str, dtype: torch.dtype, device: str = "cuda"):
    """Loss and every parameter's gradient of the tiny decoder with DeltaNet ``kernel``: under
    bf16 autocast (``dtype`` bfloat16; fp32 weights), or wholly in ``dtype`` without autocast
    (the truth: float32 and the exact reference attention; the fused loss head takes no
    float64, and fp32 rounding sits three orders of magnitude below bf16's)."""
    state = ParallelState()
    half = dtype == torch.bfloat16
    model = build(cfg, state, seed=3, device=device, gdn_kernel=kernel,
                  dtype=torch.float32 if half else dtype,
                  attention_backend="auto" if half else "reference")
    _, inputs = local_text_inputs(state, ids, cu)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=half):
        loss = model(**inputs, output="loss").sum() / ids.numel()
    loss.backward()
    return float(loss.detach()), {n: p.grad.double() for n, p in model.named_parameters()}


def test_model_fla_matches_reference_under_bf16_autocast():
    """The whole tiny decoder (3 DeltaNet layers, 1 gated attention) with each kernel, on a
    packed stream, judged against the truth (the reference kernel in float32, no autocast): fla's
    bf16 loss and every gradient are within twice the reference kernel's own bf16 error, plus
    a small floor. (Compared with each other, two bf16 runs differ by both errors: A_log's
    gradient, a sum over every token of one head, showed 0.057 relative between them.)"""
    _fla_rule_or_skip()
    cfg = Qwen35Config(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64, intermediate_size=512,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=64, linear_value_head_dim=64)
    ids = torch.randint(0, 512, (sum(LENGTHS),), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    cu = _cu()
    true_loss, truth = _model_grads(cfg, ids, cu, "reference", torch.float32)
    ref_loss, ref = _model_grads(cfg, ids, cu, "reference", torch.bfloat16)
    fla_loss, fla = _model_grads(cfg, ids, cu, "fla", torch.bfloat16)
    assert abs(fla_loss - true_loss) <= 2 * abs(ref_loss - true_loss) + 1e-3 * true_loss
    worst = []
    for name, grad in truth.items():
        ours, theirs = _rel(ref[name], grad), _rel(fla[name], grad)
        worst.append((theirs / max(ours, 1e-3), name, theirs, ours))
        assert theirs <= 2 * ours + 1e-2, (name, theirs, ours)
    print("fla / reference bf16 error vs float32, worst:", sorted(worst)[-3:])
