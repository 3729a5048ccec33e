"""Launch-path checks that every vision-language family runs the same way, parametrised by the
family: a launch YAML made tiny (``TinyRun``), tp = 1 vs other layouts step for step
(``layouts_agree``), the export that transformers loads with our outputs on an image
(``export_matches_transformers``); score.py with images vs transformers is every family's in
tests/dist/test_family_suite.py. Images are ``[patches, patch_dim]`` pixel rows with a grid
``(t, h, w)`` in patches, merged 2 x 2 into ``t * h * w / 4`` placeholder tokens. transformers is
imported inside the functions: spawned ranks import this module and should not pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mpcore.config import load_config
from mpcore.data import prepare_vl_default
from mpcore.launch.export_hf import main as export_main
from mpcore.train import train
from tests.dist.harness import run_distributed


@dataclass(frozen=True)
class TinyRun:
    """A launch YAML made tiny: the family's ``model`` overrides plus the shared CPU run."""

    config: str  # launch/configs/<family>_tiny.yaml
    model: tuple[str, ...]  # the family's model.* overrides
    steps: int
    log_every: int = 100
    checkpoint_every: int | None = None  # None: one checkpoint, at the last step

    def __call__(self, tmp, run: str, *overrides: str):
        every = self.steps if self.checkpoint_every is None else self.checkpoint_every
        return load_config(self.config, [
            *self.model, f"data.cache_dir={tmp}/data", "data.default_vocab_size=512",
            "data.micro_batch=2", "data.grad_accum=1", "optimizer.lr=1e-2",
            "schedule.warmup_steps=2", f"training.max_steps={self.steps}", "training.device=cpu",
            f"logging.run_dir={tmp}/{run}", f"logging.log_every={self.log_every}",
            f"checkpoint.every={every}", *overrides])


def _train_layouts(rank, world, tiny: TinyRun, tmp, layouts):
    del rank, world
    return {name: train(tiny(tmp, name, *extra)).losses for name, extra in layouts}


def layouts_agree(tiny: TinyRun, tmp: Path, layouts, *, timeout: float) -> list[float]:
    """Train ``ref`` in one process and each ``(name, overrides)`` of ``layouts`` on 2 (gloo)
    on the shipped image set; every layout's loss within 1e-4 of ``ref`` at every step. Returns
    ``ref``'s losses (``steps`` finite values) for the caller's own checks."""
    prepare_vl_default(tmp / "data", 512)
    ref = train(tiny(tmp, "ref")).losses
    assert len(ref) == tiny.steps and all(torch.isfinite(torch.tensor(ref)))
    for rank_losses in run_distributed(_train_layouts, 2, tiny, str(tmp), layouts,
                                       timeout=timeout):
        for name, losses in rank_losses.items():
            diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
            assert diff <= 1e-4, (name, losses, ref)
    return ref


def export_matches_transformers(tmp: Path, checkpoints: Path, family, hf_class: str,
                                markers: tuple[str, str], grid: tuple[int, int, int],
                                tail: tuple[int, ...], **hf_kwargs) -> None:
    """``launch/export_hf``'s main on ``checkpoints`` writes a folder that transformers loads
    (``AutoModelForImageTextToText`` gives ``hf_class``) with our logits within 1e-4 on one
    image of ``grid`` between the config's ``markers`` (start / end token id fields), text
    ``tail`` after it."""
    import transformers

    from mpcore.parallel.state import ParallelState

    out = tmp / "hf"
    # The command's main in this process (test_vl_train runs it as a command): a subprocess
    # would spend ~3 s importing torch and the project again.
    assert export_main(["--checkpoint", str(checkpoints), "--output", str(out)]) == 0
    hf = transformers.AutoModelForImageTextToText.from_pretrained(out, **hf_kwargs).eval()
    assert isinstance(hf, getattr(transformers, hf_class)), type(hf)
    state = ParallelState.build()
    ours, cfg = family.load_hf(out, state)
    patches = grid[0] * grid[1] * grid[2]
    ids = torch.tensor([5, 7, getattr(cfg, markers[0]), *[cfg.image_token_id] * (patches // 4),
                        getattr(cfg, markers[1]), *tail])
    pixels = torch.randn(patches, cfg.vision.patch_dim,
                         generator=torch.Generator().manual_seed(0))
    grid_thw = torch.tensor([grid])
    _, inputs = family.local_inputs(state, ids, torch.tensor([0, ids.numel()]), cfg,
                                    pixel_values=pixels, image_grid_thw=grid_thw)
    with torch.no_grad():
        mine = ours(**inputs, output="logits")[:, :cfg.text.vocab_size]
        theirs = hf(input_ids=ids[None], pixel_values=pixels, image_grid_thw=grid_thw,
                    mm_token_type_ids=(ids == cfg.image_token_id).long()[None]).logits[0]
    assert float((mine - theirs).abs().max()) <= 1e-4
