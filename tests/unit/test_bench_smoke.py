"""Smoke runs of the GPU benchmarks on the CPU, so that they work the first time on a GPU.

Each test runs a module of tests.perf as a subprocess from the repo root, with
launch/configs/tiny.yaml, seq 64, micro-batch 2, 2 timed steps after 1 warmup step, and
CUDA hidden (the smoke check is the CPU path on every machine):

    python -m tests.perf.bench_model (forward + backward only) with the HF baseline
    python -m tests.perf.bench_train: one process, training steps, HF baseline (loss reference)
    torchrun --nproc-per-node 2 -m tests.perf.bench_train --tp 2 | --cp 2 --cp-mode ulysses | dp=2 fsdp

The JSON is checked field by field: finite positive tokens/s that agree with the step time,
null peak memory on CPU, finite losses near ln(vocab) for a fresh model on random tokens. The
tp=2 and cp=2 runs see the same tokens as the single process and start from the same weights,
so their first and last losses must match it.
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
import yaml

pytestmark = pytest.mark.slow  # benchmark smoke runs (torchrun layouts, HF baselines)

REPO = Path(__file__).resolve().parents[2]
CONFIG = "launch/configs/tiny.yaml"
VOCAB = yaml.safe_load((REPO / CONFIG).read_text())["model"]["vocab_size"]
SEQ, MICRO_BATCH, STEPS, WARMUP = 64, 2, 2, 1
TIMEOUT = 300  # seconds per subprocess; each takes about 10 s on 2 cores


def _bench(tmp_path: Path, name: str, script: str, *args: str, nproc: int = 1) -> dict:
    """Run ``python -m tests.perf.<script>`` (under torchrun when ``nproc > 1``) and return the JSON it wrote."""
    out = tmp_path / f"{name}.json"
    launcher = [sys.executable]
    if nproc > 1:  # --standalone: rendezvous on localhost:0, a free port per run
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     str(nproc)]
    cmd = [*launcher, "-m", f"tests.perf.{script}", str(out), "--config", CONFIG, "--seq", str(SEQ),
           "--micro-batch", str(MICRO_BATCH), "--steps", str(STEPS), "--warmup", str(WARMUP),
           "--run-dir", str(tmp_path / f"{name}_run"), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT} s\nstdout:\n{stdout[-3000:]}\n"
                    f"stderr:\n{stderr[-5000:]}")
    assert proc.returncode == 0 and out.is_file(), (
        f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{stdout[-3000:]}\n"
        f"stderr:\n{stderr[-5000:]}")
    return json.loads(out.read_text())


def _check_header(report: dict, world: int, forward_backward_only: bool) -> None:
    assert report["device"] == "cpu"
    assert report["world_size"] == world and report["shape"] == "tiny"
    assert (report["seq"], report["micro_batch"]) == (SEQ, MICRO_BATCH)
    assert (report["steps"], report["warmup"]) == (STEPS, WARMUP)
    assert report["forward_backward_only"] is forward_backward_only


def _check_side(side: dict, tokens_per_step: int, world: int) -> None:
    """One side's timings and losses; ``tokens_per_step`` over the whole world."""
    assert math.isfinite(side["step_ms"]) and side["step_ms"] > 0, side
    tokens_per_s = side["tokens_per_s_per_gpu"]
    assert math.isfinite(tokens_per_s) and tokens_per_s > 0, side
    assert tokens_per_s == pytest.approx(tokens_per_step / (side["step_ms"] / 1e3) / world)
    assert side["peak_gib"] is None, side  # no allocator peak on CPU: null, not a made-up 0
    for key in ("first_loss", "last_loss"):
        assert math.isfinite(side[key]), side
        assert abs(side[key] - math.log(VOCAB)) < 0.5, side  # a fresh model, random tokens


def _check_hf(report: dict) -> None:
    assert isinstance(report["transformers_version"], str)
    _check_side(report["hf"], SEQ * MICRO_BATCH, 1)
    assert set(report["hf_liger"]) == {"missing"}, report["hf_liger"]  # no liger run on CPU
    assert report["speedup_vs_best_baseline"] == pytest.approx(
        report["mpcore"]["tokens_per_s_per_gpu"] / report["hf"]["tokens_per_s_per_gpu"])
    assert report["memory_ratio_vs_best_baseline"] is None


def _layout(tp: int = 1, cp: int = 1, dp: int = 1, data_parallel: str = "fsdp",
            cp_mode: str = "ring") -> dict:
    return {"tp": tp, "cp": cp, "dp": dp, "data_parallel": data_parallel, "cp_mode": cp_mode,
            "sequence_parallel": tp > 1}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """bench_train.py in one process, training steps, both sides: the layouts' loss reference."""
    tmp_path = tmp_path_factory.mktemp("bench_single")
    return _bench(tmp_path, "single", "bench_train", "--activation-checkpointing",
                  "--variants", "auto:none,native:none:lce1+adamw_triton")


