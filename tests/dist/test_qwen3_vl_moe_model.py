"""Qwen3-VL-MoE vs transformers' Qwen3VLMoeForConditionalGeneration (CPU, fp32 vs float64).

One process: per-token log-probs and entropy of a packed stream (images of different grids,
a 3-frame video, text-only documents) within 1e-4 of transformers run per document; the mean
next-token loss and every gradient (router, experts, tower, DeepStack mergers) within 1e-4
rel. Two gloo processes, at ep = 2 (dp = 2: each rank holds half the experts) and at tp = 2:
the log-probs within 1e-5 of the one-process ones. Export: transformers loads it back to the
same tensors; the released checkpoints' transposed expert orientation loads too. Config
round trips and the bad inputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpcore.models.common.hf_io import _scatter_back
from mpcore.models.qwen3_vl_moe.config import config_from_dict, config_from_hf, hf_config_dict
from mpcore.models.qwen3_vl_moe.family import FAMILY
from mpcore.models.qwen3_vl_moe.hf import export_hf, load_hf_model, shard_map
from mpcore.models.registry import family_of, family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.hf_qwen3_vl_moe_tiny import EAGER, MOE, make_hf_model, save_hf_model
from tests.dist.hf_qwen3_vl_tiny import reference_loss_grads, reference_scores, stream


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _vision(s: dict) -> dict:
    return {k: s[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                              "video_grid_thw")}


def logprobs_at(model, cfg, state, s):
    """``(logprobs [T], entropy [T], inputs)`` of stream ``s`` at ``state`` (cp gathered;
    ``cfg``'s family makes the inputs; also the Qwen3.5-MoE VL tests')."""
    plan, inputs = family_of(cfg).local_inputs(state, s["input_ids"], s["cu_seqlens"], cfg,
                                               **_vision(s))
    with torch.no_grad():
        logprobs, entropy = model(**inputs, output="logprobs")
    return plan.gather(logprobs, state.cp_group), plan.gather(entropy, state.cp_group), inputs


def test_matches_transformers_in_one_process(tmp_path):
    save_hf_model(0, tmp_path)
    s = stream(seed=1)
    ref_lp, ref_ent = reference_scores(tmp_path, s, **EAGER)
    ref_loss, ref_grads = reference_loss_grads(tmp_path, s, **EAGER)
    model, cfg = load_hf_model(tmp_path, ParallelState())
    assert family_of(cfg) is FAMILY and family_of_hf(tmp_path) is FAMILY
    assert cfg.text.moe_layers == (0, 2) and cfg.text.norm_topk_prob
    logprobs, entropy, inputs = logprobs_at(model, cfg, ParallelState(), s)
    assert float((logprobs.double() - ref_lp).abs().max()) <= 1e-4
    assert float((entropy.double() - ref_ent).abs().max()) <= 1e-4
    per_token = model(**inputs, output="loss")
    valid = int((inputs["labels"] != -100).sum())
    (per_token.sum() / valid).backward()
    assert abs(float(per_token.sum()) / valid - ref_loss) / ref_loss <= 1e-4
    named: dict[str, torch.Tensor] = {}
    for name, pieces in shard_map(cfg, 1, 0).items():
        _scatter_back(dict(model.named_parameters())[name].grad, pieces, named)
    assert set(named) == set(ref_grads)
    worst = {n: _rel(named[n], ref_grads[n]) for n in ref_grads}
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    moe = [n for n in named if ".mlp.experts." in n or ".mlp.gate." in n]
    assert len(moe) == 6 and all(float(ref_grads[n].abs().max()) > 0 for n in moe)
    stats = model.router_stats()  # both sparse layers, every real token, k slots each
    assert int(stats.counts.sum()) == 2 * MOE["num_experts_per_tok"] * s["input_ids"].numel()


def ep2_and_tp2(rank, world, folder, s, one):
    """On each rank, at ep = 2 and at tp = 2: the largest log-prob and entropy differences
    to ``one`` (the one-process ones) and the experts this rank holds; ``folder``'s family."""
    out = {}
    for name, (tp, ep) in {"ep2": (1, 2), "tp2": (2, 1)}.items():
        state = ParallelState.build(tp=tp, ep=ep)
        model, cfg = family_of_hf(folder).load_hf(folder, state)
        logprobs, entropy, _ = logprobs_at(model, cfg, state, s)
        out[name] = (float((logprobs - one[0]).abs().max()),
                     float((entropy - one[1]).abs().max()),
                     model.text.layers[0].feed_forward.experts.w13.shape[0])
    return out


