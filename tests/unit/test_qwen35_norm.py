"""The zero-centred RMSNorm option (Qwen3.5): ``(1 + w) * x / rms(x)``, weight starting at 0,
equal to transformers' ``Qwen3_5RMSNorm``; the scale is formed in fp32 even for a bf16 weight;
the default norm is unchanged (weight starts at 1)."""

import torch

from mpcore.models.common.norm import RMSNorm


def test_zero_centred_matches_transformers_and_keeps_the_scale_in_fp32():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    plain, centred = RMSNorm(8, 1e-6), RMSNorm(8, 1e-6, zero_centred=True)
    plain.reset_parameters(), centred.reset_parameters()
    assert torch.equal(plain.weight, torch.ones(8)) and torch.equal(centred.weight, torch.zeros(8))
    x = torch.randn(5, 8)
    assert torch.equal(centred(x), plain(x))  # both scale by one at init
    hf = Qwen3_5RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        w = 0.3 * torch.randn(8)
        hf.weight.copy_(w), centred.weight.copy_(w)
    assert (centred(x) - hf(x)).abs().max() < 1e-6
    half = RMSNorm(8, 1e-6, zero_centred=True, dtype=torch.bfloat16)
    with torch.no_grad():
        half.weight.copy_(w.bfloat16())
        centred.weight.copy_(w.bfloat16().float())
    assert torch.equal(half(x), centred(x))  # 1 + w added in fp32, not rounded to bf16


def test_zero_centred_writes_the_input_dtype_without_autocast():
    """A bf16 model without autocast (``score.py --dtype bfloat16``): the fp32 ``1 + w`` scale
    must not promote the rows to fp32, or the next bf16 projection refuses them; transformers'
    ``Qwen3_5RMSNorm`` returns x's dtype too. An explicit ``out_dtype`` still wins."""
    norm = RMSNorm(8, 1e-6, zero_centred=True, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(8))
    x, delta = torch.randn(5, 8).bfloat16(), torch.randn(5, 8).bfloat16()
    assert norm(x).dtype == torch.bfloat16
    s, y = norm.add(x, delta)
    assert s.dtype == y.dtype == torch.bfloat16
    assert norm(x, torch.float32).dtype == torch.float32
    # One rounding of the fp32 result, as transformers' type_as(x).
    assert torch.equal(norm(x), norm(x, torch.float32).bfloat16())
