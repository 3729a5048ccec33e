"""launch/score.py with videos on Qwen3-VL and GLM-4V checkpoints (one process, CPU).

Each family's tiny random transformers model and packed stream (tests/dist/hf_qwen3_vl_tiny.py,
hf_glm4v_tiny.py: images of different grids, a 3-frame video laid out frame by frame as each
processor writes it, text-only documents) become an input file of one line per document, in the
``pixel_values`` / ``pixel_values_videos`` form; score.py reads it (each family's own placeholder
check), packs the lines into one stream and scores it. Reference: transformers per document.
Per-token log-probs within 1e-4 wherever the target is not a placeholder.
"""

from __future__ import annotations

import json

import pytest
import torch

from mpcore.launch.score import checkpoint_spec, score_items
from mpcore.launch.score_io import read_input
from mpcore.models import family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist import hf_glm4v_tiny as glm
from tests.dist import hf_qwen3_vl_tiny as qwen3


def _rows(pixels, grid, which: list[int]):
    sizes = [int(r.prod()) for r in grid] if grid is not None else []
    start = sum(sizes[:which[0]]) if which else 0
    return pixels[start:start + sum(sizes[i] for i in which)].tolist()


def lines_of(s: dict, docs: list[tuple[list[int], list[int]]]) -> list[dict]:
    """One input line per document: its ids and its images' / videos' rows and grids."""
    cu = s["cu_seqlens"].tolist()
    lines = []
    for d, (images, videos) in enumerate(docs):
        line = {"input_ids": s["input_ids"][cu[d]:cu[d + 1]].tolist()}
        if images:
            line["pixel_values"] = _rows(s["pixel_values"], s["image_grid_thw"], images)
            line["image_grid_thw"] = s["image_grid_thw"][images].tolist()
        if videos:
            line["pixel_values_videos"] = _rows(s["pixel_values_videos"], s["video_grid_thw"],
                                                videos)
            line["video_grid_thw"] = s["video_grid_thw"][videos].tolist()
        lines.append(line)
    return lines


def qwen3_case(folder):
    qwen3.save_hf_model(4, folder)
    s = qwen3.stream(9)
    docs = [(list(range(fi, fi + ni)), list(range(fv, fv + nv))) for fi, ni, fv, nv in
            s["per_doc"]]
    return s, docs, qwen3.reference_scores(folder, s)[0], (qwen3.IMAGE, qwen3.VIDEO)


def glm4v_case(folder):
    glm.save_hf_model(4, folder)
    s = glm.stream(9)
    docs = [(images, [] if video is None else [video]) for images, video in s["docs"]]
    import transformers

    hf = transformers.Glm4vForConditionalGeneration.from_pretrained(folder).eval()
    return s, docs, glm.reference_logprobs(hf, s).double(), (glm.IMAGE,)


@pytest.mark.parametrize("case", [pytest.param(qwen3_case, marks=pytest.mark.slow), glm4v_case],
                         ids=["qwen3_vl", "glm4v"])
def test_videos_score_as_transformers(case, tmp_path):
    folder = tmp_path / "ckpt"
    s, docs, want, placeholders = case(folder)
    assert s["video_grid_thw"] is not None and int(s["video_grid_thw"][0, 0]) == 3
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines_of(s, docs)))
    items = read_input(path, checkpoint_spec(folder))
    assert sum(i.num_videos for i in items) == 1
    state = ParallelState()
    model, _ = family_of_hf(folder).load_hf(folder, state)
    results = score_items(model.eval(), state, items)
    ids, cu = s["input_ids"], s["cu_seqlens"].tolist()
    ours = torch.zeros(ids.numel(), dtype=torch.float64)
    for d, result in enumerate(results):
        ours[cu[d]:cu[d + 1] - 1] = torch.tensor(result["logprobs"], dtype=torch.float64)
    target = torch.zeros(ids.numel(), dtype=torch.bool)
    target[:-1] = ~torch.isin(ids[1:], torch.tensor(placeholders))
    for d in range(len(docs)):
        target[cu[d + 1] - 1] = False  # a document's last token scores nothing
    assert int(target.sum()) > 40
    assert float((ours - want)[target].abs().max()) <= 1e-4
    assert bool((ours[~target] == 0).all())
