"""tests/perf/bench_qwen35_mtp.py: its FLOP share against the MTP block counted by hand, and
(slow) the ``--tiny`` smoke run on the CPU (CUDA hidden), so that it works the first time on a
GPU: finite positive step times that agree with tokens/s, losses near ln(vocab) (the MTP run's
near ``(1 + w) ln(vocab)``: two heads on random tokens), and a ratio and share that are what the
JSON's own numbers say."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpcore.models.common.hybrid.counts import flops_per_token
from mpcore.models.common.hybrid.hf import config_from_hf
from tests.perf.bench_qwen35_mtp import DEFAULT_CONFIG, TINY

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("hf", [TINY, json.loads(DEFAULT_CONFIG.read_text())])
def test_mtp_flops_are_the_blocks_matmuls_attention_and_second_head_pass(hf):
    plain = dataclasses.replace(config_from_hf(hf), mtp_num_hidden_layers=1)
    mtp = dataclasses.replace(plain, mtp_loss_weight=0.1)
    h, seq, q, kv = plain.hidden_size, 4096, plain.q_size, plain.kv_size
    attention = h * (2 * q + 2 * kv) + q * h + 2 * plain.head_dim  # gated q, k, v, o, qk-norms
    block = 2 * h * h + 3 * h + attention + 3 * h * plain.intermediate_size + 2 * h
    want = 6 * (block + plain.vocab_size * h) + 12 * q * seq
    assert math.isclose(flops_per_token(mtp, seq) - flops_per_token(plain, seq), want)


@pytest.mark.slow
def test_bench_qwen35_mtp_tiny_cpu_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.perf.bench_qwen35_mtp", str(out), "--tiny"], cwd=REPO,
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["seq"] == 64 and r["gdn_kernel"] == "reference"
    vocab = TINY["vocab_size"]
    for side, scale in (("plain", 1.0), ("mtp", 1.0 + r["mtp_loss_weight"])):
        s = r[side]
        assert s["step_s"] > 0 and math.isclose(s["tokens_per_s"], 64 / s["step_s"])
        assert s["peak_gib"] is None
        for loss in (s["loss_first"], s["loss_last"]):
            assert abs(loss - scale * math.log(vocab)) < 1.0, (side, loss)
    assert r["flops_per_token"]["mtp"] > r["flops_per_token"]["plain"]
    assert math.isclose(r["flop_share"], r["flops_per_token"]["mtp"]
                        / r["flops_per_token"]["plain"] - 1)
    assert math.isclose(r["time_ratio"], r["mtp"]["step_s"] / r["plain"]["step_s"])
    assert r["within_flop_share"] == (r["time_ratio"] - 1 <= r["flop_share"])
