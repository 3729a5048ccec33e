"""Qwen3-VL-MoE trains through ``mpcore.train`` on the shipped image set
(launch/configs/qwen3_vl_moe_tiny.yaml, made smaller): the loss (with the step's global
load-balancing loss) falls, every logged row carries the router statistics, and cp = 2 (ring)
with the experts split over ep = 2 (the two cp ranks) equals one process step for step. Its
ep = 2 checkpoint exports (launch/export_hf) to a folder transformers loads with our outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpcore.models.qwen3_vl_moe.family import FAMILY
from tests.dist.vl_launch_checks import TinyRun, export_matches_transformers, layouts_agree

CONFIG = Path(__file__).resolve().parents[2] / "launch" / "configs" / "qwen3_vl_moe_tiny.yaml"
STEPS = 8
TINY = TinyRun(str(CONFIG), (
    "model.vocab_size=516", "model.hidden_size=32", "model.intermediate_size=64",
    "model.vision.hidden_size=32", "model.vision.num_heads=2",
    "model.vision.intermediate_size=64", "model.moe.moe_intermediate_size=32",
    "model.moe.router_aux_loss_coef=0.5"), steps=STEPS, log_every=1, checkpoint_every=0)


@pytest.mark.slow
def test_trains_and_cp2_ep2_equals_one_process(tmp_path):
    ref = layouts_agree(TINY, tmp_path, (
        ("cp2_ep2", ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.ep=2",
                     f"checkpoint.every={STEPS}"]),), timeout=600)
    assert sum(ref[-3:]) < sum(ref[:3]) - 0.3, ref  # falls (each step has other images)
    rows = [json.loads(r) for r in (tmp_path / "ref" / "metrics.jsonl").read_text()
            .splitlines()]
    assert len(rows) == STEPS
    for row in rows:
        assert len(row["expert_load"]) == 4 and sum(row["expert_load"]) > 0, row
        assert row["dropped_tokens"] == 0 and row["aux_loss"] > 0, row
    export_matches_transformers(tmp_path, tmp_path / "cp2_ep2" / "checkpoints", FAMILY,
                                "Qwen3VLMoeForConditionalGeneration",
                                ("vision_start_token_id", "vision_end_token_id"), (1, 4, 4),
                                (9, 11), experts_implementation="eager")
