"""The Qwen3.5 VL family through the launch path: ``launch/configs/qwen35_vl_tiny.yaml`` (made
smaller) trains through ``mpcore.train`` on the shipped image set, tp = 2 (SP on) and cp = 2
(ring, and Ulysses) equal tp = 1 step for step, and the trained checkpoint exports to a folder
transformers loads with the same outputs on an image. (score.py with images vs transformers:
tests/dist/test_family_suite.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from mpcore.models.qwen3_5_vl import FAMILY
from tests.dist.vl_launch_checks import (
    TinyRun,
    export_matches_transformers,
    layouts_agree,
)

CONFIG = Path(__file__).resolve().parents[2] / "launch" / "configs" / "qwen35_vl_tiny.yaml"
TINY = TinyRun(str(CONFIG), (
    "model.vocab_size=516", "model.hidden_size=32", "model.intermediate_size=64",
    "model.tie_embeddings=false", "model.vision.hidden_size=32", "model.vision.num_heads=2",
    "model.vision.intermediate_size=64"), steps=6)


@pytest.mark.slow
def test_trains_layouts_agree_and_exports(tmp_path):
    ref = layouts_agree(TINY, tmp_path, (
        ("tp2_sp", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("cp2_ring", ["parallel.cp=2", "parallel.cp_mode=ring"]),
        ("cp2_ulysses", ["parallel.cp=2", "parallel.cp_mode=ulysses"])), timeout=900)
    assert ref[-1] < ref[0]
    export_matches_transformers(tmp_path, tmp_path / "ref" / "checkpoints", FAMILY,
                                "Qwen3_5ForConditionalGeneration",
                                ("vision_start_token_id", "vision_end_token_id"), (1, 4, 6),
                                (9, 11, 13))
