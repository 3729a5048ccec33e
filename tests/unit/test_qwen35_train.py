"""The Qwen3.5 family through the training path (mpcore asks the registry): a tiny hybrid
model trains from the YAML model section (``model.family=qwen3_5``), resumes bit-identically,
and its checkpoint exports to a folder that transformers loads with the same log-probs;
the shipped ``qwen35_tiny.yaml`` resolves to a hybrid Qwen35Config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.launch.export_hf import main
from mpcore.models.common.hybrid.hf import load_hf
from mpcore.models.common.inputs import local_text_inputs
from mpcore.models.qwen3_5 import FAMILY, Qwen35Config
from mpcore.parallel.state import ParallelState
from mpcore.train import train

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


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
        "data.grad_accum=2", "optimizer.lr=1e-2", "schedule.warmup_steps=2",
        f"training.max_steps={STEPS}", f"schedule.total_steps={STEPS}", "training.device=cpu",
        f"logging.run_dir={tmp}/run", "logging.log_every=100", "checkpoint.every=3",
        *overrides])


@pytest.mark.slow
def test_trains_resumes_bit_identically_and_exports(tmp_path, data_dir):
    straight = train(_cfg(tmp_path / "a", data_dir)).losses
    assert straight[-1] < straight[0] - 0.1
    first = train(_cfg(tmp_path / "b", data_dir, "training.max_steps=3"))
    second = train(_cfg(tmp_path / "b", data_dir))
    assert first.losses + second.losses == straight  # exact: weights, optimizer, RNG, data
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tmp_path / "b", data_dir)
    assert main(["--checkpoint", str(cfg.checkpoint_dir / f"step-{STEPS}"),
                 "--output", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_hf(tmp_path / "hf", ParallelState())
    ids = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(0))
    _, inputs = local_text_inputs(ParallelState(), ids, torch.tensor([0, 50]))
    with torch.no_grad():
        logprobs, _ = ours(**inputs, output="logprobs")
        ref = torch.log_softmax(hf(ids[None]).logits[0], -1)[:-1].gather(1, ids[1:, None])
    assert (logprobs[:-1] - ref[:, 0]).abs().max() < 1e-4


def test_shipped_tiny_yaml_is_a_hybrid_qwen35():
    cfg = load_config(REPO / "launch" / "configs" / "qwen35_tiny.yaml")
    model_cfg = FAMILY.config_from_section(cfg.model, None)
    assert isinstance(model_cfg, Qwen35Config)
    assert model_cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (model_cfg.linear_num_key_heads, model_cfg.linear_num_value_heads) == (2, 4)
    with pytest.raises(ValueError, match="model.qkv_bias is set"):
        FAMILY.config_from_section(load_config(None, ["model.family=qwen3_5",
                                                      "model.qkv_bias=true"]).model, None)


def test_start_up_block_names_the_deltanet_kernel(tmp_path, data_dir, caplog):
    """pretrain's start-up block says which Gated DeltaNet kernel runs and why, once."""
    caplog.set_level("INFO", logger="mpcore.train")
    train(_cfg(tmp_path, data_dir, "training.max_steps=1", "schedule.total_steps=1"))
    lines = [r.getMessage() for r in caplog.records if "Gated DeltaNet kernel" in r.getMessage()]
    assert len(lines) == 1
    assert ("Gated DeltaNet kernel: reference (PyTorch chunked, fp32 math); gdn_kernel=auto on "
            "cpu: fla-core's kernels are CUDA-only") in lines[0]
