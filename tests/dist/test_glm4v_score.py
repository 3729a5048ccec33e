"""launch/score.py on a GLM-4V checkpoint (pixel_values form, tp=1 x cp=2 ring) vs transformers:
the registry gives score.py the family's inputs; log-probs within 1e-4 per sequence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_glm4v_tiny import I_END, I_START, IMAGE, save_hf_model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_score_matches_transformers(tmp_path):
    import transformers

    save_hf_model(seed=3, folder=tmp_path / "ckpt")
    gen = torch.Generator().manual_seed(4)
    pixels = torch.randn(24, 24, generator=gen)
    lines = [{"input_ids": [5, 6, I_START] + [IMAGE] * 6 + [I_END, 9, 10, 11],
              "pixel_values": pixels.tolist(), "image_grid_thw": [[1, 4, 6]]},
             {"input_ids": [1, 2, 3, 4, 5, 7, 8]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(REPO / "launch" / "score.py"), "--hf-checkpoint", str(tmp_path / "ckpt"),
         "--tp", "1", "--cp", "2", "--cp-mode", "ring", "--input", str(tmp_path / "in.jsonl"),
         "--output", str(tmp_path / "out.jsonl")], cwd=REPO, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(x)["logprobs"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    hf = transformers.Glm4vForConditionalGeneration.from_pretrained(tmp_path / "ckpt").eval()
    for line, mine in zip(lines, got, strict=True):
        ids = torch.tensor(line["input_ids"])
        kwargs = {}
        if "pixel_values" in line:
            kwargs = dict(pixel_values=pixels, image_grid_thw=torch.tensor(line["image_grid_thw"]),
                          mm_token_type_ids=(ids == IMAGE).long()[None])
        with torch.no_grad():
            logits = hf(input_ids=ids[None], **kwargs).logits[0]
        want = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
        want = torch.where(ids[1:] == IMAGE, 0.0, want)  # placeholders are never scored
        assert (torch.tensor(mine) - want).abs().max().item() < 1e-4
