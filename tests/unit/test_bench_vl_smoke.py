"""Smoke run of tests/perf/bench_vl.py on the CPU, so that it works the first time on a GPU.

One subprocess per data path from the repo root with CUDA hidden: ``--config tiny`` (a tiny
Qwen2-VL built in the script, the shipped real images at a few merged tokens each), two samples
per step (the batched transformers input and a two-document packed stream), 1 warmup + 1 timed
step, mpcore and transformers side by side. The JSON is checked field by field: the data
(images, image-token fraction that adds up, the prepared store's counts: image tokens that are
the grids' patches / merge^2, every sample once, no padding), equal parameter counts, the same
batches (digest) and targets per step on both sides, finite positive tokens/s that agree with
the step time, null peak memory on CPU, finite losses near ln(vocab) for fresh models, liger
reported missing (it needs CUDA), and the speedup computed against the baseline that ran. In
process: the prepared store holds process_image's own upscale of every original image, bit for
bit, and the loader's batches are the store's samples, each once. A run ended during
transformers' rows leaves ours in the JSON, which says that theirs did not finish.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpcore.data import VLDataset
from mpcore.data.images import load_image, process_image
from mpcore.data.vl_manifest import iter_manifest
from tests.perf import (
    bench_qwen35,
    bench_vl,
    vl_batches,
)
from tests.unit.bench_ended import ended_in_transformers_rows

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # benchmark smoke runs (torchrun layouts, HF baselines)

SEQ, MICRO_BATCH, STEPS, WARMUP = 256, 2, 1, 1
DISTINCT = 4  # bench_vl's --distinct-batches default
VOCAB = 516  # bench_vl.tiny()
TIMEOUT = 300  # seconds; about 20 s on 2 busy cores


def _run(out: Path, data: str, family: str = "qwen2_vl") -> dict:
    cmd = [sys.executable, "-m", "tests.perf.bench_vl", str(out), "--family", family,
           "--config", "tiny", "--seq",
           str(SEQ), "--micro-batch", str(MICRO_BATCH), "--steps", str(STEPS), "--warmup",
           str(WARMUP), "--data", data]
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


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("bench_vl") / "vl.json", "prepared")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("bench_vl") / "vl.json", "synthetic")


def _check_side(side: dict, data: dict) -> None:
    assert math.isfinite(side["step_ms"]) and side["step_ms"] > 0, side
    assert side["timing"] == "steady", side  # the default: steps back to back, as fit runs
    # the same batches (what the side fed its model) and the same targets on every side
    assert side["batches_sha256"] == data["batches_sha256"], (side, data)
    assert side["target_tokens_per_step"] == data["target_tokens_per_step"], (side, data)
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
    assert report["data_path"] == "prepared"
    _check_data(report["data"])
    store = report["data"]["store"]
    assert store["samples"] == store["budgets"] == DISTINCT * MICRO_BATCH  # each sample once
    assert store["tokens"] == store["samples"] * SEQ and store["pad_tokens"] == 0
    assert store["image_tokens"] * 4 == store["pixel_rows"]  # merge 2: 4 patches per token
    data = report["data"]
    assert data["image_tokens_per_step"] * DISTINCT == store["image_tokens"]
    assert data["patches_per_step"] * DISTINCT == store["pixel_rows"]
    assert data["images_per_step"] * DISTINCT == store["images"]
    assert store["tokenizer"]["image_token_id"] == store["tokenizer"]["text_vocab_size"] == 512


def _check_data(data: dict) -> None:
    assert data["tokens_per_step"] == SEQ * MICRO_BATCH
    assert data["images_per_step"] >= MICRO_BATCH  # at least one real image per sample
    assert data["image_tokens_per_step"] + data["text_tokens_per_step"] == SEQ * MICRO_BATCH
    assert 0 < data["target_tokens_per_step"] < data["text_tokens_per_step"]
    assert 0 < data["image_token_fraction"] < 1
    assert data["patches_per_step"] == 4 * data["image_tokens_per_step"]  # the grids' tokens
    # every image of the first step: 4 patches per merged token, grids of whole merge windows
    grids = data["image_grids_first_step"]
    assert all(t == 1 and h % 2 == 0 and w % 2 == 0 for t, h, w in grids)


def _check_sides(report: dict) -> None:
    _check_side(report["mpcore"], report["data"])
    assert report["mpcore"]["input_prep_ms"] > 0
    _check_side(report["hf"], report["data"])
    assert report["hf"]["attn_implementation"] == "sdpa"
    assert set(report["hf_liger"]) == {"missing"}, report["hf_liger"]  # no liger run on CPU
    assert set(report["hf_fa2"]) == {"missing"}, report["hf_fa2"]


def test_both_sides_ran(report):
    _check_sides(report)


def test_synthetic_data_path(synthetic):
    assert synthetic["data_path"] == "synthetic" and "store" not in synthetic["data"]
    _check_data(synthetic["data"])
    _check_sides(synthetic)


@pytest.mark.parametrize("family", ["qwen3_vl", "glm4v"])
def test_other_vl_families_side_by_side(family, tmp_path):
    """The Qwen3-VL and GLM-4V families through the same benchmark: the family's registry
    entry builds our side, transformers' model of the family the baseline, same batches."""
    report = _run(tmp_path / f"{family}.json", "prepared", family)
    _check_family(report, family)
    # no DeltaNet layers: neither our kernel nor transformers' fast path is reported
    assert "gdn_kernel" not in report["mpcore"] and "hf_fast_path" not in report


