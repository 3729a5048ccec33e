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
