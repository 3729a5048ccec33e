"""Qwen3.5-MoE VL vs transformers' Qwen3_5MoeForConditionalGeneration (CPU, fp32 vs float64).

One process: per-token log-probs and entropy of ``hf_qwen3_vl_tiny``'s packed stream (images
of different grids, a 3-frame video, text-only documents) within 1e-4 of transformers run per
document; the loss with the whole batch's load-balancing loss (transformers'
``load_balancing_loss_func``) and every gradient (tower, DeltaNet, gated attention, router,
experts, shared expert and its gate) within 1e-4 rel. Both expert layouts load (per expert,
as released and as ``save_pretrained`` writes; fused); ``mtp.*`` is skipped with one log line.
The export round trip is tests/dist/test_family_suite.py's. Two
gloo processes at ep = 2 and at tp = 2 give the one-process log-probs. Parameter counts equal
transformers' (tiny, and the Qwen3.5-35B-A3B shape on meta); another family's checkpoint and
bad layouts raise ``ValueError`` naming the fix.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from mpcore.models.common.moe_loss import aux_share, global_counts
from mpcore.models.qwen3_5_vl_moe import FAMILY, Qwen35VLMoeConfig
from mpcore.models.qwen3_5_vl_moe.config import config_from_hf, hf_config_dict
from mpcore.models.qwen3_5_vl_moe.hf import load_hf_model
from mpcore.models.qwen3_5_vl_moe.model import make_moe_model
from mpcore.models.registry import family_named, family_of, family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.hf_qwen3_vl_tiny import reference_loss_grads, reference_scores, stream
from tests.dist.hf_qwen35_vl_moe_tiny import EAGER, TEXT_MOE, make_hf_model, save_hf_model
from tests.dist.test_qwen3_vl_model import hf_named, rel
from tests.dist.test_qwen3_vl_moe_model import ep2_and_tp2, logprobs_at

ARCH = {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35_vl_moe")
    save_hf_model(0, folder)
    return folder


@pytest.mark.slow  # transformers' float64 reference twice: about 30 s alone
def test_logprobs_loss_with_aux_and_grads_match_transformers(checkpoint):
    s = stream(seed=1)
    ref_lp, ref_ent = reference_scores(checkpoint, s, **EAGER)
    ref_loss, ref_grads = reference_loss_grads(checkpoint, s, aux=True, **EAGER)
    ce_only, _ = reference_loss_grads(checkpoint, s, **EAGER)
    model, cfg = load_hf_model(checkpoint, ParallelState(), gdn_kernel="reference")
    assert family_of(cfg) is FAMILY and family_of_hf(checkpoint) is FAMILY
    logprobs, entropy, inputs = logprobs_at(model, cfg, ParallelState(), s)
    assert float((logprobs.double() - ref_lp).abs().max()) <= 1e-4
    assert float((entropy.double() - ref_ent).abs().max()) <= 1e-4
    per_token = model(**inputs, output="loss")
    stats = model.router_stats()
    aux = aux_share(stats, *global_counts([stats], None))
    valid = int((inputs["labels"] != -100).sum())
    loss = per_token.sum() / valid + cfg.text.router_aux_loss_coef * aux
    loss.backward()
    assert abs(float(loss.detach()) - ref_loss) / ref_loss <= 1e-5
    assert ref_loss - ce_only > 1e-3 * ref_loss  # the aux term shows
    named = hf_named(cfg, {n: p.grad for n, p in model.named_parameters()})
    assert set(named) == set(ref_grads)
    worst = {n: rel(named[n], ref_grads[n]) for n in ref_grads}
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    for part in ("model.visual.", "linear_attn.", "self_attn.", "mlp.experts.", "mlp.gate.",
                 "shared_expert.", "shared_expert_gate."):
        assert any(part in n and float(ref_grads[n].abs().max()) > 0 for n in ref_grads), part
    layers, k = TEXT_MOE["num_hidden_layers"], TEXT_MOE["num_experts_per_tok"]
    assert int(stats.counts.sum()) == layers * k * s["input_ids"].numel()


def test_fused_experts_load_and_mtp_is_skipped_with_one_log_line(checkpoint, tmp_path, caplog):
    released = load_file(checkpoint / "model.safetensors")
    assert "model.language_model.layers.0.mlp.experts.7.gate_proj.weight" in released
    fused = {k: v.contiguous() for k, v in make_hf_model(0).state_dict().items()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in fused
    fused.update({"mtp.fc.weight": torch.zeros(4, 4),
                  "mtp.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(2, 2)})
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="mpcore.models.common.hybrid.hf"):
        model, _ = load_hf_model(tmp_path, ParallelState())
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "2 tensors" in lines[0] and "mtp.*: 2" in lines[0], lines
    plain, _ = load_hf_model(checkpoint, ParallelState())
    for (n, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.slow
def test_ep2_and_tp2_match_one_process(checkpoint):
    s = stream(seed=4)
    model, cfg = load_hf_model(checkpoint, ParallelState())
    lp, ent, _ = logprobs_at(model, cfg, ParallelState(), s)
    for r in run_distributed(ep2_and_tp2, 2, str(checkpoint), s, (lp, ent), timeout=400):
        assert r["ep2"][2] == 4 and r["tp2"][2] == 8, r  # experts per rank
        for name, (d_lp, d_ent, _) in r.items():
            assert d_lp <= 1e-5 and d_ent <= 1e-5, (name, d_lp, d_ent)


def test_parameter_counts_equal_transformers(checkpoint):
    """Tiny, and the Qwen3.5-35B-A3B VL shape: transformers' ``Qwen3_5MoeConfig`` defaults
    (text: 40 layers of hidden 2048, 256 experts of 512, top-8, a shared expert of 512; its
    27-block tower), on the meta device. Those defaults pair the tower's ``out_hidden_size``
    3584 with the decoder's hidden 2048, which no forward can run (merged rows replace token
    embeddings); the released checkpoint's config.json says 2048, as here."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    hf = make_hf_model(0)
    tiny = config_from_hf(checkpoint)
    counts = FAMILY.num_params(tiny)
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    assert counts["vision"] == sum(p.numel() for p in hf.model.visual.parameters())
    shape = Qwen3_5MoeConfig(vision_config={"out_hidden_size": 2048})
    with torch.device("meta"):
        theirs = sum(p.numel() for p in Qwen3_5MoeForConditionalGeneration(shape).parameters())
    cfg = config_from_hf(shape.to_dict() | ARCH)
    assert (cfg.text.num_layers, cfg.text.hidden_size, cfg.text.num_experts) == (40, 2048, 256)
    ours = FAMILY.num_params(cfg)
    with torch.device("meta"):
        built = sum(p.numel() for p in make_moe_model(cfg, ParallelState()).parameters())
    assert ours["total"] == theirs == built
    assert 34e9 < theirs < 37e9 and 2.5e9 < ours["active"] < 4e9  # "35B-A3B"


