"""Qwen35VLModel vs transformers' Qwen3_5ForConditionalGeneration, one process (CPU, fp32 vs
float64).

The packed stream of ``hf_qwen3_vl_tiny`` (images of different grids, a 3-frame video,
text-only documents of odd lengths) on ``hf_qwen35_vl_tiny``'s hybrid model: per-token
log-probs and entropy within 1e-4 of transformers run per document, the mean loss and the
gradient of every parameter (tower, DeltaNet and gated attention) within 1e-4 rel, tied and
untied; M-RoPE is checked to matter (1-D positions move the log-probs); export -> transformers
loads the same function and our loader reads back the same tensors; ``mtp.*`` tensors are
skipped with one log line; parameter counts equal transformers'; bad configs and a checkpoint
given to the wrong family raise ``ValueError`` naming the fix.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mpcore.models.qwen3_5_vl import (
    FAMILY,
    build_model,
    config_from_dict,
    config_from_hf,
    export_hf,
    load_hf_model,
    num_params,
)
from mpcore.models.registry import family_named, family_of, family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.hf_qwen3_vl_tiny import load, reference_scores, stream
from tests.dist.hf_qwen35_vl_tiny import TEXT, save_hf_model
from tests.dist.test_qwen3_vl_model import (
    export_matches_transformers,
    matches_transformers,
    vision_kwargs,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35_vl")
    save_hf_model(seed=0, folder=folder)
    return folder


@pytest.mark.parametrize("tie", [False, True])
def test_matches_transformers(tie, tmp_path):
    save_hf_model(seed=0, folder=tmp_path, tie=tie)
    cfg, _, ref_grads = matches_transformers(tmp_path, load_hf_model)
    assert family_of(cfg) is FAMILY and family_of_hf(tmp_path) is FAMILY
    for part in ("model.visual.", "linear_attn.", "self_attn."):
        assert any(part in n and float(ref_grads[n].abs().max()) > 0 for n in ref_grads), part


def test_mrope_rows_matter(checkpoint):
    """The comparison above fails when every position row is the text row (plain RoPE)."""
    s = stream(seed=1)
    ref_lp, _ = reference_scores(checkpoint, s)
    model, cfg = load_hf_model(checkpoint, ParallelState())
    _, inputs = FAMILY.local_inputs(ParallelState(), s["input_ids"], s["cu_seqlens"], cfg,
                                    **vision_kwargs(s))
    text_rows = inputs["position_ids"][:1].expand(3, -1).contiguous()
    with torch.no_grad():
        logprobs, _ = model(**{**inputs, "position_ids": text_rows}, output="logprobs")
    assert float((logprobs.double() - ref_lp).abs().max()) > 1e-3


def test_export_round_trip(checkpoint, tmp_path):
    state = ParallelState()
    cfg = config_from_hf(checkpoint)
    _, again_cfg = export_matches_transformers(cfg, tmp_path / "out",
                                               transformers.Qwen3_5ForConditionalGeneration)
    assert again_cfg == cfg and config_from_dict(dataclasses.asdict(cfg)) == cfg
    # A loaded checkpoint exports to the same tensors, key for key.
    loaded, _ = load_hf_model(checkpoint, state)
    export_hf(loaded, state, tmp_path / "back")
    original = load_file(checkpoint / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_mtp_tensors_skipped_with_one_log_line(checkpoint, tmp_path, caplog):
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    original = load_file(checkpoint / "model.safetensors")
    save_file({**original, "mtp.fc.weight": torch.zeros(4, 4),
               "mtp.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)},
              tmp_path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="mpcore.models.common.hybrid.hf"):
        model, _ = load_hf_model(tmp_path, ParallelState())
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "2 tensors" in lines[0] and "mtp.*: 2" in lines[0], lines
    plain, _ = load_hf_model(checkpoint, ParallelState())
    for (n, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_counts_equal_transformers(checkpoint):
    cfg = config_from_hf(checkpoint)
    hf = load(checkpoint, torch.float32)
    counts = num_params(cfg)
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    assert counts["vision"] == sum(p.numel() for p in hf.model.visual.parameters())
    model = build_model(cfg, ParallelState())
    assert counts["total"] == sum(p.numel() for p in model.parameters())


def _config(checkpoint) -> dict:
    return json.loads((checkpoint / "config.json").read_text())


def test_a_checkpoint_of_another_family_and_bad_configs_raise(checkpoint):
    with pytest.raises(ValueError, match="is not Qwen3-VL"):
        family_named("qwen3_vl").load_hf(checkpoint, ParallelState())
    qwen3_vl = {**_config(checkpoint), "architectures": ["Qwen3VLForConditionalGeneration"]}
    with pytest.raises(ValueError, match="is not Qwen3.5 vision-language"):
        config_from_hf(qwen3_vl)
    with pytest.raises(ValueError, match="is not Qwen3.5 vision-language"):
        config_from_hf({**TEXT, "architectures": ["Qwen3_5ForCausalLM"]})
    hf = _config(checkpoint)
    rope = hf["text_config"]["rope_parameters"]
    bad = {**hf, "text_config": {**hf["text_config"],
                                 "rope_parameters": {**rope, "mrope_section": [2, 2, 3]}}}
    with pytest.raises(ValueError, match=r"mrope_section \[2, 2, 3\] sums to 7 but rotary_dim "
                                         r"12 rotates 6 frequency pairs"):
        config_from_hf(bad)
    flat = {**hf, "text_config": {**hf["text_config"],
                                  "rope_parameters": {**rope, "mrope_interleaved": False}}}
    with pytest.raises(ValueError, match="Qwen3.5's M-RoPE is interleaved"):
        config_from_hf(flat)
    deep = {**hf, "vision_config": {**hf["vision_config"], "deepstack_visual_indexes": [0]}}
    with pytest.raises(ValueError, match="the Qwen3.5 tower has no DeepStack"):
        config_from_hf(deep)
    cfg = config_from_hf(hf)
    with pytest.raises(ValueError, match="linear_num_key_heads 4 is not divisible by tp x cp"):
        cfg.check_parallel(2, 4, "ring")
    with pytest.raises(ValueError, match="Qwen3.5 tower has no DeepStack mergers"):
        dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision,
                                                            deepstack_visual_indexes=(0,)))


def test_the_text_family_keeps_causal_lm_and_reads_the_decoder(checkpoint):
    """``Qwen3_5ForConditionalGeneration`` belongs to this family; the text family keeps
    ``Qwen3_5ForCausalLM`` (and, called directly, still reads the decoder of a VL folder)."""
    assert family_of_hf({"architectures": ["Qwen3_5ForConditionalGeneration"]}) is FAMILY
    text = family_named("qwen3_5")
    assert family_of_hf({"architectures": ["Qwen3_5ForCausalLM"]}) is text
    decoder = text.config_from_hf(checkpoint)
    assert decoder.mrope_section is None and decoder.num_layers == TEXT["num_hidden_layers"]
