"""Qwen3-VL-MoE trains through ``mpcore.train`` on the shipped image set
(launch/configs/qwen3_vl_moe_tiny.yaml, made smaller): the loss (with the step's global
load-balancing loss) falls, every logged row carries the router statistics, and cp = 2 (ring)
with the experts split over ep = 2 (the two cp ranks) equals one process step for step. Its
ep = 2 checkpoint exports (launch/export_hf) to a folder transformers loads with our outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed

from mpcore.config import load_config
from mpcore.data import prepare_vl_default
from mpcore.train import train

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "launch" / "configs" / "qwen3_vl_moe_tiny.yaml"
STEPS = 8


def tiny(tmp, run: str, *overrides: str):
    return load_config(str(CONFIG), [
        "model.vocab_size=516", "model.hidden_size=32", "model.intermediate_size=64",
        "model.vision.hidden_size=32", "model.vision.num_heads=2",
        "model.vision.intermediate_size=64", "model.moe.moe_intermediate_size=32",
        "model.moe.router_aux_loss_coef=0.5", f"data.cache_dir={tmp}/data",
        "data.default_vocab_size=512", "data.micro_batch=2", "data.grad_accum=1",
        "optimizer.lr=1e-2", "schedule.warmup_steps=2", f"training.max_steps={STEPS}",
        "training.device=cpu", f"logging.run_dir={tmp}/{run}", "logging.log_every=1",
        "checkpoint.every=0", *overrides])


def _cp_ep(rank, world, tmp):
    del rank, world
    return train(tiny(tmp, "cp2_ep2", "parallel.cp=2", "parallel.cp_mode=ring",
                      "parallel.ep=2", f"checkpoint.every={STEPS}")).losses


@pytest.mark.slow
def test_trains_and_cp2_ep2_equals_one_process(tmp_path):
    prepare_vl_default(tmp_path / "data", 512)
    ref = train(tiny(tmp_path, "ref")).losses
    assert len(ref) == STEPS and all(torch.isfinite(torch.tensor(ref)))
    assert sum(ref[-3:]) < sum(ref[:3]) - 0.3, ref  # falls (each step has other images)
    rows = [json.loads(r) for r in (tmp_path / "ref" / "metrics.jsonl").read_text()
            .splitlines()]
    assert len(rows) == STEPS
    for row in rows:
        assert len(row["expert_load"]) == 4 and sum(row["expert_load"]) > 0, row
        assert row["dropped_tokens"] == 0 and row["aux_loss"] > 0, row
    for losses in run_distributed(_cp_ep, 2, str(tmp_path), timeout=600):
        diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
        assert diff <= 1e-4, (losses, ref)

    _export_matches_transformers(tmp_path, tmp_path / "cp2_ep2" / "checkpoints")


def _export_matches_transformers(tmp, checkpoints):
    import transformers

    from models.qwen3_vl_moe.family import local_inputs
    from models.qwen3_vl_moe.hf import load_hf_model
    from parallel.state import ParallelState

    out = tmp / "hf"
    proc = subprocess.run([sys.executable, "-m", "launch.export_hf", "--checkpoint",
                           str(checkpoints), "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(
        out, experts_implementation="eager").eval()
    state = ParallelState.build()
    ours, cfg = load_hf_model(out, state)
    ids = torch.tensor([5, 7, cfg.vision_start_token_id, *[cfg.image_token_id] * 4,
                        cfg.vision_end_token_id, 9, 11])
    pixels = torch.randn(16, cfg.vision.patch_dim, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[1, 4, 4]])
    _, inputs = local_inputs(state, ids, torch.tensor([0, ids.numel()]), cfg,
                             pixel_values=pixels, image_grid_thw=grid)
    with torch.no_grad():
        mine = ours(**inputs, output="logits")[:, :cfg.text.vocab_size]
        theirs = hf(input_ids=ids[None], pixel_values=pixels, image_grid_thw=grid,
                    mm_token_type_ids=(ids == cfg.image_token_id).long()[None]).logits[0]
    assert float((mine - theirs).abs().max()) <= 1e-4
