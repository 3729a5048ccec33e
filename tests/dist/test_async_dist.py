"""``checkpoint.async_save`` over 2 gloo ranks (FSDP2 dp=2 and tp=2): background saves give the
same losses as blocking ones, every checkpoint they leave verifies, and resuming from one
written in the background continues the blocking run's curve bit for bit."""

from __future__ import annotations

import shutil

import pytest
import torch.distributed as dist

from mpcore.checkpoint import verify_checkpoint
from mpcore.data import prepare_default
from mpcore.train import train
from tests.dist.harness import run_distributed
from tests.dist.test_train_layouts import tiny

pytestmark = pytest.mark.slow
LAYOUTS = {"dp2_fsdp": ["data.micro_batch=1"], "tp2": ["parallel.tp=2"]}


def _async_vs_blocking(rank, world, tmp):
    out = {}
    for name, layout in LAYOUTS.items():
        saves = ["checkpoint.every=2", "checkpoint.keep_last=2", "training.max_steps=6",
                 "schedule.total_steps=8"]
        blocking = train(tiny(tmp, f"{name}_blocking", *layout, *saves)).losses
        background = train(tiny(tmp, f"{name}_async", *layout, *saves,
                                "checkpoint.async_save=true")).losses
        root = f"{tmp}/{name}_async/checkpoints"
        problems = [p for step in (4, 6) for p in verify_checkpoint(f"{root}/step-{step}", rank,
                                                                      world)]
        dist.barrier()
        if rank == 0:
            shutil.rmtree(f"{root}/step-6")  # resume from step-4, written in the background
        dist.barrier()
        resumed = train(tiny(tmp, f"{name}_async", *layout, *saves,
                             "checkpoint.async_save=true", "training.max_steps=8")).losses
        reference = train(tiny(tmp, f"{name}_blocking", *layout, *saves,
                               "training.max_steps=8")).losses
        out[name] = (blocking, background, problems, resumed, reference)
    return out


def test_async_saves_match_blocking_ones_on_two_ranks(tmp_path):
    prepare_default(tmp_path / "data", 512)
    by_rank = run_distributed(_async_vs_blocking, 2, str(tmp_path), timeout=600)
    for name in LAYOUTS:
        blocking, background, problems, resumed, reference = by_rank[0][name]
        assert background == blocking, name
        assert problems == [], (name, problems)
        assert len(resumed) == 4 and len(reference) == 2, name
        assert resumed[2:] == reference, name  # steps 7-8 of both, exactly
        assert resumed[:2] == blocking[4:6], name  # steps 5-6 replayed from step-4
