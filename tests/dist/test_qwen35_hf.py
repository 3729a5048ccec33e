"""The Qwen3.5 text family against transformers in one process (fp32, CPU): per-token
log-probs of a packed stream (documents of lengths 1, 2, 3, odd, and one longer than a
DeltaNet chunk) within 1e-4 of transformers run per document, loss and every gradient within
1e-4 rel; export -> transformers loads the same tensors; ``mtp.*`` keys skipped with one log
line; parameter counts equal transformers' (tiny, and the Qwen3.5-0.8B shape on meta); the
config and family errors."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mpcore.launch.score import score_stream
from mpcore.models.common.hf_io import gather_full
from mpcore.models.common.hybrid.hf import (
    config_from_hf,
    export_hf,
    hf_config_dict,
    load_hf,
    shard_map,
)
from mpcore.models.common.hybrid.model import make_model
from mpcore.models.common.inputs import local_text_inputs
from mpcore.models.qwen3_5 import Qwen35Config
from mpcore.models.qwen3_5.family import FAMILY, config_from_dict
from mpcore.models.registry import family_of, family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.qwen35_tiny import (
    HF_CONFIG,
    check_per_document,
    conditional_generation,
    make_hf_model,
    packed_docs,
    reference,
)

LENGTHS = [5, 1, 70, 2, 3, 13]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35")
    make_hf_model(seed=5).save_pretrained(folder)
    ids, cu = packed_docs(LENGTHS, seed=2)
    return folder, ids, cu, reference(folder, ids, cu)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _hf_grads(model, cfg):
    """Our gradients as HF tensors (``gather_full`` runs the tp=1 shard map backwards)."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    return gather_full(grads, [shard_map(cfg, 1, 0)], None)


def test_logprobs_loss_and_grads_match_transformers(checkpoint):
    folder, ids, cu, ref = checkpoint
    state = ParallelState()
    model, cfg = load_hf(folder, state, gdn_kernel="reference")
    assert family_of(cfg) is FAMILY and family_of_hf(folder) is FAMILY
    logprobs, _ = score_stream(model, state, ids, cu)
    assert float((logprobs.double() - ref["logprobs"]).abs().max()) < 1e-4
    _, inputs = local_text_inputs(state, ids, cu)
    count = int(cu[-1]) - (cu.numel() - 1)
    loss = model(**inputs, output="loss").sum() / count
    loss.backward()
    assert abs(float(loss.detach()) - ref["loss"]) / ref["loss"] < 1e-4
    grads = _hf_grads(model, cfg)
    assert set(grads) == set(ref["grads"])
    worst = {n: _rel(g, ref["grads"][n]) for n, g in grads.items()}
    assert max(worst.values()) < 1e-4, max(worst, key=worst.get)


def test_export_round_trip_and_mtp_keys_skipped(checkpoint, tmp_path, caplog):
    folder, *_ = checkpoint
    state = ParallelState()
    model, cfg = load_hf(folder, state)
    export_hf(model, state, tmp_path / "out")
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    original = load_file(folder / "model.safetensors")
    assert set(back) == set(original)
    for name, t in original.items():
        assert torch.equal(back[name], t), name
    # A released checkpoint carries multi-token-prediction weights the decoder does not use.
    with_mtp = tmp_path / "mtp"
    with_mtp.mkdir()
    (with_mtp / "config.json").write_text((folder / "config.json").read_text())
    save_file({**original, "mtp.fc.weight": torch.zeros(4, 4),
               "mtp.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)},
              with_mtp / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="mpcore.models.common.hybrid.hf"):
        again, _ = load_hf(with_mtp, state)
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "2 tensors" in lines[0] and "mtp.*: 2" in lines[0]
    for (n, a), b in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), n
    assert config_from_dict(dataclasses.asdict(cfg)) == cfg


