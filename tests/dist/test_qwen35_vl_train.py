"""The Qwen3.5 VL family through the launch path: ``launch/configs/qwen35_vl_tiny.yaml`` (made
smaller) trains through ``mpcore.train`` on the shipped image set, tp = 2 (SP on) and cp = 2
(ring, and Ulysses) equal tp = 1 step for step, and the trained checkpoint exports to a folder
transformers loads with the same outputs on an image; ``launch/score.py`` with images at
tp = 1 x cp = 2 gives transformers' log-probs per sequence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_qwen3_vl_tiny import END, IMAGE, START
from hf_qwen35_vl_tiny import save_hf_model
from vl_export import export_matches_transformers

from mpcore.config import load_config
from mpcore.data import prepare_vl_default
from mpcore.train import train

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "launch" / "configs" / "qwen35_vl_tiny.yaml"
STEPS = 6


def tiny(tmp, run: str, *overrides: str):
    return load_config(str(CONFIG), [
        "model.vocab_size=516", "model.hidden_size=32", "model.intermediate_size=64",
        "model.tie_embeddings=false", "model.vision.hidden_size=32", "model.vision.num_heads=2",
        "model.vision.intermediate_size=64", f"data.cache_dir={tmp}/data",
        "data.default_vocab_size=512", "data.micro_batch=2", "data.grad_accum=1",
        "optimizer.lr=1e-2", "schedule.warmup_steps=2", f"training.max_steps={STEPS}",
        "training.device=cpu", f"logging.run_dir={tmp}/{run}", "logging.log_every=100",
        f"checkpoint.every={STEPS}", *overrides])


def _layouts(rank, world, tmp):
    del rank, world
    return {name: train(tiny(tmp, name, *extra)).losses for name, extra in (
        ("tp2_sp", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("cp2_ring", ["parallel.cp=2", "parallel.cp_mode=ring"]),
        ("cp2_ulysses", ["parallel.cp=2", "parallel.cp_mode=ulysses"]))}


@pytest.mark.slow
def test_trains_layouts_agree_and_exports(tmp_path):
    prepare_vl_default(tmp_path / "data", 512)
    ref = train(tiny(tmp_path, "ref")).losses
    assert len(ref) == STEPS and all(torch.isfinite(torch.tensor(ref)))
    assert ref[-1] < ref[0]
    for rank_losses in run_distributed(_layouts, 2, str(tmp_path), timeout=900):
        for name, losses in rank_losses.items():
            diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
            assert diff <= 1e-4, (name, losses, ref)
    export_matches_transformers(tmp_path / "ref" / "checkpoints", tmp_path / "hf",
                                "Qwen3_5ForConditionalGeneration")


@pytest.mark.slow
def test_score_with_images_matches_transformers(tmp_path):
    import transformers

    save_hf_model(seed=3, folder=tmp_path / "ckpt")
    gen = torch.Generator().manual_seed(4)
    pixels = torch.randn(24, 24, generator=gen)
    lines = [{"input_ids": [5, 6, START] + [IMAGE] * 6 + [END, 9, 10, 11],
              "pixel_values": pixels.tolist(), "image_grid_thw": [[1, 4, 6]]},
             {"input_ids": [1, 2, 3, 4, 5, 7, 8]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(REPO / "launch" / "score.py"), "--hf-checkpoint", str(tmp_path / "ckpt"),
         "--tp", "1", "--cp", "2", "--cp-mode", "ring", "--input", str(tmp_path / "in.jsonl"),
         "--output", str(tmp_path / "out.jsonl")], cwd=REPO, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(x)["logprobs"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "ckpt").eval()
    for line, mine in zip(lines, got, strict=True):
        ids = torch.tensor(line["input_ids"])
        kwargs = {}
        if "pixel_values" in line:
            kwargs = dict(pixel_values=pixels, image_grid_thw=torch.tensor(line["image_grid_thw"]),
                          mm_token_type_ids=(ids == IMAGE).long()[None])
        with torch.no_grad():
            logits = hf(input_ids=ids[None], **kwargs).logits[0]
        want = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
        want = torch.where(ids[1:] == IMAGE, 0.0, want)  # placeholders are never scored
        assert (torch.tensor(mine) - want).abs().max().item() < 1e-4
