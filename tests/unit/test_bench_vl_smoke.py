"""Smoke run of tests/perf/bench_vl.py on the CPU, so that it works the first time on a GPU.

One subprocess from the repo root with CUDA hidden: ``--config tiny`` (a tiny Qwen2-VL built in
the script, the shipped real images at a few merged tokens each), two samples per step (the
batched transformers input and a two-document packed stream), 1 warmup + 1 timed step, mpcore
and transformers side by side. The JSON is checked field by field: the data (images, image-token
fraction that adds up), equal parameter counts, finite positive tokens/s that agree with the
step time, null peak memory on CPU, finite losses near ln(vocab) for fresh models, liger
reported missing (it needs CUDA), and the speedup computed against the baseline that ran.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEQ, MICRO_BATCH, STEPS, WARMUP = 256, 2, 1, 1
VOCAB = 320  # bench_vl.tiny()
TIMEOUT = 300  # seconds; about 20 s on 2 busy cores


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench_vl") / "vl.json"
    cmd = [sys.executable, "tests/perf/bench_vl.py", str(out), "--config", "tiny", "--seq",
           str(SEQ), "--micro-batch", str(MICRO_BATCH), "--steps", str(STEPS), "--warmup",
           str(WARMUP)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT} s\nstdout:\n{stdout[-3000:]}\n"
                    f"stderr:\n{stderr[-5000:]}")
    assert proc.returncode == 0 and out.is_file(), (
        f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{stdout[-3000:]}\n"
        f"stderr:\n{stderr[-5000:]}")
    assert "| mpcore |" in stdout  # the table printed last
    return json.loads(out.read_text())


def _check_side(side: dict, data: dict) -> None:
    assert math.isfinite(side["step_ms"]) and side["step_ms"] > 0, side
    seconds = side["step_ms"] / 1e3
    assert side["tokens_per_s_per_gpu"] == pytest.approx(SEQ * MICRO_BATCH / seconds)
    assert side["text_tokens_per_s_per_gpu"] == pytest.approx(
        data["text_tokens_per_step"] / seconds)
    assert side["peak_gib"] is None, side  # no allocator peak on CPU: null, not a made-up 0
    for key in ("first_loss", "last_loss"):
        assert math.isfinite(side[key]), side
        assert abs(side[key] - math.log(VOCAB)) < 0.5, side  # fresh model


def test_header_and_data(report):
    assert report["device"] == "cpu" and report["config"] == "tiny"
    assert (report["seq"], report["micro_batch"]) == (SEQ, MICRO_BATCH)
    assert (report["steps"], report["warmup"]) == (STEPS, WARMUP)
    assert report["forward_backward_only"] is False and report["autocast"] is None
    params = report["num_params"]
    assert params["mpcore"] == params["transformers"] > 0
    data = report["data"]
    assert data["tokens_per_step"] == SEQ * MICRO_BATCH
    assert data["images_per_step"] >= MICRO_BATCH  # at least one real image per sample
    assert data["image_tokens_per_step"] + data["text_tokens_per_step"] == SEQ * MICRO_BATCH
    assert 0 < data["image_token_fraction"] < 1
    # every image of the first step: 4 patches per merged token, grids of whole merge windows
    grids = data["image_grids_first_step"]
    assert all(t == 1 and h % 2 == 0 and w % 2 == 0 for t, h, w in grids)


def test_both_sides_ran(report):
    _check_side(report["mpcore"], report["data"])
    assert report["mpcore"]["input_prep_ms"] > 0
    _check_side(report["hf"], report["data"])
    assert report["hf"]["attn_implementation"] == "sdpa"
    assert set(report["hf_liger"]) == {"missing"}, report["hf_liger"]  # no liger run on CPU
    assert set(report["hf_fa2"]) == {"missing"}, report["hf_fa2"]


def test_comparison(report):
    assert report["best_baseline"] == "hf"
    assert report["speedup_vs_best_baseline"] == pytest.approx(
        report["mpcore"]["tokens_per_s_per_gpu"] / report["hf"]["tokens_per_s_per_gpu"])
    assert report["memory_ratio_vs_best_baseline"] is None


@pytest.mark.parametrize("vision_cp", ["split", "replicate"])
def test_cp2_under_torchrun_trains_like_one_process(report, vision_cp, tmp_path):
    """The --cp mode (for the two-GPU run): the same losses as the single-process mpcore side
    of the fixture's run (same weights, same batches; fp32 on the CPU)."""
    out = tmp_path / "cp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "tests/perf/bench_vl.py", str(out), "--config", "tiny", "--seq", str(SEQ),
           "--micro-batch", str(MICRO_BATCH), "--steps", str(STEPS), "--warmup", str(WARMUP),
           "--cp", "2", "--vision-cp", vision_cp]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got, want = json.loads(out.read_text())["mpcore"], report["mpcore"]
    for key in ("first_loss", "last_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), (key, got, want)