@pytest.mark.slow
def test_ep2_and_tp2_match_one_process(tmp_path):
    save_hf_model(3, tmp_path)
    s = stream(seed=4)
    model, cfg = load_hf_model(tmp_path, ParallelState())
    lp, ent, _ = logprobs_at(model, cfg, ParallelState(), s)
    for r in run_distributed(ep2_and_tp2, 2, str(tmp_path), s, (lp, ent), timeout=400):
        assert r["ep2"][2] == 2 and r["tp2"][2] == 4, r  # experts per rank
        for name, (d_lp, d_ent, _) in r.items():
            assert d_lp <= 1e-5 and d_ent <= 1e-5, (name, d_lp, d_ent)


def test_export_round_trip_and_configs(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    save_hf_model(5, tmp_path / "hf")
    model, cfg = load_hf_model(tmp_path / "hf", ParallelState())
    export_hf(model, ParallelState(), tmp_path / "out")
    theirs = make_hf_model(5).state_dict()
    ours = AutoModelForImageTextToText.from_pretrained(tmp_path / "out").state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name
    counts = FAMILY.num_params(cfg)  # untied: the state dict holds every parameter once
    assert counts["total"] == sum(t.numel() for t in theirs.values())
    assert counts["total"] - counts["active"] == 2 * 2 * 3 * 32 * MOE["moe_intermediate_size"]
    assert config_from_hf(hf_config_dict(cfg)) == cfg
    assert config_from_dict(dataclasses.asdict(cfg)) == cfg
    # The released checkpoints' orientation ([E, H, 2I] / [E, I, H]) loads to the same model.
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text((tmp_path / "out" / "config.json").read_text())
    flipped = {k: (v.transpose(1, 2) if ".mlp.experts." in k else v).contiguous()
               for k, v in theirs.items()}
    save_file(flipped, released / "model.safetensors", metadata={"format": "pt"})
    again, _ = load_hf_model(released, ParallelState())
    for (name, a), b in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_bad_inputs_raise_before_compute(tmp_path):
    save_hf_model(0, tmp_path)
    cfg = config_from_hf(tmp_path)
    hf = hf_config_dict(cfg)
    with pytest.raises(ValueError, match="is not Qwen3-VL-MoE"):
        config_from_hf({**hf, "architectures": ["Qwen3VLForConditionalGeneration"]})
    dense = {**hf, "text_config": {k: v for k, v in hf["text_config"].items()
                                   if k != "num_experts"}}
    with pytest.raises(ValueError, match="no num_experts: a dense decoder"):
        config_from_hf(dense)
    with pytest.raises(ValueError, match="is not Qwen3-VL"):  # and the reverse
        FAMILY.config_from_hf.__globals__["dense_config_from_hf"](hf)
    with pytest.raises(ValueError, match="num_experts 4 is not divisible by ep 3"):
        FAMILY.check_experts(cfg, 3)
    text = {**hf["text_config"], "num_experts_per_tok": 5}
    with pytest.raises(ValueError, match="num_experts_per_tok 5 is above num_experts 4"):
        config_from_hf({**hf, "text_config": text})
    with pytest.raises(ValueError, match="sequence parallelism is not supported"):
        from mpcore.models.qwen3_vl_moe.model import Qwen3VLMoeModel

        with torch.device("meta"):
            Qwen3VLMoeModel(cfg, ParallelState(tp=2), sequence_parallel=True)
