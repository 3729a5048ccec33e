"""tests/perf/diag_qwen35_gates.py's rows on the CPU, so that a GPU call is not spent finding a
mistake in it (its first row costs minutes of fla's compile on a fresh machine). fla-core is
CUDA-only: its three ops are stood in for by the reference's (the one module that detects fla
patched, as in test_qwen35_kernel_choice.py), so the "fla" rows run the reference's math
through fla's call sites. Checked: every row is there and at bf16's size against float64, the
stand-ins were called, and the rounded-conv-weight variant really rounds (it moves the
gradients)."""

import math

import torch
import torch.nn.functional as F

from mpcore.models.common.hybrid import deltanet, kernels
from tests.perf import diag_qwen35_gates as diag


def _stand_ins(calls: list):
    def rule(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None,
             use_qk_l2norm_in_kernel=False):
        calls.append("rule")
        return deltanet.chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0],
                                               cu_seqlens)[None], None

    def conv(x, weight, activation=None, cu_seqlens=None, cu_seqlens_cpu=None):
        calls.append("conv")
        positions = deltanet.segment_positions(cu_seqlens, x.shape[1])
        return deltanet.causal_conv1d(x[0], weight, positions)[None], None

    def gated_norm(x, z, weight, bias, activation="silu", eps=1e-6):
        calls.append("norm")
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return (h * weight.float() * F.silu(z.float())).to(x.dtype)

    return rule, conv, gated_norm


def test_diag_rows_run_through_fla_call_sites(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "fla_ops", lambda: _stand_ins(calls))
    monkeypatch.setattr(kernels, "choose", lambda name, *rest: (
        "reference" if name == "reference" else "fla", "stand-in"))
    monkeypatch.setattr(kernels, "_fla_groups_heads", lambda: True)  # fla-core 0.6's grouping
    monkeypatch.setattr(kernels, "fla_refusal", lambda index: None)  # the build's check
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernels._host_segments_taken.cache_clear()
    try:
        rule_row = diag._rule_case([1, 2, 3, 40], seed=0, device="cpu")
        model_row = diag._model_case([1, 2, 3, 40], seed=0, device="cpu")
        some_rows = diag._model_case([1, 2, 3, 40], seed=0, device="cpu",
                                     rules=("fla_conv_weight_bf16",))
    finally:
        kernels._host_segments_taken.cache_clear()
    assert {"rule", "conv", "norm"} <= set(calls)
    assert sorted(rule_row) == sorted(diag.RULES)
    for errors in rule_row.values():
        assert all(0 < e < 0.05 for e in errors.values()), rule_row
    names = set(model_row["condition"])
    assert names and all(n.endswith(("A_log", "dt_bias")) for n in names)
    assert all(c >= 1 for c in model_row["condition"].values())
    for rule in diag.MODEL_RULES:
        for key in (rule, f"{rule} (against the magnitudes)"):
            assert set(model_row[key]) == names
            assert all(math.isfinite(e) and 0 < e < 0.1 for e in model_row[key].values()), key
    assert model_row["fla_conv_weight_bf16"] != model_row["fla"]
    assert sorted(some_rows) == sorted(["condition", "fla_conv_weight_bf16",
                                        "fla_conv_weight_bf16 (against the magnitudes)"])
    assert some_rows["fla_conv_weight_bf16"] == model_row["fla_conv_weight_bf16"]


def test_diag_refuses_unknown_rows_before_it_needs_a_gpu(tmp_path, capsys):
    for bad in (["--model-rules", "fla,fla_bf16"], ["--measure", "rules"], ["--cases", "16k"]):
        try:
            diag.main([str(tmp_path / "out.json"), *bad])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{bad} was accepted")
        assert bad[1].split(",")[-1] in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
