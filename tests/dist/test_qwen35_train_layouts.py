"""Qwen3.5 training is the same function at every 2-rank layout: tp=2 (SP off/on), cp=2 (ring,
Ulysses; zigzag) and FSDP2 dp=2 vs tp=1, same seed and global batch, per-step losses within
1e-5 rel; a checkpoint saved at tp=2 resumes at tp=1 with the next-step loss of the straight
run (the logical layout of the DeltaNet tensors, several pieces of one HF tensor per rank).
The tiny hybrid model: 4 layers (3 Gated DeltaNet + 1 gated attention), 2 key / 4 value
DeltaNet heads, 4 query / 2 kv heads; one gloo spawn of 2 ranks, the tp=1 reference here.
"""

from __future__ import annotations

import math
import shutil

import pytest

from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.train import train
from tests.dist.harness import run_distributed

STEPS = 6
SAVE_AT = 3
LAYOUTS = {
    "tp2": ["parallel.tp=2", f"checkpoint.every={SAVE_AT}"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2_ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
    "dp2_fsdp": ["parallel.data_parallel=fsdp", "data.micro_batch=1"],
}


def tiny(tmp, run: str, *overrides: str):
    return load_config(None, [
        "model.family=qwen3_5", "model.vocab_size=515", "model.hidden_size=64",
        "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
        "model.intermediate_size=128", "model.tie_embeddings=false",
        f"data.cache_dir={tmp}/data", "data.default_vocab_size=512", "data.seq_len=64",
        "data.micro_batch=2", "data.grad_accum=2", "optimizer.lr=1e-2",
        "schedule.warmup_steps=2", f"training.max_steps={STEPS}",
        f"schedule.total_steps={STEPS}", "training.device=cpu", f"logging.run_dir={tmp}/{run}",
        "logging.log_every=100", "checkpoint.every=0", "checkpoint.keep_last=5", *overrides])


def _layouts(rank, world, tmp):
    return {name: train(tiny(tmp, name, *overrides)).losses
            for name, overrides in LAYOUTS.items()}


@pytest.mark.slow
def test_qwen35_every_layout_matches_tp1_and_tp2_checkpoint_resumes_at_tp1(tmp_path):
    prepare_default(tmp_path / "data", 512)
    ref = train(tiny(tmp_path, "ref")).losses
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.1, ref
    by_rank = run_distributed(_layouts, 2, str(tmp_path), timeout=600)
    for name in LAYOUTS:
        assert by_rank[0][name] == by_rank[1][name], name
        for step, (got, want) in enumerate(zip(by_rank[0][name], ref, strict=True)):
            assert math.isclose(got, want, rel_tol=1e-5), (name, step + 1, got, want)
    folder = tmp_path / "resume" / "checkpoints"
    shutil.copytree(tmp_path / "tp2" / "checkpoints" / f"step-{SAVE_AT}",
                    folder / f"step-{SAVE_AT}")
    result = train(tiny(tmp_path, "resume", f"training.max_steps={SAVE_AT + 1}"))
    assert result.step == SAVE_AT + 1 and len(result.losses) == 1
    assert math.isclose(result.losses[0], ref[SAVE_AT], rel_tol=1e-5), (result.losses, ref)
