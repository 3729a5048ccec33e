"""Qwen3.5-MoE multi-token prediction through the training path (one process, CPU): a release
with ``mtp.*`` (the MTP layer's MLP a MoE block) trains with ``model.mtp_loss_weight``, logs
``mtp_loss`` and the aux loss, resumes bit-identically (the MTP experts and router too), and
exports the release's tensor names with the MTP layer trained."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.launch.export_hf import main
from mpcore.train import train
from tests.dist.qwen35_moe_mtp_tiny import make_checkpoint

WEIGHT = 0.5


def _cfg(tmp, data_dir, folder, *overrides):
    return load_config(None, [
        "model.family=qwen3_5_moe", f"model.init_from={folder}",
        f"model.mtp_loss_weight={WEIGHT}", f"data.cache_dir={data_dir}",
        "data.default_vocab_size=512", "data.seq_len=64", "data.micro_batch=2",
        "data.grad_accum=2", "optimizer.lr=1e-2", "schedule.warmup_steps=1",
        "training.max_steps=4", "schedule.total_steps=4", "training.device=cpu",
        "model.gdn_kernel=reference", f"logging.run_dir={tmp}/run", "logging.log_every=1",
        "checkpoint.every=2", *overrides])


def _metrics(tmp) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().split("\n")
            if line.strip()]


@pytest.mark.slow  # three short MoE runs with gradient accumulation (counting passes)
def test_moe_release_with_mtp_trains_resumes_and_exports(tmp_path):
    data_dir = tmp_path / "data"
    prepare_default(data_dir, 512)
    folder = tmp_path / "release"
    make_checkpoint(folder, vocab_size=512)
    straight = train(_cfg(tmp_path / "a", data_dir, folder)).losses
    rows = _metrics(tmp_path / "a")
    assert len(straight) == 4 and all(r["mtp_loss"] > 0 and r["aux_loss"] > 0 for r in rows)
    first = train(_cfg(tmp_path / "b", data_dir, folder, "training.max_steps=2"))
    second = train(_cfg(tmp_path / "b", data_dir, folder))
    assert first.losses + second.losses == straight  # weights (mtp.* too), optimizer, data
    resumed = {r["step"]: (r["mtp_loss"], r["aux_loss"]) for r in _metrics(tmp_path / "b")}
    assert resumed == {r["step"]: (r["mtp_loss"], r["aux_loss"]) for r in rows}
    cfg = _cfg(tmp_path / "a", data_dir, folder)
    assert main(["--checkpoint", str(cfg.checkpoint_dir / "step-4"),
                 "--output", str(tmp_path / "hf")]) == 0
    exported, original = (load_file(tmp_path / "hf" / "model.safetensors"),
                          load_file(folder / "model.safetensors"))
    assert set(exported) == set(original)
    for name in ("mtp.fc.weight", "mtp.layers.0.mlp.gate.weight",
                 "mtp.layers.0.mlp.shared_expert.down_proj.weight"):
        assert not (exported[name] == original[name]).all(), name  # trained