def test_qwen3_5_vl_side_by_side(tmp_path):
    """Qwen3.5-VL (the hybrid Gated DeltaNet decoder behind the tower without DeepStack)
    through the same benchmark, plus what each side's DeltaNet layers ran: ours under
    gdn_kernel=auto (the reference on the CPU: fla is CUDA-only), transformers' fast path as
    found installed, its fallback warnings logged when flash-linear-attention is missing."""
    report = _run(tmp_path / "qwen3_5_vl.json", "prepared", "qwen3_5_vl")
    _check_family(report, "qwen3_5_vl")
    kernel = report["mpcore"]["gdn_kernel"]
    assert (kernel["requested"], kernel["ran"]) == ("auto", "reference"), kernel
    assert "CUDA-only" in kernel["why"], kernel
    fast = report["hf_fast_path"]
    assert {k: fast[k] for k in bench_qwen35.hf_paths()} == bench_qwen35.hf_paths()
    if fast["flash-linear-attention"] is None:
        assert any("chunk_gated_delta_rule" in w for w in fast["fallback_warnings"]), fast


def test_qwen3_5_vl_released_shape():
    """``--config 0.8b`` is Qwen3.5-0.8B with its tower (0.85 B parameters, the count both
    sides' models must reach) and the release's special ids."""
    cfg = bench_vl.qwen3_5_vl_0p8b()
    params = bench_vl.count_params(cfg)
    assert params["mpcore"] == params["transformers"] == 852_985_920
    assert (cfg.image_token_id, cfg.vision_start_token_id) == (248056, 248053)
    assert (cfg.vision.depth, cfg.vision.hidden_size, cfg.vision.out_hidden_size) == (
        12, 768, 1024)
    assert cfg.text.layer_types.count("full_attention") == 6 and cfg.text.num_layers == 24


def _check_family(report: dict, family: str) -> None:
    assert report["family"] == family
    params = report["num_params"]
    assert params["mpcore"] == params["transformers"] > 0
    _check_data(report["data"])
    for key in ("mpcore", "hf"):
        _check_side(report[key], report["data"])
    assert report["speedup_vs_best_baseline"] == pytest.approx(
        report["mpcore"]["tokens_per_s_per_gpu"] / report["hf"]["tokens_per_s_per_gpu"])


