"""Every vision-language family trains at pp = 2 as at pp = 1: the launch YAMLs' tiny models
(made smaller, untied heads, 2 micro-batches a step) on the shipped image set blended with text,
4 steps, losses within 1e-5 rel. Qwen3-VL's DeepStack features join after decoder layers 0 and 1,
both on the first stage (3 layers split [2, 1]); GLM-4V's decoder block and Qwen3.5-VL's
hybrid decoder sit on both stages; Qwen3-VL-MoE adds its load-balancing loss across stages."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mpcore.data import prepare_vl_default
from mpcore.train import train
from tests.dist.harness import run_distributed
from tests.dist.test_glm4v_train import TINY as GLM4V
from tests.dist.test_qwen3_vl_moe_train import TINY as QWEN3_VL_MOE
from tests.dist.test_qwen35_vl_train import TINY as QWEN35_VL
from tests.dist.vl_launch_checks import TinyRun

pytestmark = pytest.mark.slow  # a one-process and a 2-rank training run per family

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"
QWEN3_VL = TinyRun(str(CONFIGS / "qwen3_vl_tiny.yaml"), (
    "model.vocab_size=516", "model.hidden_size=32", "model.intermediate_size=64",
    "model.vision.hidden_size=32", "model.vision.num_heads=2",
    "model.vision.intermediate_size=64"), steps=4)
RUNS = {"qwen3_vl": QWEN3_VL, "glm4v": GLM4V, "qwen3_5_vl": QWEN35_VL,
        "qwen3_vl_moe": QWEN3_VL_MOE}
COMMON = ("model.tie_embeddings=false", "data.grad_accum=2", "training.max_steps=4",
          "checkpoint.every=0")


def _pp2(rank, world, tiny, tmp):
    return train(tiny(tmp, "pp2", *COMMON, "parallel.pp=2")).losses


@pytest.mark.parametrize("family", sorted(RUNS))
def test_vl_family_at_pp2_matches_pp1(tmp_path, family):
    tiny = RUNS[family]
    prepare_vl_default(tmp_path / "data", 512)
    want = train(tiny(str(tmp_path), "ref", *COMMON)).losses
    assert len(want) == 4
    for got in run_distributed(_pp2, 2, tiny, str(tmp_path), timeout=600):
        assert len(got) == len(want)
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert math.isclose(a, b, rel_tol=1e-5), (family, step + 1, a, b)
