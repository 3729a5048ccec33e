"""Partial rotary and GPT-J (adjacent-pair) rotation in ``mpcore.models.common.rope``, vs the eager
formulas of transformers' GLM-4V (``rotate_half_llm`` on the first ``rotary_dim`` dims), and the
config checks of the new ``ModelConfig`` fields."""

from __future__ import annotations

import pytest
import torch

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.rope import RotaryEmbedding, apply_rope


def _gptj_eager(x, angles):
    """GLM-4V's eager rotation: angles ``[T, r/2]`` repeated per pair, adjacent pairs rotated,
    the dims past r passed through."""
    r = 2 * angles.shape[-1]
    cos = angles.cos().repeat_interleave(2, -1)[:, None]
    sin = angles.sin().repeat_interleave(2, -1)[:, None]
    part = x[..., :r]
    rot = torch.stack((-part[..., 1::2], part[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([part * cos + rot * sin, x[..., r:]], dim=-1)


@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_gptj_partial_matches_eager_bitwise(rotary_dim):
    x = torch.randn(7, 3, 16, requires_grad=True)
    rope = RotaryEmbedding(16, 10000.0, mrope_section=(2, 1, 1) if rotary_dim == 8 else None,
                           rotary_dim=rotary_dim)
    rope.reset_parameters()
    positions = torch.randint(0, 50, (3, 7)) if rotary_dim == 8 else torch.arange(7)
    cos, sin = rope(positions, torch.float32)
    assert cos.shape == (7, rotary_dim)
    got = apply_rope(x, cos, sin, style="gptj")
    angles = torch.atan2(sin[:, :rotary_dim // 2], cos[:, :rotary_dim // 2])
    want = _gptj_eager(x, angles)
    assert (got - want).abs().max().item() < 1e-6
    # and exactly what the tables give, pair by pair
    c, s = cos[:, None, :rotary_dim // 2], sin[:, None, :rotary_dim // 2]
    even, odd = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    assert torch.equal(got[..., 0:rotary_dim:2], even * c - odd * s)
    assert torch.equal(got[..., 1:rotary_dim:2], odd * c + even * s)
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
    got.square().sum().backward()  # differentiable through the views
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_half_style_partial_passes_the_rest_through():
    x = torch.randn(5, 2, 12)
    rope = RotaryEmbedding(12, 10000.0, rotary_dim=4)
    rope.reset_parameters()
    cos, sin = rope(torch.arange(5), torch.float32)
    got = apply_rope(x, cos, sin)
    assert torch.equal(got[..., 4:], x[..., 4:])
    assert not torch.equal(got[..., :4], x[..., :4])


@pytest.mark.parametrize("fields, message", [
    (dict(rotary_dim=7), "rotary_dim must be"),
    (dict(rotary_dim=32), "rotary_dim must be"),
    (dict(rope_style="neox"), "rope_style must be"),
    (dict(rotary_dim=8, mrope_section=(2, 2, 2)), "sums to 6 but rotary_dim 8"),
])
def test_bad_rotary_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(vocab_size=10, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=8, **fields)
