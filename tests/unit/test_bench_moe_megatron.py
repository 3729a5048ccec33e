"""tests/perf/bench_moe.py's Megatron-core row on the CPU (the GPU run: tests/perf/NOTES.md).

Without megatron-core: the checks that stop a run whose sides are not the same model or did
not see the same tokens. With its wheel on the path (skipped otherwise): Megatron's model of
the Qwen3-30B-A3B shape, cut to 2 layers and built on the meta device, has the parameter count
of our qwen3_moe model and of transformers' Qwen3MoeForCausalLM of the same config; and (slow)
a CPU smoke run of ``--megatron``, where the row builds the model of the tiny shape, checks
its count and reports itself skipped (its alltoall dispatcher and optimizer need CUDA).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpcore.models.registry import family_named
from tests.perf import bench_moe

REPO = Path(__file__).resolve().parents[2]

needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs the megatron-core wheel on the path (tests/perf/NOTES.md)")


def _result(crc=7, step_s=2.0, peak=30.0):
    return {"params": 100, "tokens_crc32": crc, "mpcore": {"step_s": step_s, "peak_gib": peak}}


def test_check_params_refuses_another_model():
    bench_moe.check_params("x", 100, 100)
    with pytest.raises(RuntimeError, match="x: 99 parameters, mpcore's model of this shape has"):
        bench_moe.check_params("x", 99, 100)


def test_add_megatron_ratios_and_refusals():
    result = _result()
    bench_moe.add_megatron(result, {"params": 100, "tokens_crc32": 7, "step_s": 3.0,
                                    "peak_gib": 40.0}, seq=64)
    assert result["speedup_vs_megatron"] == pytest.approx(1.5)
    assert result["memory_ratio_vs_megatron"] == pytest.approx(0.75)
    assert result["megatron"]["tokens_per_s"] == pytest.approx(64 / 3.0)
    failed = _result()
    bench_moe.add_megatron(failed, {"error": "exit 1: boom"}, seq=64)  # recorded, no ratio
    assert failed["megatron"] == {"error": "exit 1: boom"} and "speedup_vs_megatron" not in failed
    with pytest.raises(RuntimeError, match="megatron: 101 parameters"):
        bench_moe.add_megatron(_result(), {"params": 101, "skipped": "cpu"}, seq=64)
    with pytest.raises(RuntimeError, match="other tokens"):
        bench_moe.add_megatron(_result(crc=8), {"params": 100, "tokens_crc32": 7,
                                                "step_s": 3.0, "peak_gib": None}, seq=64)


def test_token_batches_are_fixed_by_the_seed():
    hf = {**bench_moe.TINY, "num_hidden_layers": 1}
    a, b = bench_moe.token_batches(hf, 32, 3), bench_moe.token_batches(hf, 32, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert bench_moe.tokens_crc(a) == bench_moe.tokens_crc(b)
    assert bench_moe.tokens_crc(a) != bench_moe.tokens_crc(a[:2])
    assert int(max(x.max() for x in a)) < hf["vocab_size"]


@needs_megatron
def test_megatron_model_of_the_full_shape_has_our_parameter_count():
    from megatron.core import parallel_state
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.perf.megatron_peer import init_megatron, num_params

    hf = {**bench_moe.QWEN3_30B_A3B, "num_hidden_layers": 2}
    family = family_named("qwen3_moe")
    ours = family.num_params(family.config_from_hf(hf))["total"]
    with torch.device("meta"):
        reference = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **{k: v for k, v in hf.items() if k != "architectures"})).num_parameters()
    init_megatron(seed=0)
    try:
        with torch.device("meta"):
            config, model, settings = bench_moe.megatron_moe_model(hf, seq=4096)
    finally:
        parallel_state.destroy_model_parallel()
    assert num_params(model) == ours == reference == 1_868_573_184
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == \
        (128, 8, 768)
    assert (config.num_query_groups, config.kv_channels, config.qk_layernorm) == (4, 128, True)
    assert settings["moe_router_pre_softmax"] is False  # softmax over the top k: norm_topk_prob
    assert settings["moe_aux_loss_coeff"] == hf["router_aux_loss_coef"]


def test_megatron_model_refuses_another_router():
    hf = {**bench_moe.TINY, "num_hidden_layers": 1, "norm_topk_prob": False}
    with pytest.raises(ValueError, match="norm_topk_prob"):
        bench_moe.megatron_moe_model(hf, seq=64)


@pytest.mark.slow
@needs_megatron
def test_megatron_row_cpu_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.perf.bench_moe", str(out), "--tiny", "--layers", "2",
         "--seq", "64", "--steps", "2", "--warmup", "1", "--skip-hf", "--megatron"], cwd=REPO,
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    row = result["megatron"]
    assert "skipped" in row and "error" not in row
    assert row["params"] == result["params"] == result["mpcore"]["params"]
    assert row["settings"]["layer_spec"] == "local"
    assert row["settings"]["moe_token_dispatcher_type"] == "allgather"  # alltoall: CUDA
    assert "speedup_vs_megatron" not in result
    assert not list(tmp_path.glob("*.megatron.json"))  # the child's file, read and removed