def test_another_family_s_checkpoint_and_bad_layouts_raise(checkpoint):
    with pytest.raises(ValueError, match="is not Qwen3.5 vision-language"):
        family_named("qwen3_5_vl").load_hf(checkpoint, ParallelState())
    with pytest.raises(ValueError, match="is not Qwen3-VL-MoE"):
        family_named("qwen3_vl_moe").load_hf(checkpoint, ParallelState())
    hf = hf_config_dict(config_from_hf(checkpoint))
    for other in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                  "Qwen3VLMoeForConditionalGeneration"):
        with pytest.raises(ValueError, match=rf"\['{other}'\] is not Qwen3.5-MoE "
                                             r"vision-language"):
            config_from_hf({**hf, "architectures": [other]})
    cfg = config_from_hf(checkpoint)
    dense = family_named("qwen3_5").config_from_hf(
        {**TEXT_MOE, "intermediate_size": 40, "architectures": ["Qwen3_5ForCausalLM"]})
    with pytest.raises(TypeError, match="a dense decoder is model.family qwen3_5_vl"):
        Qwen35VLMoeConfig(text=dense, vision=cfg.vision,
                          **{k: getattr(cfg, k) for k in ("image_token_id", "video_token_id",
                                                          "vision_start_token_id",
                                                          "vision_end_token_id")})
    with pytest.raises(ValueError, match="num_experts 8 is not divisible by ep 3"):
        FAMILY.check_experts(cfg, 3)
    with pytest.raises(ValueError, match="sequence parallelism is not supported"):
        make_moe_model(cfg, ParallelState(tp=2), sequence_parallel=True)


def test_the_text_family_keeps_causal_lm_and_reads_the_decoder(checkpoint):
    """``Qwen3_5MoeForConditionalGeneration`` belongs to this family; the text family keeps
    ``Qwen3_5MoeForCausalLM`` (and, called directly, still reads a VL folder's decoder)."""
    text = family_named("qwen3_5_moe")
    assert family_of_hf(ARCH) is FAMILY
    assert family_of_hf({"architectures": ["Qwen3_5MoeForCausalLM"]}) is text
    decoder = text.config_from_hf(checkpoint)
    assert decoder.mrope_section is None and decoder.num_experts == TEXT_MOE["num_experts"]
    model, cfg = load_hf_model(checkpoint, ParallelState())
    alone, _ = text.load_hf(checkpoint, ParallelState())
    ours = dict(model.text.named_parameters())
    for name, p in alone.named_parameters():
        assert torch.equal(p, ours[name]), name
