"""Launch-path checks that every vision-language family runs the same way, parametrised by the
family: ``launch/score.py`` with images vs transformers (``score_matches_transformers``).
Images are ``[patches, patch_dim]`` pixel rows with a grid ``(t, h, w)`` in patches, merged
2 x 2 into ``t * h * w / 4`` placeholder tokens. transformers is imported inside the
functions: spawned ranks import this module and should not pay for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def score_matches_transformers(tmp: Path, save_hf_model, hf_class: str,
                               tokens: tuple[int, int, int]) -> None:
    """``launch/score.py`` (tp = 1 x cp = 2 ring, torchrun) on the checkpoint that
    ``save_hf_model(seed=, folder=)`` writes, one line with an image (``pixel_values`` form,
    grid 1 x 4 x 6) and one text-only line: log-probs within 1e-4 of ``transformers.<hf_class>``
    per sequence (0 at placeholders). ``tokens``: the (start, image, end) ids."""
    import transformers

    start, image, end = tokens
    save_hf_model(seed=3, folder=tmp / "ckpt")
    gen = torch.Generator().manual_seed(4)
    pixels = torch.randn(24, 24, generator=gen)
    lines = [{"input_ids": [5, 6, start] + [image] * 6 + [end, 9, 10, 11],
              "pixel_values": pixels.tolist(), "image_grid_thw": [[1, 4, 6]]},
             {"input_ids": [1, 2, 3, 4, 5, 7, 8]}]
    (tmp / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(REPO / "launch" / "score.py"), "--hf-checkpoint", str(tmp / "ckpt"),
         "--tp", "1", "--cp", "2", "--cp-mode", "ring", "--input", str(tmp / "in.jsonl"),
         "--output", str(tmp / "out.jsonl")], cwd=REPO, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(x)["logprobs"] for x in (tmp / "out.jsonl").read_text().splitlines()]
    hf = getattr(transformers, hf_class).from_pretrained(tmp / "ckpt").eval()
    for line, mine in zip(lines, got, strict=True):
        ids = torch.tensor(line["input_ids"])
        kwargs = {}
        if "pixel_values" in line:
            kwargs = dict(pixel_values=pixels, image_grid_thw=torch.tensor(line["image_grid_thw"]),
                          mm_token_type_ids=(ids == image).long()[None])
        with torch.no_grad():
            logits = hf(input_ids=ids[None], **kwargs).logits[0]
        want = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
        want = torch.where(ids[1:] == image, 0.0, want)  # placeholders are never scored
        assert (torch.tensor(mine) - want).abs().max().item() < 1e-4
