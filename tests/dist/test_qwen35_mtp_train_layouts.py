"""Qwen3.5 training with multi-token prediction is the same function at 2-rank layouts: tp=2
with SP, cp=2 (ring, zigzag) and FSDP2 dp=2 vs one process, same seed and global batch: the
per-step loss (``main + w * mtp``) and the logged MTP loss within 1e-5 rel. Under dp and cp the
MTP mean is over the valid MTP targets of the whole step, so a per-rank mean or a shift after
the split shows here. The tiny model and data are ``test_qwen35_train_layouts``'s."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mpcore.data import prepare_default
from mpcore.train import train
from tests.dist.harness import run_distributed
from tests.dist.test_qwen35_train_layouts import STEPS, tiny

MTP = ["model.mtp_num_hidden_layers=1", "model.mtp_loss_weight=0.3", "logging.log_every=1"]
LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "dp2_fsdp": ["parallel.data_parallel=fsdp", "data.micro_batch=1"],
}


def _mtp_losses(tmp, run: str) -> list[float]:
    path = Path(tmp) / run / "metrics.jsonl"
    return [json.loads(line)["mtp_loss"] for line in path.read_text().splitlines()
            if line.strip()]


def _layouts(rank, world, tmp):
    out = {name: train(tiny(tmp, name, *MTP, *overrides)).losses
           for name, overrides in LAYOUTS.items()}
    return out, ({name: _mtp_losses(tmp, name) for name in LAYOUTS} if rank == 0 else None)


@pytest.mark.slow
def test_mtp_training_layouts_match_one_process(tmp_path):
    prepare_default(tmp_path / "data", 512)
    ref = train(tiny(tmp_path, "ref", *MTP)).losses
    ref_mtp = _mtp_losses(tmp_path, "ref")
    assert len(ref) == len(ref_mtp) == STEPS and ref[-1] < ref[0] - 0.1, ref
    by_rank = run_distributed(_layouts, 2, str(tmp_path), timeout=600)
    mtp = by_rank[0][1]
    for name in LAYOUTS:
        assert by_rank[0][0][name] == by_rank[1][0][name], name
        pairs = list(zip(by_rank[0][0][name], ref, strict=True)) + list(
            zip(mtp[name], ref_mtp, strict=True))
        for i, (got, want) in enumerate(pairs):
            assert math.isclose(got, want, rel_tol=1e-5), (name, i, got, want)
