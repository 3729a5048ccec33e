"""A save that runs out of space on one of 2 gloo ranks fails on both, with the same message,
instead of one rank raising while the other waits at a barrier; the partial save is gone and
the previous checkpoint still verifies and loads on both ranks. A real tmpfs (root only)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from mpcore.checkpoint import (
    CheckpointError,
    load_tensors,
    resume_newest,
    save_checkpoint,
    stored_tensors,
)
from tests.dist.harness import run_distributed


def _fill_up(rank, world, root):
    # Rank 1 owns the big tensor: the disk fills while rank 1 writes its own file.
    save_checkpoint(root, 1, {f"x{rank}": torch.randn(1000)}, {"step": 1}, keep_last=2, rank=rank)
    big = torch.randn(400_000 if rank == 1 else 1000)  # 1.6 MB on rank 1
    try:
        save_checkpoint(root, 2, {f"x{rank}": big}, {"step": 2}, keep_last=2, rank=rank)
        error = None
    except CheckpointError as e:
        error = str(e)

    def load(folder, meta):
        stored = stored_tensors(folder)
        load_tensors(folder, sorted(stored), stored)

    folder, meta = resume_newest(root, load, rank=rank, world=world)
    return error, folder.name, meta["step"]


def test_disk_full_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"mounting a small tmpfs needs root: {done.stderr.strip()}")
    try:
        by_rank = run_distributed(_fill_up, 2, str(mnt / "ckpt"), timeout=240)
        left = sorted(p.name for p in (mnt / "ckpt").iterdir())
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    assert by_rank[0] == by_rank[1], by_rank
    error, used, step = by_rank[0]
    assert error is not None and error.startswith(f"no space left on {mnt} (checkpoint.dir "
                                                  f"{mnt / 'ckpt'}) while saving step 2"), error
    assert f"the newest checkpoint, {mnt / 'ckpt' / 'step-1'}, is intact" in error
    assert (used, step) == ("step-1", 1)
    assert left == ["latest", "step-1"]  # no tmp-step-2
