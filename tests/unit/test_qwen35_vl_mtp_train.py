"""Qwen3.5 VL and VL-MoE multi-token prediction through the launch path (one process, CPU):
the tiny launch YAML (made smaller) with ``model.mtp_num_hidden_layers=1`` and
``model.mtp_loss_weight`` trains from scratch on the shipped image set, logs ``mtp_loss`` (and
the MoE's aux loss), resumes bit-identically (the MTP block and its optimizer state), exports
the release's ``mtp.*`` beside the tower and decoder; the export, loaded with its MTP block,
exports again byte for byte (nothing trained), and ``score.py --mtp`` on it gives the MTP head's
log-probs that the loaded model gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mpcore.config import load_config
from mpcore.data import prepare_vl_default
from mpcore.launch.export_hf import main as export_main
from mpcore.launch.score import main as score_main
from mpcore.launch.score import score_stream
from mpcore.models.qwen3_5_vl import FAMILY as VL
from mpcore.models.qwen3_5_vl_moe import FAMILY as VL_MOE
from mpcore.parallel.state import ParallelState
from mpcore.train import train

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"
WEIGHT = 0.3
SMALLER = ["model.vocab_size=516", "model.hidden_size=32", "model.intermediate_size=64",
           "model.vision.hidden_size=32", "model.vision.num_heads=2",
           "model.vision.intermediate_size=64", "data.default_vocab_size=512",
           "data.micro_batch=2", "data.grad_accum=1", "optimizer.lr=1e-2",
           "schedule.warmup_steps=1", "training.max_steps=4", "schedule.total_steps=4",
           "training.device=cpu", "logging.log_every=1", "checkpoint.every=2",
           "model.mtp_num_hidden_layers=1", f"model.mtp_loss_weight={WEIGHT}"]
MOE = ["model.moe.moe_intermediate_size=32", "model.moe.router_aux_loss_coef=0.5"]


def _cfg(tmp, run, moe, *overrides):
    name = "qwen35_vl_moe_tiny.yaml" if moe else "qwen35_vl_tiny.yaml"
    return load_config(str(CONFIGS / name), [
        *SMALLER, *(MOE if moe else []), f"data.cache_dir={tmp}/data",
        f"logging.run_dir={tmp}/{run}", *overrides])


def _metrics(tmp, run) -> list[dict]:
    path = Path(tmp) / run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slow  # three short VL runs and two exports: about a minute on 2 cores
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_vl_mtp_trains_resumes_exports_and_scores(tmp_path, moe):
    family = VL_MOE if moe else VL
    prepare_vl_default(tmp_path / "data", 512)
    straight = train(_cfg(tmp_path, "a", moe)).losses
    rows = _metrics(tmp_path, "a")
    assert len(straight) == 4 and all(r["mtp_loss"] > 0 for r in rows)
    assert all(r["aux_loss"] > 0 for r in rows) if moe else "aux_loss" not in rows[0]
    first = train(_cfg(tmp_path, "b", moe, "training.max_steps=2"))
    second = train(_cfg(tmp_path, "b", moe))
    assert first.losses + second.losses == straight
    assert [r["mtp_loss"] for r in _metrics(tmp_path, "b")] == [r["mtp_loss"] for r in rows]
    cfg = _cfg(tmp_path, "a", moe)
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(cfg.checkpoint_dir / "step-4"),
                        "--output", str(out)]) == 0
    tensors = load_file(out / "model.safetensors")
    assert "mtp.fc.weight" in tensors and any(k.startswith("model.visual.") for k in tensors)
    assert json.loads((out / "config.json").read_text())["text_config"][
        "mtp_num_hidden_layers"] == 1
    state = ParallelState()
    model, mcfg = family.load_hf(out, state, mtp_loss_weight=1.0)
    family.export_hf(model, state, tmp_path / "again")
    assert ((tmp_path / "again" / "model.safetensors").read_bytes()
            == (out / "model.safetensors").read_bytes())
    ids = torch.tensor([5, 9, 17, 3, 8, 11, 2, 40, 7])
    (tmp_path / "in.jsonl").write_text(json.dumps({"input_ids": ids.tolist()}) + "\n")
    assert score_main(["--hf-checkpoint", str(out), "--input", str(tmp_path / "in.jsonl"),
                       "--mtp", "--output", str(tmp_path / "mtp.jsonl")]) == 0
    got = json.loads((tmp_path / "mtp.jsonl").read_text())["logprobs"]
    want, _ = score_stream(model, state, ids, torch.tensor([0, ids.numel()]), mtp=True)
    assert mcfg.uses_mtp and len(got) == ids.numel() - 1
    assert torch.allclose(torch.tensor(got), want[:-1], rtol=0, atol=1e-5)
