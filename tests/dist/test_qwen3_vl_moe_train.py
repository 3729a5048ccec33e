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
from vl_export import export_matches_transformers

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

    export_matches_transformers(tmp_path / "cp2_ep2" / "checkpoints", tmp_path / "hf",
                                "Qwen3VLMoeForConditionalGeneration",
                                experts_implementation="eager")

