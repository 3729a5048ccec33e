"""A trained VL checkpoint through ``launch.export_hf``, then transformers' logits on one image
against ours (the exported folder read back by its family, ``models.registry.family_of_hf``).
Shared by the VL families' training tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def export_matches_transformers(checkpoints: Path, out: Path, hf_class: str, **options) -> None:
    """Export ``checkpoints`` to ``out``; transformers loads it as ``hf_class`` (``options``:
    ``from_pretrained``'s) and its logits on a 4 x 6 image between text equal ours within
    1e-4."""
    import transformers

    from models.registry import family_of_hf
    from parallel.state import ParallelState

    proc = subprocess.run([sys.executable, "-m", "launch.export_hf", "--checkpoint",
                           str(checkpoints), "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(out, **options).eval()
    assert type(hf).__name__ == hf_class, type(hf).__name__
    family, state = family_of_hf(out), ParallelState()
    ours, cfg = family.load_hf(out, state)
    ids = torch.tensor([5, 7, cfg.vision_start_token_id, *[cfg.image_token_id] * 6,
                        cfg.vision_end_token_id, 9, 11, 13])
    pixels = torch.randn(24, cfg.vision.patch_dim, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[1, 4, 6]])
    _, inputs = family.local_inputs(state, ids, torch.tensor([0, ids.numel()]), cfg,
                                    pixel_values=pixels, image_grid_thw=grid)
    with torch.no_grad():
        mine = ours(**inputs, output="logits")[:, :cfg.text.vocab_size]
        theirs = hf(input_ids=ids[None], pixel_values=pixels, image_grid_thw=grid,
                    mm_token_type_ids=(ids == cfg.image_token_id).long()[None]).logits[0]
    assert float((mine - theirs).abs().max()) <= 1e-4
