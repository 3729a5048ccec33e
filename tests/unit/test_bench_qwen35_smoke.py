"""Smoke run of tests/perf/bench_qwen35.py on the CPU (CUDA hidden), so that it works the first
time on a GPU: a tiny Qwen3.5 config.json, seq 64, 2 timed steps after 1 warmup; the JSON has
finite positive step times that agree with tokens/s, null peaks on CPU, losses near ln(vocab)
for fresh models on random tokens on both sides, and no layer benchmark without CUDA. A run
ended during transformers' row leaves ours in the JSON, which says that theirs did not finish."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.qwen35_tiny import HF_CONFIG, VOCAB
from tests.perf import bench_qwen35
from tests.unit.bench_ended import ended_in_transformers_rows

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_qwen35_cpu_smoke(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_CONFIG | {"architectures": ["Qwen3_5ForCausalLM"]}))
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.perf.bench_qwen35", str(out), "--config", str(config),
         "--seq", "64", "--steps", "2", "--warmup", "1"], cwd=REPO, capture_output=True,
        text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["seq"] == 64 and result["layer"] is None
    for side in ("mpcore", "hf"):
        r = result[side]
        assert r["step_s"] > 0 and math.isclose(r["tokens_per_s"], 64 / r["step_s"])
        assert r["peak_gib"] is None
        for loss in (r["loss_first"], r["loss_last"]):
            assert abs(loss - math.log(VOCAB)) < 1.0, (side, loss)
    assert result["mpcore"]["gdn_kernel"] == "reference"
    assert set(result["hf_paths"]) >= {"flash-linear-attention", "causal_conv1d importable"}
    assert isinstance(result["hf"]["fallback_warnings"], list)
    assert math.isclose(result["speedup"], result["hf"]["step_s"] / result["mpcore"]["step_s"])


def test_a_run_ended_during_transformers_row_leaves_ours_and_says_so(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_CONFIG | {"architectures": ["Qwen3_5ForCausalLM"]}))
    result = ended_in_transformers_rows(monkeypatch, bench_qwen35, "bench_hf",
                                        tmp_path / "bench.json", "--config", str(config),
                                        "--seq", "32", "--steps", "1", "--warmup", "0",
                                        "--skip-layer")
    assert result["mpcore"]["step_s"] > 0
    assert result["hf"] == bench_qwen35.HF_UNFINISHED
