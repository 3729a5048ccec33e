"""The machinery of tests/gpu/test_qwen35_families_fla_gpu.py on the CPU, for every Qwen3.5
family (text, MoE, VL, VL-MoE): the tiny model at DeltaNet head size 128 built through the
family's record, its packed stream (short text documents of 1, 2, 3 and 77 tokens; the VL
families' two image documents and one video document before them), the float64 truth, the
bf16 autocast run and the per-kind judgement, with the reference kernel everywhere (fla is
CUDA-only). The reference in float32 must agree with the same model in float64: loss within
1e-6 relative, every kind of parameter's worst layer within 1e-4 (measured: about 2e-6; the
routers', experts' and tower's included). The judgement passes a bf16 run judged against
itself and fails one kind's gradient 10% off. About 1 s per family on 2 cores."""

import pytest
import torch

from tests.gpu.qwen35_grads import (
    check_against_float64,
    model_grads,
    tiny_case,
    tiny_weights_,
    worst_per_kind,
)
from tests.gpu.qwen35_hf_scores import FAMILIES


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_float32_matches_float64_and_the_judgement_sees_a_wrong_kind(name):
    family, cfg, s = tiny_case(name, [1, 2, 3, 77])
    truth, wide, half = (
        model_grads(family, cfg, s, "reference", dtype, device="cpu", init_=tiny_weights_)
        for dtype in (torch.float64, torch.float32, torch.bfloat16))
    assert abs(wide[0] - truth[0]) <= 1e-6 * truth[0], (wide[0], truth[0])
    kinds = worst_per_kind(wide[1], truth[1])
    expected = {"A_log", "w_in.weight", "wqkv.weight"} | (
        {"gate.weight", "experts.w13", "shared_expert_gate.weight"} if "moe" in name else set()
    ) | ({"patch_embed.weight"} if "vl" in name else set())
    assert all(any(k.endswith(e) for k in kinds) for e in expected), sorted(kinds)
    assert max(kinds.values()) <= 1e-4, sorted(kinds.items(), key=lambda kv: -kv[1])[:4]
    assert all(float(g.abs().max()) > 0 for g in truth[1].values())  # none left out

    check_against_float64(truth, half, half)
    off = {n: g * 1.1 if n.endswith("A_log") else g for n, g in half[1].items()}
    with pytest.raises(AssertionError, match="A_log"):
        check_against_float64(truth, half, (half[0], off))
