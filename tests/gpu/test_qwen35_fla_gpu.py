"""fla-core's Gated DeltaNet kernels against our PyTorch reference on CUDA (bf16 operands):
the short convolution and the chunked gated delta rule, forward and backward, on packed
documents of lengths 1, 2, 3, odd and long (8k; 32k marked slow), at the released head size
(128) with value heads grouped over key heads. Skipped without CUDA (conftest) or fla-core.

The truth is float64: the rule in float64 on the same bf16-rounded inputs. fla's error (bf16
operands into its dots) must stay <= 2e-2 norm-wise; the reference's (fp32 math, bf16 output)
<= 5e-3. The whole tiny decoder under bf16 autocast, with each kernel, is judged against the
same decoder in float64 on the CPU: fla's loss, and each kind of parameter's gradient (worst
layer), within twice the reference kernel's own bf16 error plus a floor (the two bf16 runs,
compared with each other, differ by both errors: that is how A_log's gradient once showed
0.059 between them)."""

import pytest
import torch
import torch.nn.functional as F

from mpcore.models import family_named
from mpcore.models.common.hybrid import deltanet, kernels
from mpcore.models.common.hybrid.config import Qwen35Config
from tests.gpu.gpu_checks import rel_err
from tests.gpu.qwen35_grads import GateSums, check_against_float64, fla_rule_or_skip, model_grads

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(kernels.fla_ops() is None,
                                 reason=f"fla-core not installed ({kernels.INSTALL_HINT})")]
LENGTHS = [1, 2, 3, 77, 1000, 333, 5]


def test_auto_falls_back_where_fla_refuses():
    """Where fla cannot run the backward, ``auto`` picks the reference with one warning (and
    ``fla``, named, is refused at build time with fla's reason); where it can, ``auto`` picks
    fla for half-precision operands and the reference for float32 ones."""
    x = torch.zeros(4, 2, 128, device="cuda", dtype=torch.bfloat16)
    refusal = kernels.fla_refusal(torch.cuda.current_device())
    if refusal is None:
        assert kernels.resolve("auto", x) == "fla"
        assert kernels.resolve("auto", x.float()) == "reference"
        return
    with pytest.warns(UserWarning, match="refuses this GPU and Triton"):
        assert kernels.resolve("auto", x) == "reference"
    with pytest.raises(ValueError, match="refuses this GPU and Triton"):
        kernels.check_available("fla", "cuda")


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")


