"""The Qwen3.5-MoE VL family through the launch path: ``launch/configs/qwen35_vl_moe_tiny.yaml``
(made smaller) trains through ``torchrun launch/pretrain.py`` on the shipped image set (the
loss, with the step's global load-balancing loss, falls; every logged row carries the router
statistics), cp = 2 (ring) with the experts split over ep = 2 (the two cp ranks) equals that
one-process run step for step, stopped halfway at that layout and resumed it continues the
uninterrupted cp = 2 x ep = 2 run bit for bit, and its ep = 2 checkpoint exports
(``mpcore.launch.export_hf``) to a folder transformers loads as ``Qwen3_5MoeForConditionalGeneration``
with our outputs on an image. (The one-process resume: tests/unit/test_qwen35_vl_moe_train.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpcore.config import load_config
from mpcore.data import prepare_vl_default
from mpcore.models.qwen3_5_vl_moe.family import FAMILY
from mpcore.train import train
from tests.dist.harness import run_distributed
from tests.dist.vl_launch_checks import export_matches_transformers

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "launch" / "configs" / "qwen35_vl_moe_tiny.yaml"
STEPS = 6
SMALLER = ["model.vocab_size=516", "model.hidden_size=32", "model.intermediate_size=64",
           "model.vision.hidden_size=32", "model.vision.num_heads=2",
           "model.vision.intermediate_size=64", "model.moe.moe_intermediate_size=32",
           "model.moe.router_aux_loss_coef=0.5", "data.default_vocab_size=512",
           "data.micro_batch=2", "data.grad_accum=1", "optimizer.lr=1e-2",
           "schedule.warmup_steps=2", f"training.max_steps={STEPS}", "training.device=cpu",
           "logging.log_every=1"]


def _cp_ep(rank, world, tmp):
    """(the cp = 2 x ep = 2 run's losses, those of the same run in two resumed halves)."""
    del rank, world
    layout = [*SMALLER, f"data.cache_dir={tmp}/data", "parallel.cp=2", "parallel.cp_mode=ring",
              "parallel.ep=2"]
    straight = train(load_config(str(CONFIG), [
        *layout, f"logging.run_dir={tmp}/cp2_ep2", f"checkpoint.every={STEPS}"])).losses
    half = [*layout, f"logging.run_dir={tmp}/cp2_ep2_halves", f"checkpoint.every={STEPS // 2}",
            f"schedule.total_steps={STEPS}"]  # the first half's schedule is the whole run's
    first = train(load_config(str(CONFIG), [*half, f"training.max_steps={STEPS // 2}"]))
    second = train(load_config(str(CONFIG), half))
    return straight, first.losses + second.losses


@pytest.mark.slow
def test_pretrain_trains_cp2_ep2_equals_it_and_exports(tmp_path):
    prepare_vl_default(tmp_path / "data", 512)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
         str(REPO / "launch" / "pretrain.py"), str(CONFIG), *SMALLER,
         f"data.cache_dir={tmp_path}/data", f"logging.run_dir={tmp_path}/ref",
         "checkpoint.every=0"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(r) for r in (tmp_path / "ref" / "metrics.jsonl").read_text()
            .splitlines()]
    ref = [r["loss"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(ref))) and ref[-1] < ref[0], ref
    for row in rows:
        assert len(row["expert_load"]) == 4 and sum(row["expert_load"]) > 0, row
        assert row["dropped_tokens"] == 0 and row["aux_loss"] > 0, row
    for losses, resumed in run_distributed(_cp_ep, 2, str(tmp_path), timeout=600):
        diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
        assert diff <= 1e-4, (losses, ref)
        assert resumed == losses, (resumed, losses)  # bit for bit
    export_matches_transformers(tmp_path, tmp_path / "cp2_ep2" / "checkpoints", FAMILY,
                                "Qwen3_5MoeForConditionalGeneration",
                                ("vision_start_token_id", "vision_end_token_id"), (1, 4, 6),
                                (9, 11, 13), experts_implementation="eager")