def test_parameter_counts_equal_transformers():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf = make_hf_model(seed=0)
    cfg = config_from_hf(hf.config.to_dict() | {"architectures": ["Qwen3_5ForCausalLM"]})
    assert FAMILY.num_params(cfg)["total"] == sum(p.numel() for p in hf.parameters())
    # Qwen3.5-0.8B's text decoder (the shape of its config.json's text_config), on meta.
    released = json.loads((Path(__file__).parent / "qwen35_0p8b_config.json").read_text())
    cfg = config_from_hf(released)
    text = {k: v for k, v in released["text_config"].items()
            if k not in ("attn_output_gate", "mtp_num_hidden_layers")}
    with torch.device("meta"):
        hf_model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
        ours = make_model(cfg, ParallelState())
    hf_count = sum(p.numel() for p in hf_model.parameters())  # tied: no separate lm_head
    assert FAMILY.num_params(cfg)["total"] == hf_count == sum(p.numel() for p in ours.parameters())
    assert 0.7e9 < hf_count < 0.8e9


def test_config_errors():
    base = HF_CONFIG | {"architectures": ["Qwen3_5ForCausalLM"]}
    with pytest.raises(ValueError, match="layer_types must list 4 entries"):
        config_from_hf(base | {"layer_types": ["full_attention"] * 3})
    with pytest.raises(ValueError, match="not a Qwen3.5 checkpoint"):
        config_from_hf(base | {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="linear_num_key_heads 2 is not divisible by tp x cp = 2 x 4 = 8"):
        config_from_hf(base).check_parallel(2, 4, "ring")
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        config_from_hf(base | {"linear_num_value_heads": 3})
    from mpcore.models.common.hf_config import config_from_hf as llama_config

    with pytest.raises(ValueError, match="unsupported architecture"):
        llama_config(base)
    cfg = Qwen35Config(vocab_size=11, hidden_size=16, num_layers=5, num_heads=2,
                       num_kv_heads=1, intermediate_size=8)
    assert cfg.layer_types.count("full_attention") == 1 and cfg.layer_types[3] == "full_attention"
    assert hf_config_dict(cfg)["layer_types"] == list(cfg.layer_types)


def test_checkpoint_that_disagrees_with_its_config_and_kernel_errors(checkpoint, tmp_path):
    folder, *_ = checkpoint
    for key, value in (("linear_conv_kernel_dim", 3), ("linear_num_value_heads", 8)):
        bad = tmp_path / key
        bad.mkdir()
        hf = json.loads((folder / "config.json").read_text()) | {key: value}
        (bad / "config.json").write_text(json.dumps(hf))
        (bad / "model.safetensors").symlink_to(folder / "model.safetensors")
        with pytest.raises(ValueError, match="has shape .* in the checkpoint but the config"):
            load_hf(bad, ParallelState())
    with pytest.raises(ValueError, match="gdn_kernel='fla' needs a CUDA device"):
        load_hf(folder, ParallelState(), gdn_kernel="fla")
    with pytest.raises(ValueError, match="gdn_kernel must be one of"):
        load_hf(folder, ParallelState(), gdn_kernel="triton")


def test_released_layout_conditional_generation_text_decoder(tmp_path, caplog):
    """A ``Qwen3_5ForConditionalGeneration`` folder (the released checkpoints' form: nested
    ``text_config``, ``model.language_model.*`` keys, a tower) belongs to the VL family in the
    registry; this family's loader, called directly, reads its text decoder, skips the tower
    with one log line, and scores text as transformers' VL model."""
    hf = conditional_generation(HF_CONFIG, "Qwen3_5")
    hf.save_pretrained(tmp_path)
    assert family_of_hf(tmp_path).name == "qwen3_5_vl"
    with caplog.at_level(logging.INFO, logger="mpcore.models.common.hybrid.hf"):
        model, _ = load_hf(tmp_path, ParallelState())
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "model.visual.*" in lines[0], lines
    ids, cu = packed_docs([9, 4, 30], seed=3)
    logprobs, _ = score_stream(model, ParallelState(), ids, cu)
    check_per_document(hf, logprobs, ids, cu)
