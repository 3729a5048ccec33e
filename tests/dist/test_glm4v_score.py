"""launch/score.py on a GLM-4V checkpoint (pixel_values form, tp=1 x cp=2 ring) vs transformers:
the registry gives score.py the family's inputs; log-probs within 1e-4 per sequence."""

from __future__ import annotations

import pytest

from tests.dist.hf_glm4v_tiny import I_END, I_START, IMAGE, save_hf_model
from tests.dist.vl_launch_checks import score_matches_transformers


@pytest.mark.slow
def test_score_matches_transformers(tmp_path):
    score_matches_transformers(tmp_path, save_hf_model, "Glm4vForConditionalGeneration",
                               (I_START, IMAGE, I_END))
