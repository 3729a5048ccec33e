"""Smoke run of tests/perf/bench_moe.py on the CPU (CUDA hidden), so that it works the first
time on a GPU: the tiny shape, 2 layers, seq 64, 2 timed steps after 1 warmup; the JSON has
finite positive step times that agree with tokens/s, null peaks on CPU, losses near ln(vocab)
for fresh models on random tokens on both sides, the parameter counts of the cut model, and no
expert GEMM benchmark without CUDA."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
