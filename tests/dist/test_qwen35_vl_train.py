"""The Qwen3.5 VL family through the launch path: ``launch/configs/qwen35_vl_tiny.yaml`` (made
smaller) trains through ``mpcore.train`` on the shipped image set, tp = 2 (SP on) and cp = 2
(ring, and Ulysses) equal tp = 1 step for step, and the trained checkpoint exports to a folder
transformers loads with the same outputs on an image; ``launch/score.py`` with images at
tp = 1 x cp = 2 gives transformers' log-probs per sequence."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_qwen3_vl_tiny import END, IMAGE, START
from hf_qwen35_vl_tiny import save_hf_model
from vl_launch_checks import score_matches_transformers

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
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "launch.export_hf", "--checkpoint",
                           str(tmp_path / "ref" / "checkpoints"), "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import transformers

    from models.qwen3_5_vl import FAMILY
    from parallel.state import ParallelState

    hf = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    assert isinstance(hf, transformers.Qwen3_5ForConditionalGeneration)
    state = ParallelState()
    ours, cfg = FAMILY.load_hf(out, state)
    ids = torch.tensor([5, 7, cfg.vision_start_token_id, *[cfg.image_token_id] * 6,
                        cfg.vision_end_token_id, 9, 11, 13])
    pixels = torch.randn(24, cfg.vision.patch_dim, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[1, 4, 6]])
    _, inputs = FAMILY.local_inputs(state, ids, torch.tensor([0, ids.numel()]), cfg,
                                    pixel_values=pixels, image_grid_thw=grid)
    types = (ids == cfg.image_token_id).long()[None]
    with torch.no_grad():
        mine = ours(**inputs, output="logits")[:, :cfg.text.vocab_size]
        theirs = hf(input_ids=ids[None], pixel_values=pixels, image_grid_thw=grid,
                    mm_token_type_ids=types).logits[0]
    assert float((mine - theirs).abs().max()) <= 1e-4


@pytest.mark.slow
def test_score_with_images_matches_transformers(tmp_path):
    score_matches_transformers(tmp_path, save_hf_model, "Qwen3_5ForConditionalGeneration",
                               (START, IMAGE, END))
