"""Smoke run of tests/perf/bench_moe.py on the CPU (CUDA hidden), so that it works the first
time on a GPU: the tiny shape, 2 layers, seq 64, 2 timed steps after 1 warmup; the JSON has
finite positive step times that agree with tokens/s, null peaks on CPU, losses near ln(vocab)
for fresh models on random tokens on both sides, the parameter counts of the cut model, and no
expert GEMM benchmark without CUDA. ``--family qwen3_5_moe`` likewise (its tiny shape, the
default 4-layer cut: three DeltaNet layers, then full attention), with every transformers
experts implementation that runs on the CPU, the parameter count of each transformers model
equal to ours, the DeltaNet kernel our side ran and transformers' fast path as found; a cut
without a full-attention layer and ``--megatron`` are refused. A run ended during transformers'
rows leaves our row in the JSON, which says that theirs did not finish."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tests.perf import bench_moe, bench_qwen35
from tests.unit.bench_ended import ended_in_transformers_rows

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_moe_cpu_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.perf.bench_moe", str(out), "--tiny", "--layers", "2",
         "--seq", "64", "--steps", "2", "--warmup", "1", "--hf-experts", "eager"], cwd=REPO,
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["layers"] == 2 and result["experts"] is None
    assert 0 < result["active_params"] < result["params"]
    assert result["hf_fastest"] == "eager" and list(result["hf"]) == ["eager"]
    for r in (result["mpcore"], result["hf"]["eager"]):
        assert r["step_s"] > 0 and math.isclose(r["tokens_per_s"], 64 / r["step_s"])
        assert r["peak_gib"] is None
        for loss in (r["loss_first"], r["loss_last"]):
            assert abs(loss - math.log(512)) < 1.0, loss
    assert math.isclose(result["speedup"],
                        result["hf"]["eager"]["step_s"] / result["mpcore"]["step_s"])


def _bench(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.perf.bench_moe", str(out), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **env})


def test_bench_moe_qwen3_5_moe_cpu_smoke(tmp_path):  # ~5 s on 2 cores
    out = tmp_path / "bench.json"
    proc = _bench(out, "--family", "qwen3_5_moe", "--tiny", "--seq", "64", "--steps", "2",
                  "--warmup", "1", "--hf-experts", "grouped_mm,eager",
                  PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["family"], result["shape"], result["layers"]) == ("qwen3_5_moe", "tiny", 4)
    # the allocator both sides ran under (transformers' 4096 row fits an H100 only with it)
    assert result["cuda_alloc_conf"] == "expandable_segments:True"
    assert result["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert result["experts"] is None and 0 < result["active_params"] < result["params"]
    assert list(result["hf"]) == ["grouped_mm", "eager"]
    assert result["hf_fastest"] in result["hf"]
    for r in (result["mpcore"], *result["hf"].values()):
        assert r["params"] == result["params"]  # the same model on every side
        assert r["step_s"] > 0 and math.isclose(r["tokens_per_s"], 64 / r["step_s"])
        assert r["peak_gib"] is None
        for loss in (r["loss_first"], r["loss_last"]):
            assert abs(loss - math.log(512)) < 1.0, loss
    assert math.isclose(result["speedup"], result["hf"][result["hf_fastest"]]["step_s"]
                        / result["mpcore"]["step_s"])
    kernel = result["mpcore"]["gdn_kernel"]
    assert (kernel["requested"], kernel["ran"]) == ("auto", "reference"), kernel
    fast = result["hf_fast_path"]
    assert {k: fast[k] for k in bench_qwen35.hf_paths()} == bench_qwen35.hf_paths()
    if fast["flash-linear-attention"] is None:
        assert any("chunk_gated_delta_rule" in w for w in fast["fallback_warnings"]), fast


def test_bench_moe_qwen3_5_moe_cut_and_refusals(tmp_path):
    """The full shape's default cut is the release's first four layers (4.38 B parameters,
    the count transformers' model of it has); fewer layers, or a Megatron row, are refused
    before anything is built; the Qwen3-MoE default is unchanged."""
    args = bench_moe.parse_args(["--family", "qwen3_5_moe"])
    hf = bench_moe.cut(args.family, False, args.layers)
    assert hf["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    counts = bench_moe.family_named("qwen3_5_moe").num_params(
        bench_moe.family_named("qwen3_5_moe").config_from_hf(hf))
    assert counts["total"] == 4_381_469_760
    config = transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in hf.items() if k not in bench_moe.HF_DROPPED})
    with torch.device("meta"):
        theirs = transformers.Qwen3_5MoeForCausalLM._from_config(config)
    assert sum(p.numel() for p in theirs.parameters()) == counts["total"]
    assert bench_moe.parse_args([]).layers == 6 and bench_moe.parse_args([]).family == "qwen3_moe"
    with pytest.raises(ValueError, match="full-attention"):
        bench_moe.cut("qwen3_5_moe", False, 3)
    proc = _bench(tmp_path / "x.json", "--family", "qwen3_5_moe", "--megatron")
    assert proc.returncode == 2 and "Qwen3-MoE only" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_run_ended_during_transformers_rows_leaves_our_row_and_says_so(tmp_path, monkeypatch):
    result = ended_in_transformers_rows(monkeypatch, bench_moe, "run_hf_logged",
                                        tmp_path / "bench.json", "--tiny", "--layers", "2",
                                        "--seq", "32", "--steps", "1", "--warmup", "0")
    assert result["mpcore"]["step_s"] > 0
    assert result["hf"] == bench_moe.HF_UNFINISHED


def test_every_transformers_row_out_of_memory_is_recorded_as_its_error(tmp_path, monkeypatch):
    """transformers' 4096 row ran out of an H100's memory once: the file must say so, not that
    the rows did not finish."""

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore")

    monkeypatch.setattr(bench_moe, "bench_hf", out_of_memory)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit, match="no transformers experts implementation ran"):
        bench_moe.main([str(out), "--tiny", "--layers", "2", "--seq", "32", "--steps", "1",
                        "--warmup", "0", "--hf-experts", "grouped_mm,eager"])
    result = json.loads(out.read_text())
    assert result["mpcore"]["step_s"] > 0 and "hf_fastest" not in result
    assert result["hf"] == {name: {"error": "out of memory: CUDA out of memory. Tried to "
                                            "allocate 2.00 GiB."}
                            for name in ("grouped_mm", "eager")}
