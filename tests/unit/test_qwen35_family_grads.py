"""The machinery of tests/gpu/test_qwen35_families_fla_gpu.py on the CPU, for every Qwen3.5
family (text, MoE, VL, VL-MoE): the tiny model at DeltaNet head size 128 built through the
family's record, its packed stream (short text documents of 1, 2, 3 and 77 tokens; the VL
families' two image documents and one video document before them), the float64 truth, the
bf16 autocast run and the per-kind judgement, with the reference kernel everywhere (fla is
CUDA-only). The reference in float32 must agree with the same model in float64: loss within
1e-6 relative, every kind of parameter's worst layer within 1e-4 (measured: about 2e-6; the
routers', experts' and tower's included). The judgement passes a bf16 run judged against
itself and fails one kind's gradient 10% off, with and without ``GateSums`` (whose per-token
terms of ``A_log``'s and ``dt_bias``' gradients must sum to those gradients, so the magnitudes
they are judged against are the right terms'). About 1 s per family on 2 cores. The MoE
families' pinned routing (``PinnedRoutes``): a run pinned to its own float64 choices is the
unpinned run exactly, and one pinned to other choices routes by them and counts every token.
Two float64 truths (``check_truths_agree``, which lets the GPU test's 32k cases take their
truth from the GPU): one whose RMSNorms reduce their fp32 mean of squares in another order, as
another device would, agrees with the first; a bf16 run does not."""

import pytest
import torch

from mpcore.kernels import rmsnorm
from tests.gpu.qwen35_grads import (
    GateSums,
    PinnedRoutes,
    check_against_float64,
    check_truths_agree,
    model_grads,
    tiny_case,
    tiny_weights_,
    worst_per_kind,
)
from tests.gpu.qwen35_hf_scores import FAMILIES


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_float32_matches_float64_and_the_judgement_sees_a_wrong_kind(name):
    family, cfg, s = tiny_case(name, [1, 2, 3, 77])
    sums = GateSums()
    truth, wide, half = (
        model_grads(family, cfg, s, "reference", dtype, device="cpu", init_=tiny_weights_,
                    gate_sums=sums if dtype == torch.float64 else None)
        for dtype in (torch.float64, torch.float32, torch.bfloat16))
    gates = [n for n in truth[1] if n.endswith(("A_log", "dt_bias"))]
    assert sorted(sums.signed) == sorted(gates) and gates
    for n in gates:  # the truth's gates are fp32 (as transformers'): its own rounding
        assert torch.allclose(sums.signed[n], truth[1][n], rtol=1e-5, atol=0), n
        assert bool((sums.magnitude[n] >= sums.signed[n].abs()).all()), n
    assert abs(wide[0] - truth[0]) <= 1e-6 * truth[0], (wide[0], truth[0])
    kinds = worst_per_kind(wide[1], truth[1])
    expected = {"A_log", "w_in.weight", "wqkv.weight"} | (
        {"gate.weight", "experts.w13", "shared_expert_gate.weight"} if "moe" in name else set()
    ) | ({"patch_embed.weight"} if "vl" in name else set())
    assert all(any(k.endswith(e) for k in kinds) for e in expected), sorted(kinds)
    assert max(kinds.values()) <= 1e-4, sorted(kinds.items(), key=lambda kv: -kv[1])[:4]
    assert all(float(g.abs().max()) > 0 for g in truth[1].values())  # none left out

    off = {n: g * 1.1 if n.endswith("A_log") else g for n, g in half[1].items()}
    for gate_sums in (None, sums):
        check_against_float64(truth, half, half, gate_sums)
        with pytest.raises(AssertionError, match="A_log"):
            check_against_float64(truth, half, (half[0], off), gate_sums)


@pytest.mark.parametrize("name", [n for n in FAMILIES if "moe" in n])
def test_pinned_routes_impose_the_recorded_choices(name):
    family, cfg, s = tiny_case(name, [1, 2, 3, 77])

    def run(routes):
        return model_grads(family, cfg, s, "reference", torch.float64, device="cpu",
                           init_=tiny_weights_, routes=routes)

    routes = PinnedRoutes()
    truth = run(routes)
    assert routes.choices and not routes.flips  # recorded, nothing pinned yet
    same = run(routes)
    assert all(n == 0 for n in routes.flips[-1].values()), routes.flips
    assert same[0] == truth[0]
    assert all(torch.equal(same[1][n], g) for n, g in truth[1].items())

    # Every token sent to the next expert up: the pinned run must route by these choices.
    experts = getattr(cfg, "text", cfg).num_experts
    routes.choices = {b: (c + 1) % experts for b, c in routes.choices.items()}
    moved = run(routes)
    # The first block's input is unchanged, so every token's choice is moved there; later
    # blocks' inputs are, and a token may happen to pick the shifted experts itself.
    (first, n), *later = routes.flips[-1].items()
    assert n == routes.choices[first].shape[0], routes.flips
    assert all(m > routes.choices[b].shape[0] // 2 for b, m in later), routes.flips
    assert abs(moved[0] - truth[0]) > 1e-6 * truth[0], (moved[0], truth[0])


def norm_reduced_another_way(x, weight, eps=1e-6, out_dtype=None):
    """``rmsnorm.rms_norm_reference`` with the fp32 mean of squares reduced another way (in
    float64, rounded once to fp32): an ulp at most, what another device's order does."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True).float() + eps)
    y = weight * h.to(x.dtype)
    return y if out_dtype is None else y.to(out_dtype)


@pytest.mark.parametrize("name", FAMILIES)
def test_two_float64_truths_agree_and_a_bf16_run_does_not(name, monkeypatch):
    family, cfg, s = tiny_case(name, [1, 2, 3, 77])
    routes = PinnedRoutes()

    def run(dtype):
        return model_grads(family, cfg, s, "reference", dtype, device="cpu",
                           init_=tiny_weights_, routes=routes)

    truth = run(torch.float64)
    with monkeypatch.context() as m:
        m.setattr(rmsnorm, "rms_norm_reference", norm_reduced_another_way)
        other = run(torch.float64)
    assert any(not torch.equal(other[1][n], g) for n, g in truth[1].items())  # it did move
    check_truths_agree(truth, other, ("cpu", "cpu, norms reduced another way"))
    with pytest.raises(AssertionError):
        check_truths_agree(truth, run(torch.bfloat16), ("cpu", "cpu, bf16"))
