"""Checkpoint verification across 2 gloo ranks: each rank hashes the files it wrote, the
manifest lists every rank's, verification splits the files over the ranks and every rank
reaches the same verdict (and falls back together); a refused run folder refuses on every rank,
and a run folder deleted while the run trains stops every rank before anything more is written."""

from __future__ import annotations

import json
import shutil

import pytest
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
from mpcore.data import prepare_default
from mpcore.rundir import claim_run_dir
from mpcore.train import RunHalted, train
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


def _train_then_delete_the_folder(rank, world, tmp, data):
    """Rank 0 deletes the run folder as step 3 starts (``rm -rf`` by a user)."""
    run_dir = f"{tmp}/run"
    cfg = load_config(None, [
        "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
        f"data.cache_dir={data}", "data.default_vocab_size=512", "data.seq_len=32",
        "data.micro_batch=1", "training.max_steps=8", "training.device=cpu",
        f"logging.run_dir={run_dir}", "logging.log_every=1", "checkpoint.every=2"])

    def hook(step):
        if rank == 0 and step == 3:
            shutil.rmtree(run_dir)

    try:
        train(cfg, step_hook=hook)
    except RunHalted as e:
        return str(e)
    return None


@pytest.mark.slow  # a 2-rank training run
def test_a_deleted_run_folder_stops_every_rank_before_any_write(tmp_path):
    """mpcore.rundir's deleted run folder: rank 0 holds the lock and finds its lock file
    gone at step 3's boundary; the ranks agree through the stop flag's all-reduce and both
    stop with rank 0's message before step 3's metrics row or step 4's save."""
    prepare_default(tmp_path / "data", 512)
    by_rank = run_distributed(_train_then_delete_the_folder, 2, str(tmp_path),
                              str(tmp_path / "data"), timeout=240)
    assert by_rank[0] == by_rank[1] and by_rank[0] is not None, by_rank
    assert by_rank[0].startswith(f"{tmp_path / 'run'} was deleted or replaced while this run "
                                 f"was using it"), by_rank[0]
    assert "This run stopped after step 3 and wrote nothing more" in by_rank[0]
    assert not (tmp_path / "run").exists()
