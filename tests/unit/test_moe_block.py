"""mpcore.models.common.moe.MoeBlock vs transformers' sparse MoE blocks, and the aux-loss formula.

- Qwen3-MoE's block (no renormalisation) and Qwen2-MoE's (renormalised, shared expert gated
  by sigmoid(shared_expert_gate)): outputs and every gradient (router, experts, shared expert,
  input) within 1e-5 in float64;
- the statistics: tokens per expert sum to T * k, dropped is 0, masked tokens are not counted,
  and the pooled share equals transformers' ``load_balancing_loss_func`` on the same logits.
"""

from __future__ import annotations

import pytest
import torch

from mpcore.models.common.moe import MoeBlock
from mpcore.models.common.moe_loss import aux_share, global_counts, load_balancing_loss, pool_layers


def _hf_block(kind: str, norm: bool):
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common = dict(hidden_size=16, num_experts=6, num_experts_per_tok=3,
                  moe_intermediate_size=12, norm_topk_prob=norm)
    if kind == "qwen3":
        cfg = transformers.Qwen3MoeConfig(**common)
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=20)
        block = Qwen2MoeSparseMoeBlock(cfg)
    cfg._experts_implementation = "eager"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return block.double()


@pytest.mark.parametrize("kind,norm", [("qwen3", False), ("qwen3", True), ("qwen2", True)])
def test_block_matches_transformers(kind, norm):
    hf = _hf_block(kind, norm)
    shared = 20 if kind == "qwen2" else None
    ours = MoeBlock(16, 6, 3, 12, norm_topk_prob=norm, shared_intermediate=shared,
                    dtype=torch.float64)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.w13.copy_(hf.experts.gate_up_proj)
        ours.experts.w2.copy_(hf.experts.down_proj)
        if shared:
            se = hf.shared_expert
            ours.shared_expert.w13.copy_(torch.cat([se.gate_proj.weight, se.up_proj.weight]))
            ours.shared_expert.w2.copy_(se.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(23, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf = hf(x1[None])[0]
    y = ours(x2)
    assert float((y - y_hf).detach().abs().max()) < 1e-10
    g = torch.randn_like(y)
    (y_hf * g).sum().backward()
    (y * g).sum().backward()
    assert float((x1.grad - x2.grad).abs().max()) < 1e-10
    assert torch.allclose(ours.gate.weight.grad, hf.gate.weight.grad, atol=1e-10)
    assert torch.allclose(ours.experts.w13.grad, hf.experts.gate_up_proj.grad, atol=1e-10)
    assert torch.allclose(ours.experts.w2.grad, hf.experts.down_proj.grad, atol=1e-10)
    if shared:
        assert torch.allclose(ours.shared_expert_gate.weight.grad,
                              hf.shared_expert_gate.weight.grad, atol=1e-10)
    stats = ours.last_stats
    assert float(stats.counts.sum()) == 23 * 3 and stats.dropped == 0


def test_pooled_share_is_transformers_load_balancing_loss_and_mask_drops_rows():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    gen = torch.Generator().manual_seed(2)
    blocks = [MoeBlock(16, 6, 2, 8, norm_topk_prob=True) for _ in range(3)]
    for i, b in enumerate(blocks):
        b.reset_parameters(100 + i)
    xs = [torch.randn(31, 16, generator=gen) for _ in blocks]
    logits = []
    for b, x in zip(blocks, xs, strict=True):
        b(x)
        logits.append(torch.nn.functional.linear(x, b.gate.weight))
    pooled = pool_layers(b.last_stats for b in blocks)
    counts, rows = global_counts([pooled], None)
    ref = load_balancing_loss_func(tuple(logits), 6, 2)
    assert abs(float(aux_share(pooled, counts, rows)) - float(ref)) < 1e-6
    assert abs(float(load_balancing_loss(counts, pooled.prob_sum, rows)) - float(ref)) < 1e-6
    # Masked rows (cp padding) are out of every sum, as transformers' attention_mask.
    mask = torch.arange(31) < 20
    for b, x in zip(blocks, xs, strict=True):
        b.token_mask = mask
        b(x)
    pooled = pool_layers(b.last_stats for b in blocks)
    counts, rows = global_counts([pooled], None)
    ref = load_balancing_loss_func(tuple(lg[:20] for lg in logits), 6, 2)
    assert float(rows) == 3 * 20 and float(counts.sum()) == 3 * 20 * 2
    assert abs(float(aux_share(pooled, counts, rows)) - float(ref)) < 1e-6


def test_z_share_is_the_mean_squared_logsumexp_over_real_rows():
    from mpcore.models.common.moe_loss import z_share

    block = MoeBlock(16, 6, 2, 8, norm_topk_prob=False)
    block.reset_parameters(5)
    x = torch.randn(17, 16, generator=torch.Generator().manual_seed(4))
    block.token_mask = torch.arange(17) != 3  # one padding row
    block(x)
    stats = block.last_stats
    lse = torch.logsumexp(torch.nn.functional.linear(x, block.gate.weight), -1)
    want = lse[block.token_mask].square().mean()
    assert abs(float(z_share(stats, stats.tokens).detach()) - float(want)) < 1e-6


def test_bad_block_arguments():
    with pytest.raises(ValueError, match=r"num_experts_per_tok 7 must be in \[1, num_experts"):
        MoeBlock(8, 6, 7, 4, norm_topk_prob=False)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_gemm_equals_the_reference_with_empty_experts():
    from mpcore.models.common.moe import grouped_swiglu_experts, swiglu_experts

    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(4, 48, 32, generator=gen, requires_grad=True)
    w2 = torch.randn(4, 32, 24, generator=gen, requires_grad=True)
    x = torch.randn(13, 32, generator=gen, requires_grad=True)
    counts = [5, 0, 8, 0]  # two experts without a row
    g = torch.randn(13, 32, generator=gen)
    outs = []
    for fn in (swiglu_experts, grouped_swiglu_experts):
        y = fn(x, w13, w2, counts)
        (y * g).sum().backward()
        outs.append((y.detach(), x.grad.clone(), w13.grad.clone(), w2.grad.clone()))
        x.grad = w13.grad = w2.grad = None
    for a, b in zip(*outs, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert float(outs[1][2][1].abs().sum()) == 0.0  # an empty expert gets a zero gradient


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_gemm_under_autocast_takes_fp32_master_weights():
    """Training's mixed precision (fp32 weights, bf16 autocast): the grouped GEMM casts its
    operands as autocast casts ``F.linear`` (autocast does not cover ``_grouped_mm``, so before
    it refused fp32 weights beside bf16 rows): the same bf16 result as the reference, and fp32
    gradients for the fp32 weights."""
    from mpcore.models.common.moe import grouped_swiglu_experts, swiglu_experts

    gen = torch.Generator().manual_seed(4)
    w13 = torch.randn(3, 64, 32, generator=gen, requires_grad=True)
    w2 = torch.randn(3, 32, 32, generator=gen, requires_grad=True)
    x = torch.randn(12, 32, generator=gen)
    outs = []
    for fn in (swiglu_experts, grouped_swiglu_experts):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x, w13, w2, [4, 0, 8])
        y.float().sum().backward()
        outs.append((y, w13.grad, w2.grad))
        w13.grad = w2.grad = None
    (ref, ref13, ref2), (got, got13, got2) = outs
    assert got.dtype == ref.dtype == torch.bfloat16 and torch.equal(got, ref)
    assert got13.dtype == got2.dtype == torch.float32
    for a, b in ((got13, ref13), (got2, ref2)):
        assert float((a - b).norm() / b.norm()) < 1e-2  # bf16 products, summed differently


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_gemm_is_offered_only_for_the_dtype_and_widths_it_takes():
    """The grouped GEMM's fitness is judged in the dtype it would run in: float64 (a float64
    reference model on CUDA) runs the loop under ``auto`` and is refused by name under
    ``grouped``; under bf16 autocast the widths must align in bf16, not in the fp32 weights'
    size (36 fp32 columns are 144 bytes, 16-aligned; in bf16 they are 72, which is not)."""
    from mpcore.models.common.moe import grouped_available, run_experts, swiglu_experts

    gen = torch.Generator().manual_seed(5)
    w13 = torch.randn(2, 48, 32, generator=gen, dtype=torch.float64)
    w2 = torch.randn(2, 32, 24, generator=gen, dtype=torch.float64)
    x = torch.randn(6, 32, generator=gen, dtype=torch.float64)
    assert grouped_available(x.float(), w13.float(), w2.float())
    assert not grouped_available(x, w13, w2)
    with pytest.raises(ValueError, match=r"operands in .*torch.float32.* run in torch.float64"):
        run_experts(x, w13, w2, [2, 4], backend="grouped")
    torch.testing.assert_close(run_experts(x, w13, w2, [2, 4], backend="auto"),
                               swiglu_experts(x, w13, w2, [2, 4]), rtol=0, atol=0)

    narrow = torch.randn(2, 36, 32, generator=gen)  # 2I = 36: 16-aligned in fp32 only
    assert grouped_available(x.float(), narrow, w2.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not grouped_available(x.float(), narrow, w2.float())
        assert grouped_available(x.float(), w13.float(), w2.float())
