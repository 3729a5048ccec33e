"""GLM-4V trains through ``mpcore.train`` on the shipped image set (launch/configs/glm4v_tiny.yaml,
made smaller), tp = 2 (SP on) and cp = 2 equal tp = 1 step for step, and the trained checkpoint
exports to a folder transformers loads with the same outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpcore.models.glm4v import FAMILY
from tests.dist.vl_launch_checks import TinyRun, export_matches_transformers, layouts_agree

CONFIG = Path(__file__).resolve().parents[2] / "launch" / "configs" / "glm4v_tiny.yaml"
TINY = TinyRun(str(CONFIG), (
    "model.vocab_size=518", "model.hidden_size=32", "model.num_heads=4",
    "model.num_kv_heads=2", "model.intermediate_size=64", "model.mrope_section=[1,1,0]",
    "model.tie_embeddings=false", "model.vision.hidden_size=32", "model.vision.num_heads=2",
    "model.vision.intermediate_size=64"), steps=6)


@pytest.mark.slow
def test_trains_layouts_agree_and_exports(tmp_path):
    ref = layouts_agree(TINY, tmp_path, (
        ("tp2_sp", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("cp2_ring", ["parallel.cp=2", "parallel.cp_mode=ring"])), timeout=600)
    assert ref[-1] < ref[0]
    export_matches_transformers(tmp_path, tmp_path / "ref" / "checkpoints", FAMILY,
                                "Glm4vForConditionalGeneration",
                                ("image_start_token_id", "image_end_token_id"), (1, 4, 4), (9, 11))
