"""Qwen3.5-MoE in one process vs transformers' Qwen3_5MoeForCausalLM (fp32 vs float64, CPU).

- per-token log-probs of a packed stream (documents of 1, 2, odd lengths and one longer than
  a DeltaNet chunk) within 1e-4 of transformers run per document;
- the loss with the load-balancing loss included (transformers' ``load_balancing_loss_func``
  on the whole batch) and every gradient (router, experts, shared expert and its gate,
  DeltaNet, attention) within 1e-4 rel; again with activation checkpointing;
- both expert layouts load (the released per-expert tensors, which transformers 5.24's
  ``save_pretrained`` writes, and the fused ``gate_up_proj`` / ``down_proj``);
- a released-form ``Qwen3_5MoeForConditionalGeneration`` folder (``model.language_model.*``,
  a tower, ``mtp.*``; the registry gives it to qwen3_5_vl_moe): called directly, this
  family's loader reads its text decoder, the rest skipped with one log line, and scores
  text as transformers' VL model does;
- (the export round trip: tests/dist/test_family_suite.py)
- config.json in both forms, meta.json round trip, the registry, parameter counts equal to
  transformers' (tiny, and the Qwen3.5-35B-A3B shape on meta), and the bad inputs.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from mpcore.launch.score import score_stream
from mpcore.models.common.hf_io import gather_full
from mpcore.models.common.hybrid.hf import config_from_hf as dense_config_from_hf
from mpcore.models.common.hybrid.hf import load_hf as dense_load_hf
from mpcore.models.common.hybrid.moe_hf import config_from_hf, hf_config_dict, load_hf, shard_map
from mpcore.models.common.hybrid.moe_model import make_model
from mpcore.models.qwen3_5_moe import FAMILY, Qwen35MoeConfig
from mpcore.models.qwen3_5_moe.family import config_from_dict
from mpcore.models.registry import family_of, family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.hf_moe_tiny import backward_loss_with_aux, reference
from tests.dist.qwen35_moe_tiny import CONFIG, make_hf_model, save_hf_model
from tests.dist.qwen35_tiny import check_per_document, conditional_generation, packed_docs

LENGTHS = [5, 1, 70, 2, 3, 13]
ARCH = {"architectures": ["Qwen3_5MoeForCausalLM"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35moe")
    save_hf_model(0, folder)
    return folder


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _check_against(folder, ref, ids, cu, **kwargs):
    state = ParallelState()
    model, cfg = load_hf(folder, state, gdn_kernel="reference", **kwargs)
    assert family_of(cfg) is FAMILY
    logprobs, _ = score_stream(model, state, ids, cu)
    assert float((logprobs.double() - ref["logprobs"]).abs().max()) < 1e-4
    _, inputs = FAMILY.local_inputs(state, ids, cu, cfg)
    aux, loss, stats = backward_loss_with_aux(model, cfg, inputs, int(cu[-1]) - len(LENGTHS))
    assert abs(aux - ref["aux"]) / ref["aux"] < 1e-5
    assert abs(loss - ref["loss"]) / ref["loss"] < 1e-5
    assert cfg.router_aux_loss_coef * ref["aux"] > 1e-3 * ref["loss"]  # the aux term shows
    grads = gather_full({n: p.grad for n, p in model.named_parameters()},
                        [shard_map(cfg, 1, 0)], None)
    assert set(grads) == set(ref["grads"])
    rel = {n: _rel(g, ref["grads"][n]) for n, g in grads.items()}
    assert max(rel.values()) < 1e-4, max(rel, key=rel.get)
    assert int(stats.counts.sum()) == 4 * 2 * int(cu[-1]) and stats.dropped == 0


@pytest.mark.slow  # transformers' float64 reference: about 20 s alone, minutes on a busy CPU
def test_logprobs_loss_aux_and_grads_match_transformers_in_both_layouts(checkpoint, tmp_path):
    released = checkpoint
    ids, cu = packed_docs(LENGTHS, seed=2)
    ref = reference(released, ids, cu)
    names = set(load_file(released / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names  # what transformers writes
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    fused = tmp_path / "fused"  # transformers 5.x's own parameters, as its modules hold them
    fused.mkdir()
    (fused / "config.json").write_text((released / "config.json").read_text())
    state = {k: v.contiguous() for k, v in make_hf_model(0).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    _check_against(released, ref, ids, cu)
    _check_against(fused, ref, ids, cu)
    _check_against(fused, ref, ids, cu, activation_checkpointing=True)


def test_released_conditional_generation_folder_loads_its_text_decoder(tmp_path, caplog):
    hf = conditional_generation(CONFIG, "Qwen3_5Moe")
    hf.save_pretrained(tmp_path / "vl")
    released = load_file(tmp_path / "vl" / "model.safetensors")
    assert "model.language_model.layers.0.mlp.experts.0.up_proj.weight" in released
    released.update({"mtp.fc.weight": torch.zeros(4, 4),
                     "mtp.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(2, 2)})
    save_file(released, tmp_path / "vl" / "model.safetensors", metadata={"format": "pt"})
    assert family_of_hf(tmp_path / "vl").name == "qwen3_5_vl_moe"  # read whole there
    with caplog.at_level(logging.INFO, logger="mpcore.models.common.hybrid.hf"):
        model, _ = load_hf(tmp_path / "vl", ParallelState())
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "mtp.*: 2" in lines[0] and "model.visual.*" in lines[0], lines
    assert "language_model" not in lines[0]
    ids, cu = packed_docs([9, 4, 30], seed=3)
    logprobs, _ = score_stream(model, ParallelState(), ids, cu)
    check_per_document(hf, logprobs, ids, cu)


def test_config_both_forms_meta_round_trip_and_registry():
    hf = make_hf_model(0).config.to_dict() | ARCH
    cfg = config_from_hf(hf)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 24)
    assert cfg.intermediate_size == 40 and cfg.norm_topk_prob and cfg.moe_layers == (0, 1, 2, 3)
    assert cfg.layer_types == tuple(CONFIG["layer_types"]) and cfg.rotary_dim == 4
    v4 = {k: v for k, v in hf.items() if k != "rope_parameters"} | {
        "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert config_from_hf(v4) == cfg
    assert config_from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    assert config_from_hf(hf_config_dict(cfg)) == cfg
    for source in (hf, {k: v for k, v in hf.items() if k != "architectures"}):
        assert family_of_hf(source) is FAMILY
    assert FAMILY.flops_per_token(cfg, 64) > 6 * FAMILY.num_params(cfg)["active"] - 6 * 101 * 32


def test_parameter_counts_equal_transformers():
    """Tiny, and the Qwen3.5-35B-A3B shape: transformers' ``Qwen3_5MoeTextConfig`` defaults
    (its docstring names that checkpoint: 40 layers of hidden 2048, 256 experts of 512, top-8,
    a shared expert of 512, vocab 248320), on the meta device."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    hf = make_hf_model(0)
    tiny = config_from_hf(hf.config.to_dict() | ARCH)
    assert FAMILY.num_params(tiny)["total"] == sum(p.numel() for p in hf.parameters())
    shape = Qwen3_5MoeTextConfig()
    with torch.device("meta"):
        theirs = sum(p.numel() for p in Qwen3_5MoeForCausalLM(shape).parameters())
    cfg = config_from_hf(shape.to_dict() | ARCH)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts) == (40, 2048, 256)
    ours = FAMILY.num_params(cfg)
    with torch.device("meta"):
        built = sum(p.numel() for p in make_model(cfg, ParallelState()).parameters())
    assert ours["total"] == theirs == built
    assert 34e9 < theirs < 36e9 and 2.5e9 < ours["active"] < 3.5e9  # "35B-A3B"


