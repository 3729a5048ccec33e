"""Multi-token prediction through the training path (one process, CPU): ``model.mtp_loss_weight``
trains the MTP block beside a Qwen3.5 model, from a YAML section and from a release checkpoint
with ``mtp.*``; the step's loss is ``main + weight * mtp`` (each a global mean), the MTP loss is
logged on its own (``mtp_loss`` in metrics.jsonl), the main loss at the first step is that of
the run without MTP, and the export keeps the ``mtp.*`` tensors."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.launch.export_hf import main
from mpcore.train import train
from tests.dist.qwen35_mtp_tiny import make_checkpoint

WEIGHT = 0.5


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prepare_default(folder, 512)
    return folder


def _cfg(tmp, data_dir, *overrides):
    return load_config(None, [
        "model.family=qwen3_5", "model.vocab_size=512", "model.hidden_size=64",
        "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
        "model.intermediate_size=128", f"data.cache_dir={data_dir}",
        "data.default_vocab_size=512", "data.seq_len=64", "data.micro_batch=2",
        "data.grad_accum=2", "optimizer.lr=1e-2", "schedule.warmup_steps=1",
        "training.max_steps=2", "schedule.total_steps=2", "training.device=cpu",
        "model.gdn_kernel=reference", f"logging.run_dir={tmp}/run", "logging.log_every=1",
        "checkpoint.every=100", *overrides])


def _metrics(tmp) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().split("\n")
            if line.strip()]


def test_mtp_weight_adds_the_mtp_loss_and_logs_it(tmp_path, data_dir):
    plain = train(_cfg(tmp_path / "a", data_dir)).losses
    with_mtp = train(_cfg(tmp_path / "b", data_dir, "model.mtp_num_hidden_layers=1",
                          f"model.mtp_loss_weight={WEIGHT}")).losses
    rows = _metrics(tmp_path / "b")
    assert [r["step"] for r in rows] == [1, 2] and all(r["mtp_loss"] > 1.0 for r in rows)
    assert "mtp_loss" not in _metrics(tmp_path / "a")[0]
    # step 1: same weights for the decoder (initialised by name), so main is the plain loss
    assert abs(with_mtp[0] - WEIGHT * rows[0]["mtp_loss"] - plain[0]) <= 1e-5
    with pytest.raises(ValueError, match="needs an MTP layer but this model has none"):
        train(_cfg(tmp_path / "c", data_dir, f"model.mtp_loss_weight={WEIGHT}"))


def test_release_with_mtp_trains_and_exports_it(tmp_path, data_dir):
    folder = tmp_path / "release"
    make_checkpoint(folder, vocab_size=512)
    cfg = _cfg(tmp_path / "r", data_dir, f"model.init_from={folder}",
               f"model.mtp_loss_weight={WEIGHT}", "checkpoint.every=2")
    result = train(cfg)
    assert len(result.losses) == 2 and all(r["mtp_loss"] > 0 for r in _metrics(tmp_path / "r"))
    assert main(["--checkpoint", str(cfg.checkpoint_dir / "step-2"),
                 "--output", str(tmp_path / "hf")]) == 0
    exported, original = (load_file(tmp_path / "hf" / "model.safetensors"),
                          load_file(folder / "model.safetensors"))
    assert set(exported) == set(original)
    assert not (exported["mtp.fc.weight"] == original["mtp.fc.weight"]).all()  # trained


def test_mtp_run_resumes_bit_identically(tmp_path, data_dir):
    keys = ("model.mtp_num_hidden_layers=1", f"model.mtp_loss_weight={WEIGHT}",
            "training.max_steps=4", "schedule.total_steps=4", "checkpoint.every=2")
    straight = train(_cfg(tmp_path / "a", data_dir, *keys)).losses
    first = train(_cfg(tmp_path / "b", data_dir, *keys, "training.max_steps=2"))
    second = train(_cfg(tmp_path / "b", data_dir, *keys))
    assert first.losses + second.losses == straight  # weights (mtp.* too), optimizer, data
    rows = {r["step"]: r["mtp_loss"] for r in _metrics(tmp_path / "b")}
    assert rows == {r["step"]: r["mtp_loss"] for r in _metrics(tmp_path / "a")}