def _grads(out, inputs, weights):
    return torch.autograd.grad((out.to(weights.dtype) * weights).sum(), inputs)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_conv_fla_matches_reference_forward_backward(weight_dtype):
    # float32: the model's weight under bf16 autocast, which fla gets unrounded (its gradient
    # comes back in float32, as the reference's does).
    torch.manual_seed(0)
    cu = _cu(LENGTHS)
    t, c = sum(LENGTHS), 96
    x = torch.randn(t, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(c, 4, device="cuda", dtype=weight_dtype, requires_grad=True)
    pos = deltanet.segment_positions(cu, t)
    ours = kernels.short_conv(x, w, pos, cu, "reference")
    fla = kernels.short_conv(x, w, pos, cu, "fla")
    assert rel_err(fla, ours) < 2e-2
    weights = torch.randn(t, c, device="cuda")
    for a, b in zip(_grads(fla, (x, w), weights), _grads(ours, (x, w), weights), strict=True):
        assert a.dtype == b.dtype and rel_err(a, b) < 2e-2


def _rule_inputs(lengths, hk, hv, dk, dv, seed):
    gen = torch.Generator("cuda").manual_seed(seed)
    t = sum(lengths)
    bf = dict(device="cuda", dtype=torch.bfloat16)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k = randn(t, hk, dk).to(**bf), randn(t, hk, dk).to(**bf)
    v = randn(t, hv, dv).to(**bf)
    g = -F.softplus(randn(t, hv)) * 0.2  # fp32 log decays, as the layer makes them
    beta = torch.rand(t, hv, device="cuda", generator=gen).to(**bf)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


CASES = {"short": LENGTHS, "8k": [1, 2, 3, 8191, 77],
         "32k": pytest.param([3, 32768, 1], marks=pytest.mark.slow)}


@pytest.mark.parametrize("lengths", list(CASES.values()), ids=list(CASES))
def test_delta_rule_both_kernels_against_float64(lengths):
    """Released head size 128, value heads grouped over key heads (2 -> 4), packed documents;
    outputs and the gradients of q, k, v, g, beta against the rule in float64."""
    fla_rule_or_skip()
    inputs = _rule_inputs(lengths, 2, 4, 128, 128, seed=len(lengths))
    cu = _cu(lengths)
    wide = [x.detach().double().requires_grad_() for x in inputs]
    truth = deltanet.chunk_gated_delta_rule(*wide, cu)
    weights = torch.randn(truth.shape, device="cuda", dtype=torch.float64,
                          generator=torch.Generator("cuda").manual_seed(7))
    truth_grads = _grads(truth, wide, weights)
    names = ("out", "q", "k", "v", "g", "beta")
    report = {}
    for kernel in ("fla", "reference"):
        out = kernels.gated_delta_rule(*inputs, cu, kernel)
        errors = [rel_err(out, truth)] + [rel_err(a, b) for a, b in zip(
            _grads(out, inputs, weights), truth_grads, strict=True)]
        report[kernel] = dict(zip(names, errors, strict=True))
        del out
    print("rel error vs float64:", report)
    for kernel, bound in (("fla", 2e-2), ("reference", 5e-3)):
        for name, err in report[kernel].items():
            assert err <= bound, (kernel, name, err, report)


def test_model_fla_and_reference_against_float64():
    """The whole tiny decoder (3 DeltaNet layers at head size 128, 1 gated attention), bf16
    autocast with each kernel, against itself in float64 on the CPU. Prints each kernel's
    worst gradients (A_log among them): which error is fla's own and which is bf16's."""
    fla_rule_or_skip()
    cfg = Qwen35Config(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64, intermediate_size=512,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=128, linear_value_head_dim=128)
    ids = torch.randint(0, 512, (sum(LENGTHS),), generator=torch.Generator().manual_seed(0))
    cu = _cu(LENGTHS).cpu()
    family, s = family_named("qwen3_5"), dict(input_ids=ids, cu_seqlens=cu)
    sums = GateSums()
    truth = model_grads(family, cfg, s, "reference", torch.float64, device="cpu", gate_sums=sums)
    ref, fla = (model_grads(family, cfg, s, kernel, torch.bfloat16)
                for kernel in ("reference", "fla"))
    check_against_float64(truth, ref, fla, sums)


def test_layer_fla_path_matches_reference_path():
    """One GatedDeltaNet layer (the fla path: conv read in place, fla's grouped heads and its
    fused gated RMSNorm) against the same layer on the reference path, in float64 truth terms:
    the fla path's output and parameter gradients within twice the reference path's bf16
    error plus a floor, both against the layer in float64."""
    fla_rule_or_skip()
    from mpcore.models.common.decoder import init_weights
    from mpcore.models.common.hybrid.layers import GatedDeltaNet
    from mpcore.parallel.attention import AttentionPlan

    cfg = Qwen35Config(vocab_size=512, hidden_size=256, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=64, intermediate_size=512,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=128, linear_value_head_dim=128)
    lengths = [1, 2, 3, 77, 4000, 5]
    t = sum(lengths)
    cu = _cu(lengths)
    pos = deltanet.segment_positions(cu, t)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                  torch.tensor(lengths, device="cuda"))
    plan = AttentionPlan(doc, pos, cu.to(torch.int32))
    x = torch.randn(t, cfg.hidden_size, device="cuda", generator=torch.Generator(
        "cuda").manual_seed(4))
    results = {}
    for kernel, dtype in (("reference", torch.float64), ("reference", torch.bfloat16),
                          ("fla", torch.bfloat16)):
        device = "cpu" if dtype == torch.float64 else "cuda"  # our RMSNorm kernel: no float64
        layer = GatedDeltaNet(cfg, tp_group=None, sequence_parallel=False, gdn_kernel=kernel,
                              dtype=torch.float64 if device == "cpu" else torch.float32)
        layer = layer.to(device)
        init_weights(layer, 0)
        xi = x.to(device, layer.A_log.dtype).requires_grad_()
        here = AttentionPlan(*(t.to(device) for t in (plan.doc_id, plan.pos, plan.cu_seqlens)))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            y = layer(xi, here)
        (y.double() * x.to(device).double()).sum().backward()
        results[(kernel, dtype)] = [t.detach().double().cpu() for t in (
            y, *(p.grad for p in layer.parameters()))]
    names = ["out"] + [n for n, _ in layer.named_parameters()]
    truth = results[("reference", torch.float64)]
    for name, want, ours, theirs in zip(names, truth, results[("reference", torch.bfloat16)],
                                        results[("fla", torch.bfloat16)], strict=True):
        e_ref, e_fla = rel_err(ours, want), rel_err(theirs, want)
        print(f"{name}: reference bf16 {e_ref:.4f}, fla bf16 {e_fla:.4f}")
        assert e_fla <= 2 * e_ref + 1e-2, (name, e_fla, e_ref)