def test_bad_inputs_raise_clearly(checkpoint, tmp_path):
    folder = checkpoint
    moe = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="not a Qwen3.5 checkpoint"):
        dense_config_from_hf(moe)  # a Qwen3.5-MoE checkpoint given to the dense family
    with pytest.raises(ValueError, match="not a Qwen3.5 checkpoint"):
        dense_load_hf(folder, ParallelState())
    dense = CONFIG | {"intermediate_size": 48, "architectures": ["Qwen3_5ForCausalLM"]}
    with pytest.raises(ValueError, match="dense Qwen3.5: load it with the qwen3_5 family"):
        config_from_hf(dense)  # and the reverse
    base = dict(vocab_size=11, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                intermediate_size=8)
    with pytest.raises(ValueError, match="Qwen3.5-MoE has norm_topk_prob=True"):
        Qwen35MoeConfig(**base, norm_topk_prob=False)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        Qwen35MoeConfig(**base, mlp_only_layers=(1,))
    with pytest.raises(ValueError, match="num_experts_per_tok 9 is above num_experts 8"):
        Qwen35MoeConfig(**base, num_experts=8, num_experts_per_tok=9)
    cfg = Qwen35MoeConfig(**base, num_experts=6, linear_num_key_heads=2,
                          linear_num_value_heads=2)
    with pytest.raises(ValueError, match="num_experts 6 is not divisible by ep 4"):
        make_model(cfg, ParallelState(ep=4))
    with pytest.raises(ValueError, match="sequence parallelism is not supported"):
        make_model(cfg, ParallelState(tp=2), sequence_parallel=True)
