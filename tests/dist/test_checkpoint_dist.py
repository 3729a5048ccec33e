"""Checkpoint verification across 2 gloo ranks: each rank hashes the files it wrote, the
manifest lists every rank's, verification splits the files over the ranks and every rank
reaches the same verdict (and falls back together); a refused run folder refuses on every rank."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from mpcore.checkpoint import (
    CheckpointError,
    load_tensors,
    resume_newest,
    save_checkpoint,
    stored_tensors,
    verify_checkpoint,
)
from mpcore.config import load_config
from mpcore.rundir import claim_run_dir
from tests.dist.harness import run_distributed


def _save_damage_resume(rank, world, tmp):
    root = f"{tmp}/ckpt"
    for step in (1, 2):
        # Every rank owns one key, so every rank writes a .distcp file of its own.
        torch.manual_seed(step * 10 + rank)
        save_checkpoint(root, step, {f"x{rank}": torch.randn(64)}, {"step": step},
                        keep_last=2, rank=rank)
    files = json.loads(open(f"{root}/step-2/manifest.json").read())["files"]
    clean = verify_checkpoint(f"{root}/step-2", rank, world)
    if rank == 0:
        with open(f"{root}/step-2/__1_0.distcp", "r+b") as f:  # rank 1's file
            f.seek(8)
            f.write(b"\0\1\2\3")
    dist.barrier()
    damaged = verify_checkpoint(f"{root}/step-2", rank, world)

    def load(folder, meta):
        stored = stored_tensors(folder)
        load_tensors(folder, sorted(stored), stored)

    folder, meta = resume_newest(root, load, rank=rank, world=world)
    dist.barrier()
    claimed = None
    cfg = load_config(None, [f"logging.run_dir={tmp}/run", "checkpoint.resume=false"])
    if rank == 0:  # a folder with an earlier run's checkpoints
        (cfg.checkpoint_dir / "step-1").mkdir(parents=True)
    dist.barrier()
    try:
        claim_run_dir(cfg, rank)
    except ValueError as e:
        claimed = str(e)
    return sorted(files), clean, damaged, folder.name, meta["step"], claimed


def test_verification_and_fallback_agree_on_every_rank(tmp_path):
    by_rank = run_distributed(_save_damage_resume, 2, str(tmp_path), timeout=240)
    assert by_rank[0] == by_rank[1]
    files, clean, damaged, used, step, claimed = by_rank[0]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
    assert clean == []
    assert len(damaged) == 1 and "__1_0.distcp does not match its sha256" in damaged[0]
    assert (used, step) == ("step-1", 1)  # the damaged step-2 was skipped on both ranks
    assert (tmp_path / "ckpt" / "bad-step-2").is_dir()
    assert "checkpoint.resume=false but" in claimed


def _all_bad(rank, world, tmp):
    try:
        resume_newest(f"{tmp}/ckpt", lambda folder, meta: None, rank=rank, world=world)
    except CheckpointError as e:
        return str(e)
    return None


def test_no_usable_checkpoint_raises_on_every_rank(tmp_path):
    (tmp_path / "ckpt" / "step-3").mkdir(parents=True)
    messages = run_distributed(_all_bad, 2, str(tmp_path), timeout=240)
    assert messages[0] == messages[1] and "step-3: no manifest.json" in messages[0]
