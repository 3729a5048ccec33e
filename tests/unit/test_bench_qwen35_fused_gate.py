"""tests/perf/bench_qwen35.py's fused-gate floor (``_fused_gate_floor``) on the CPU, with
stand-ins for fla's three ops built on our reference kernels: a delta rule that takes fla's
in-kernel gate and beta flags (``use_gate_in_kernel`` with ``A_log`` and ``dt_bias``,
``use_beta_sigmoid_in_kernel``) and computes the decay from them as our layer does, and one
that does not take them (an older fla). The row's gradient distance must be 0 for the first
(the same function, in float32) and must see a gate computed wrongly; the second must be
recorded as an error, not raised."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.hybrid import deltanet, kernels
from mpcore.models.common.hybrid.hf import config_from_hf
from mpcore.models.common.hybrid.layers import GatedDeltaNet
from tests.dist.qwen35_tiny import HF_CONFIG
from tests.perf import bench_qwen35

SEQ = 40


def conv(x, weight, activation, cu_seqlens):
    assert activation == "silu"
    positions = deltanet.segment_positions(cu_seqlens, x.shape[1])
    return deltanet.causal_conv1d(x[0], weight, positions)[None]


def gated_norm(o, z, weight, bias, activation, eps):
    assert bias is None and activation == "silu"
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight * F.silu(z)


def rule_taking_gates(decay_sign: float = -1.0):
    def rule(q, k, v, g, beta, cu_seqlens, use_qk_l2norm_in_kernel, use_gate_in_kernel=False,
             A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False):
        assert use_qk_l2norm_in_kernel
        if use_gate_in_kernel:
            g = decay_sign * A_log.float().exp() * F.softplus(g.float() + dt_bias.float())
        if use_beta_sigmoid_in_kernel:
            beta = beta.sigmoid()
        return deltanet.chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0],
                                               cu_seqlens)[None], None
    return rule


def rule_without_gates(q, k, v, g, beta, cu_seqlens, use_qk_l2norm_in_kernel):
    return rule_taking_gates()(q, k, v, g, beta, cu_seqlens, use_qk_l2norm_in_kernel)


def layer_and_input():
    cfg = config_from_hf(HF_CONFIG | {"architectures": ["Qwen3_5ForCausalLM"]})
    layer = GatedDeltaNet(cfg, tp_group=None, sequence_parallel=False, gdn_kernel="reference")
    init_weights(layer, 0)
    with torch.no_grad():  # weak decays: the gate matters over the 40 tokens
        layer.A_log.copy_(torch.log(0.02 + 0.3 * torch.rand(layer.A_log.shape)))
    x = torch.randn(SEQ, cfg.hidden_size, requires_grad=True)
    return layer, x


@pytest.mark.parametrize("rule, same", [(rule_taking_gates(), True),
                                        (rule_taking_gates(decay_sign=1.0), False)],
                         ids=["in-kernel gate as ours", "in-kernel gate wrong"])
def test_fused_gate_row_times_and_measures_the_gradients(monkeypatch, rule, same):
    monkeypatch.setattr(kernels, "fla_ops", lambda: (rule, conv, gated_norm))
    layer, x = layer_and_input()
    floor = {"step_s": 1.0}
    row = bench_qwen35._fused_gate_floor(layer, x, SEQ, floor, 1, 0, torch.device("cpu"))
    assert "floor_fused_gate_error" not in row, row
    assert row["floor_fused_gate_ms"] > 0
    assert math.isclose(row["fused_gate_saving"], 1e3 / row["floor_fused_gate_ms"] - 1)
    diff = row["fused_gate_grad_rel_diff"]
    assert set(diff) == {"x", "A_log", "dt_bias"}
    if same:
        assert max(diff.values()) <= 1e-6, diff
    else:
        assert min(diff["A_log"], diff["dt_bias"]) > 0.1, diff


def test_a_fla_without_the_flags_is_recorded_not_raised(monkeypatch):
    monkeypatch.setattr(kernels, "fla_ops", lambda: (rule_without_gates, conv, gated_norm))
    layer, x = layer_and_input()
    row = bench_qwen35._fused_gate_floor(layer, x, SEQ, {"step_s": 1.0}, 1, 0,
                                         torch.device("cpu"))
    assert set(row) == {"floor_fused_gate_error"}
    assert row["floor_fused_gate_error"].startswith("TypeError")
