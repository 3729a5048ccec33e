"""The Qwen3.5-MoE vision-language family (``qwen3_5_vl_moe``) through the training path, one
process: launch/configs/qwen35_vl_moe_tiny.yaml, made smaller (as in
tests/dist/test_qwen35_vl_moe_train.py), trains on the shipped image set blended with the
default text corpus (micro-batches with and without images); its loss falls, every logged row
carries the step's global router statistics, and a run stopped halfway and resumed from its
checkpoint continues the uninterrupted one bit for bit (model, AdamW state, RNG and the VL
loader's position; two micro-batches a step, so the counting pass runs too). The same at
ep = 2 (cp = 2) is in tests/dist/test_qwen35_vl_moe_train.py.
"""

from __future__ import annotations

import math
from pathlib import Path

from mpcore.data import prepare_vl_default
from tests.unit.test_moe_train import trains_and_resumes_bit_identically

CONFIG = Path(__file__).resolve().parents[2] / "launch" / "configs" / "qwen35_vl_moe_tiny.yaml"
STEPS = 4
SMALLER = ["model.vocab_size=516", "model.hidden_size=32", "model.intermediate_size=64",
           "model.vision.hidden_size=32", "model.vision.num_heads=2",
           "model.vision.intermediate_size=64", "model.moe.moe_intermediate_size=32",
           "model.moe.router_aux_loss_coef=0.5", "data.default_vocab_size=512",
           "data.micro_batch=1", "data.grad_accum=2", "optimizer.lr=1e-2",
           "schedule.warmup_steps=1", f"schedule.total_steps={STEPS}", "training.device=cpu",
           "training.dtype=float32", "logging.log_every=1"]


def test_tiny_yaml_trains_and_resumes_bit_identically(tmp_path):
    prepare_vl_default(tmp_path / "data", 512)
    common = [*SMALLER, f"data.cache_dir={tmp_path / 'data'}"]
    rows = trains_and_resumes_bit_identically(CONFIG, tmp_path, common, STEPS)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert any(r["image_tokens_per_s"] > 0 for r in rows[STEPS // 2:]), rows  # images resumed
    for row in rows:
        load = row["expert_load"]
        assert len(load) == 4 and sum(load) > 0 and row["dropped_tokens"] == 0, row
        assert row["aux_loss"] > 0 and math.isfinite(row["z_loss"]), row
