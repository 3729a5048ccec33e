"""Qwen35VLModel at tp x cp layouts vs one process and vs transformers (gloo, fp32, CPU).

The harness of ``test_qwen3_vl_dist`` (its worker reads the family off the checkpoint) on
``hf_qwen35_vl_tiny``'s model: tp in {1, 2} x cp in {1, 2} (and cp = 4 at tp = 1, slow), SP on
and off, ring and Ulysses for the full-attention layers (the DeltaNet layers run their head
all-to-all under either), the tower's work split over cp or replicated, activation
checkpointing. Streams: the mixed one (images of different grids, a 3-frame video; a
placeholder run crosses a zigzag cut), one whose only visual token lands on cp rank 1 of two
(rank 0 holds none but still runs the tower and joins every collective), and one without any
image (vision gradients exactly zero). Checked per case: log-probs and entropy vs transformers
(<= 1e-4) and vs tp = cp = 1 (<= 1e-5), the loss, and every gradient (tower, DeltaNet, gated
attention; summed over cp as the dp x cp reduction does) vs transformers (rel <= 1e-4) and vs
tp = cp = 1 (rel <= 1e-5).
"""

from __future__ import annotations

import pytest
from hf_qwen35_vl_tiny import save_hf_model
from test_qwen3_vl_dist import BASE, _run

# (tp, cp, cp_mode, sequence_parallel, activation_checkpointing, vision_cp)
QUICK = [BASE, (2, 1, "none", True, False, "split"), (1, 2, "ring", False, False, "split"),
         (2, 2, "ring", True, False, "split"), (2, 2, "ulysses", True, False, "replicate")]
MORE = [(2, 1, "none", False, True, "split"), (1, 2, "ulysses", False, True, "split"),
        (2, 2, "ring", False, False, "replicate"), (2, 2, "ulysses", False, False, "split"),
        (1, 4, "ring", False, False, "split"), (1, 4, "ulysses", False, False, "split")]
EDGE = [BASE, (1, 2, "ring", False, False, "split"), (2, 2, "ulysses", True, False, "split")]


def test_layouts_match_one_process_and_transformers(tmp_path):
    cases = [("mixed", layout) for layout in QUICK]
    cases += [(name, layout) for name in ("one_rank", "no_image") for layout in EDGE]
    visual = _run(tmp_path, cases, save=save_hf_model)
    # cp rank 1 of two holds the one visual token; rank 0 holds none but ran the tower.
    assert visual[("one_rank", (1, 2, "ring", False, False, "split"))] == [0, 1, 0, 1]


@pytest.mark.slow
def test_more_layouts_match_one_process_and_transformers(tmp_path):
    _run(tmp_path, [("mixed", layout) for layout in [BASE, *MORE]], save=save_hf_model)