def test_prepared_store_is_the_upscaled_images(tmp_path):
    """Every image of the store: process_image's own upscale of the original file, bit for bit;
    placeholder runs as long as the grids say, never a target; the loader's batches are the
    store's samples, each once."""
    make_config, _, image_tokens, text_vocab = bench_vl.PRESETS["qwen2_vl"]["tiny"]
    cfg, batches, store = vl_batches.prepared_batches(make_config(), SEQ, image_tokens, 0.6,
                                                      MICRO_BATCH, 2, text_vocab, tmp_path)
    ds = VLDataset(tmp_path / "store")
    assert cfg.image_token_id == ds.tokenizer.image_pad_id and len(ds) == 2 * MICRO_BATCH
    for i, sample in enumerate(iter_manifest(tmp_path / "manifest.jsonl")):
        rows, grids = [], []
        for path in sample.images:  # images/<name>.<tokens>.png
            name, tokens, _ = path.name.rsplit(".", 2)
            r, g = process_image(load_image(vl_batches.IMAGES / name),
                                 min_pixels=int(tokens) * 784, max_pixels=2 * int(tokens) * 784)
            rows.append(r)
            grids.append(g)
        got = ds[i]
        assert torch.equal(torch.tensor(got.pixel_values), torch.cat(rows))  # a copy
        assert got.grid_thw.tolist() == [list(g) for g in grids]
        image = got.input_ids == cfg.image_token_id
        assert image.sum() == sum(t * h * w for t, h, w in grids) // 4
        assert len(got.input_ids) == SEQ and not got.loss_mask[image].any()
    rows = sorted(tuple(b.ids[k].tolist()) for b in batches for k in range(MICRO_BATCH))
    assert rows == sorted(tuple(ds[i].input_ids.tolist()) for i in range(len(ds)))
    for b in batches:
        assert (b.ids == cfg.image_token_id).sum() == b.pixels.shape[0] // 4 == int(
            b.grid.prod(1).sum()) // 4


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
           "-m", "tests.perf.bench_vl", str(out), "--config", "tiny", "--seq", str(SEQ),
           "--micro-batch", str(MICRO_BATCH), "--steps", str(STEPS), "--warmup", str(WARMUP),
           "--cp", "2", "--vision-cp", vision_cp]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got, want = json.loads(out.read_text())["mpcore"], report["mpcore"]
    for key in ("first_loss", "last_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), (key, got, want)


@pytest.mark.parametrize("side,tower", [("mpcore", "visual"), ("hf", "model.visual")])
def test_profile_vl_marks_each_sides_tower(side, tower, tmp_path):
    """tests/perf/profile_vl.py on either side: the profiled steps ran (3 of each marked
    forward), and the tower's forward range is the model's share, inside it."""
    out = tmp_path / "profile.txt"
    cmd = [sys.executable, "-m", "tests.perf.profile_vl", str(out), "--side", side,
           "--family", "qwen3_5_vl", "--config", "tiny", "--seq", str(SEQ)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-5000:]
    text = out.read_text()
    assert f"side: {side}; forward ranges on ['', '{tower}']" in text, text[:500]
    totals = {}
    for line in text.splitlines():
        cols = line.split()
        if cols and cols[0] in ("fwd:model", "fwd:visual"):
            assert cols[-1] == "3", line  # one range per profiled step
            totals[cols[0]] = float(cols[4].removesuffix("ms"))  # CPU total, ms
    assert 0 < totals["fwd:visual"] < totals["fwd:model"], totals
    # the side's JSON files the run under the side that ran
    assert set(json.loads(out.with_suffix(".json").read_text())) & {"mpcore", "hf"} == {side}


def test_profile_vl_lists_the_call_sites_of_named_operators(tmp_path):
    """``--stacks``: the report names where each operator was called from. On the CPU (the
    reference attention) ``aten::index`` is called from the tower's attention and the input
    planning; an operator the step never calls is said to be none called."""
    out = tmp_path / "profile.txt"
    cmd = [sys.executable, "-m", "tests.perf.profile_vl", str(out), "--stacks",
           "aten::index,aten::no_such_op", "--family", "qwen3_5_vl", "--config", "tiny",
           "--seq", str(SEQ)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-5000:]
    sites = out.read_text().split("call sites of aten::index, aten::no_such_op over 3 steps")[1]
    assert re.search(r"^aten::index: \d+ calls, self host [\d.]+ ms", sites, re.M), sites[:2000]
    assert "models/common/vision_attention.py" in sites, sites[:2000]
    assert re.search(r"^aten::no_such_op: none called$", sites, re.M), sites[-500:]


def test_a_run_ended_during_transformers_rows_leaves_ours_and_says_so(tmp_path, monkeypatch):
    result = ended_in_transformers_rows(monkeypatch, bench_vl, "run_baselines",
                                        tmp_path / "vl.json", "--config", "tiny", "--seq",
                                        str(SEQ), "--micro-batch", "1", "--steps", "1",
                                        "--warmup", "0", "--data", "synthetic")
    assert result["mpcore"]["step_ms"] > 0
    assert result["hf"] == bench_qwen35.HF_UNFINISHED