def test_bench_model_with_hf_baseline(tmp_path):
    report = _bench(tmp_path, "model", "bench_model")
    _check_header(report, 1, forward_backward_only=True)
    _check_side(report["mpcore"], SEQ * MICRO_BATCH, 1)
    assert report["mpcore"]["layout"] == _layout()
    _check_hf(report)


def test_bench_train_single_process_with_hf_baseline(single):
    _check_header(single, 1, forward_backward_only=False)
    assert single["activation_checkpointing"] is True
    # The kernels: auto resolves to the native GEMMs on the CPU.
    assert (single["fp8"], single["backend"], single["linear_backend"]) == ("none", "auto",
                                                                            "native")
    _check_side(single["mpcore"], SEQ * MICRO_BATCH, 1)
    assert single["mpcore"]["layout"] == _layout()
    _check_hf(single)
    # --variants: each timed beside the one baseline run, the first is the top-level row.
    first, second = single["variants"]
    assert (first["fp8"], first["linear_backend"]) == (second["fp8"], second["linear_backend"]) \
        == ("none", "native")
    assert first["mpcore"] == single["mpcore"]
    assert (first["lce_chunk_mib"], second["lce_chunk_mib"]) == (512, 1)  # the loss head's budget
    assert (first["optimizer_backend"], second["optimizer_backend"]) == ("torch", "triton")
    # TritonAdamW (its PyTorch update here) trains like torch's AdamW: a few ulp per update.
    assert second["mpcore"]["last_loss"] == pytest.approx(first["mpcore"]["last_loss"], rel=1e-4)
    # Steady timing (the default), for mpcore and the baselines alike.
    assert {v["mpcore"]["timing"] for v in (first, second)} == {single["hf"]["timing"]} \
        == {"steady"}
    _check_side(second["mpcore"], SEQ * MICRO_BATCH, 1)
    assert second["mpcore"]["first_loss"] == first["mpcore"]["first_loss"]  # same seed, batches
    for v in (first, second):
        assert v["speedup_vs_best_baseline"] == pytest.approx(
            v["mpcore"]["tokens_per_s_per_gpu"] / single["hf"]["tokens_per_s_per_gpu"])
        assert v["memory_ratio_vs_best_baseline"] is None


@pytest.mark.parametrize("name, args, layout", [
    pytest.param("tp2", ["--tp", "2"], _layout(tp=2), id="tp2"),
    pytest.param("cp2_ulysses", ["--cp", "2", "--cp-mode", "ulysses"],
                 _layout(cp=2, cp_mode="ulysses"), id="cp2-ulysses"),
])
def test_bench_train_model_parallel_matches_one_process(tmp_path, single, name, args, layout):
    """tp=2 / cp=2 (tiny: 4 heads, 2 KV heads, so ulysses splits them 2 + 1 per rank): one
    model replica on 2 ranks, the same batches and weights as ``single``, the same losses."""
    report = _bench(tmp_path, name, "bench_train", *args, "--skip-hf", nproc=2)
    _check_header(report, 2, forward_backward_only=False)
    mpcore = report["mpcore"]
    _check_side(mpcore, SEQ * MICRO_BATCH, 2)
    assert mpcore["layout"] == layout
    assert "hf" not in report and "hf_liger" not in report
    reference = single["mpcore"]
    assert mpcore["first_loss"] == pytest.approx(reference["first_loss"], abs=1e-5)
    assert mpcore["last_loss"] == pytest.approx(reference["last_loss"], abs=1e-4)


def test_bench_train_data_parallel_fsdp(tmp_path):
    """FSDP2 on 2 ranks, with torch's AdamW and with TritonAdamW (over the DTensor shards'
    local tensors): the two train alike."""
    report = _bench(tmp_path, "dp2_fsdp", "bench_train", "--data-parallel", "fsdp",
                    "--skip-hf", "--variants", "native:none,native:none:adamw_triton", nproc=2)
    _check_header(report, 2, forward_backward_only=False)
    _check_side(report["mpcore"], 2 * SEQ * MICRO_BATCH, 2)  # each dp rank its own batch
    assert report["mpcore"]["layout"] == _layout(dp=2)
    assert "hf" not in report
    torch_adamw, triton_adamw = (v["mpcore"] for v in report["variants"])
    assert [v["optimizer_backend"] for v in report["variants"]] == ["torch", "triton"]
    assert triton_adamw["first_loss"] == torch_adamw["first_loss"]
    assert triton_adamw["last_loss"] == pytest.approx(torch_adamw["last_loss"], rel=1e-4)
    assert triton_adamw["last_loss"] != triton_adamw["first_loss"]
