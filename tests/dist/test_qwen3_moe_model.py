"""Qwen3-MoE in one process vs transformers' Qwen3MoeForCausalLM (fp32 vs float64, CPU).

- per-token log-probs of a packed stream within 1e-4 of transformers run per document;
- the loss with the load-balancing loss included (transformers' ``load_balancing_loss_func`` on
  the whole batch) and every gradient (router, experts, attention, dense layer) within 1e-4;
- the same with activation checkpointing (the aux loss's graph through recomputed layers);
- both expert layouts load (released per-expert tensors, which transformers 5.24's
  ``save_pretrained`` writes, and the fused ``gate_up_proj`` / ``down_proj``);
- (the export round trip: tests/dist/test_family_suite.py)
- config.json in both forms, meta.json round trip, a Qwen3-30B-A3B-shaped parameter count
  equal to transformers' (meta device), and the bad inputs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from mpcore.models.common.hf_config import config_from_hf as dense_config_from_hf
from mpcore.models.common.moe_config import Qwen3MoeConfig, config_from_dict, config_from_hf
from mpcore.models.common.moe_decoder_hf import load_hf_model, shard_map
from mpcore.models.qwen3_moe.family import FAMILY, local_inputs
from mpcore.models.registry import family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.hf_moe_tiny import (
    CONFIG,
    backward_loss_with_aux,
    make_hf_model,
    packed_docs,
    reference,
    save_hf_model,
)

LENGTHS = [7, 13, 1, 10, 5]


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _full_grad(ref_grads, pieces) -> torch.Tensor:
    return torch.cat([ref_grads[p.name] for p in pieces], pieces[0].dim)


def _check_against(folder, ref, ids, cu, **kwargs):
    state = ParallelState()
    model, cfg = load_hf_model(folder, state, **kwargs)
    _, inputs = local_inputs(state, ids, cu)
    logprobs, _ = model(**inputs, output="logprobs")
    assert float((logprobs.double() - ref["logprobs"]).abs().max()) < 1e-4
    aux, loss, stats = backward_loss_with_aux(model, cfg, inputs, int(cu[-1]) - len(LENGTHS))
    assert abs(aux - ref["aux"]) / ref["aux"] < 1e-5
    assert abs(loss - ref["loss"]) / ref["loss"] < 1e-5
    params = dict(model.named_parameters())
    rel = {n: _rel(params[n].grad, _full_grad(ref["grads"], pieces))
           for n, pieces in shard_map(cfg, 1, 0).items()}
    assert max(rel.values()) < 1e-4, max(rel, key=rel.get)
    assert any("experts.w13" in n for n in rel) and any("gate.weight" in n for n in rel)
    assert int(stats.counts.sum()) == 2 * 2 * int(cu[-1])  # 2 MoE layers, top-2, dropless
    assert stats.dropped == 0


def test_logprobs_loss_aux_and_grads_match_transformers_in_both_layouts(tmp_path):
    released, fused = tmp_path / "released", tmp_path / "fused"
    save_hf_model(0, released)
    keys = json.loads((released / "config.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in str(keys)
    # The fused layout: transformers 5.x's own parameters, as its modules hold them.
    fused.mkdir()
    (fused / "config.json").write_text((released / "config.json").read_text())
    state = {k: v.contiguous() for k, v in make_hf_model(0).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    ids, cu = packed_docs(LENGTHS, 1)
    ref = reference(released, ids, cu)
    _check_against(released, ref, ids, cu)
    _check_against(fused, ref, ids, cu)
    # Recomputed in backward: the router statistics' graph still reaches the router.
    _check_against(fused, ref, ids, cu, activation_checkpointing=True)


def test_config_both_forms_meta_round_trip_and_registry():
    v5 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
          **{k: v for k, v in CONFIG.items() if k != "num_experts"}, "num_local_experts": 8,
          "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    v4 = {**{k: v for k, v in v5.items() if k not in ("rope_parameters", "num_local_experts")},
          "num_experts": 8, "rope_theta": 5e5}
    a, b = config_from_hf(v5), config_from_hf(v4)
    assert a == b and a.rope_theta == 5e5 and a.moe_layers == (0, 2) and a.norm_topk_prob
    assert config_from_dict(json.loads(json.dumps(dataclasses.asdict(a)))) == a
    assert config_from_hf(FAMILY.hf_config_dict(a)) == a
    assert family_of_hf(v5) is FAMILY
    sparse2 = config_from_hf({**v4, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert sparse2.moe_layers == (1,)


def test_parameter_count_of_qwen3_30b_a3b_equals_transformers():
    import transformers

    shape = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, num_experts=128, num_experts_per_tok=8,
                 moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False,
                 max_position_embeddings=40960, rms_norm_eps=1e-6)
    hf_cfg = transformers.Qwen3MoeConfig(**shape)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Qwen3MoeForCausalLM(hf_cfg).parameters())
    ours = FAMILY.num_params(config_from_hf({"architectures": ["Qwen3MoeForCausalLM"],
                                             **shape}))
    assert ours["total"] == theirs  # 30.5 B
    assert 3.0e9 < ours["active"] < 3.6e9  # "A3B": 3.3 B active


def test_bad_inputs_raise_before_compute(tmp_path):
    base = dict(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                intermediate_size=8, qk_norm=True)
    with pytest.raises(ValueError, match="num_experts_per_tok 9 is above num_experts 8"):
        Qwen3MoeConfig(**base, num_experts=8, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts 6 is not divisible by ep 4"):
        Qwen3MoeConfig(**base, num_experts=6).check_experts(4)
    moe = {"architectures": ["Qwen3MoeForCausalLM"], **CONFIG}
    with pytest.raises(ValueError, match="unsupported architecture"):
        dense_config_from_hf(moe)  # a MoE checkpoint given to the dense family
    with pytest.raises(ValueError, match="is not a Qwen3-MoE checkpoint"):
        config_from_hf({**moe, "architectures": ["Qwen3ForCausalLM"]})  # and the reverse
    with pytest.raises(ValueError, match="sequence parallelism is not supported"):
        from mpcore.models.common.moe_decoder import Qwen3MoeTransformer

        Qwen3MoeTransformer(Qwen3MoeConfig(**base), ParallelState(tp=2),
                            sequence_parallel=True)
    # launch/score.py --ep: checked on config.json alone, before the weights load
    from mpcore.launch.score import checkpoint_spec
    from tests.dist.hf_tiny import save_hf_model as save_dense_model

    save_dense_model("qwen3", 0, tmp_path / "dense")
    with pytest.raises(ValueError, match="--ep 2 does not fit .*ep=2 but this model has no "
                                         "experts"):
        checkpoint_spec(tmp_path / "dense", 2)
    save_hf_model(0, tmp_path / "moe3", num_experts=3)
    with pytest.raises(ValueError, match="num_experts 3 is not divisible by ep 2"):
        checkpoint_spec(tmp_path / "moe3", 2)
    assert checkpoint_spec(tmp_path / "moe3", 3).vocab_size == CONFIG["vocab_size"]
