"""Qwen3VLModel vs transformers' Qwen3VLForConditionalGeneration, one process (CPU, fp32 vs
float64).

A packed stream mixing images of different grids, a 3-frame video and text-only documents of
odd lengths: per-token log-probs and entropy within 1e-4 of transformers run per document, the
mean loss and the gradient of every parameter (tower and DeepStack mergers included) within
1e-4 rel; tied and untied; export -> transformers loads the same function; the DeepStack add
is checked to matter (removing it, or adding at shifted rows, moves the log-probs); bad input
raises before any compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

from mpcore.models.common.hf_io import _scatter_back
from mpcore.models.qwen3_vl import (
    config_from_hf,
    flops_per_token,
    load_hf_model,
    local_inputs,
    num_params,
)
from mpcore.models.registry import family_of
from mpcore.parallel.state import ParallelState
from tests.dist.hf_qwen3_vl_tiny import (
    IMAGE,
    VIDEO,
    load,
    reference_loss_grads,
    reference_scores,
    save_hf_model,
    stream,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def hf_named(cfg, grads: dict) -> dict:
    """tp=1 gradients (or weights) of our parameters as HF tensors (fused parts put back);
    ``cfg``'s family gives the shard map (also the Qwen3.5 VL tests')."""
    out: dict[str, torch.Tensor] = {}
    for name, pieces in family_of(cfg).shard_map(cfg, 1, 0).items():
        _scatter_back(grads[name].detach(), pieces, out)
    return out


def vision_kwargs(s: dict) -> dict:
    return {k: s[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                              "video_grid_thw")}


def score_and_grads(model, cfg, state, s: dict):
    """``(logprobs [T], entropy [T], loss, {name: grad})`` at this rank's layout (cp gathered;
    gradients summed over cp, as the dp x cp reduction would); ``cfg``'s family makes the
    inputs."""
    plan, inputs = family_of(cfg).local_inputs(state, s["input_ids"], s["cu_seqlens"], cfg,
                                sequence_parallel=model.sequence_parallel, **vision_kwargs(s))
    with torch.no_grad():
        logprobs, entropy = model(**inputs, output="logprobs")
    logprobs, entropy = plan.gather(logprobs, state.cp_group), plan.gather(entropy, state.cp_group)
    total = model(**inputs, output="loss").sum()
    counts = torch.tensor([float((inputs["labels"] != -100).sum()), float(total.detach())],
                          dtype=torch.float64)
    if state.cp > 1:
        dist.all_reduce(counts, group=state.cp_group)
    (total / counts[0]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if state.cp > 1:
        for g in grads.values():
            dist.all_reduce(g, group=state.cp_group)
    return logprobs, entropy, float(counts[1] / counts[0]), grads


def matches_transformers(folder, load_hf_model):
    """``load_hf_model(folder)`` on ``stream(seed=1)`` vs transformers per document: log-probs
    and entropy within 1e-4 (0 at placeholders), the mean loss and every gradient within 1e-4
    rel (also the Qwen3.5 VL tests'). Returns ``(cfg, our gradients as HF tensors, theirs)``."""
    s = stream(seed=1)
    ref_lp, ref_ent = reference_scores(folder, s)
    ref_loss, ref_grads = reference_loss_grads(folder, s)
    model, cfg = load_hf_model(folder, ParallelState())
    logprobs, entropy, loss, grads = score_and_grads(model, cfg, ParallelState(), s)
    assert float((logprobs.double() - ref_lp).abs().max()) <= 1e-4
    assert float((entropy.double() - ref_ent).abs().max()) <= 1e-4
    ids = s["input_ids"]
    placeholder = (ids[1:] == IMAGE) | (ids[1:] == VIDEO)
    assert bool((logprobs[:-1][placeholder] == 0).all())  # placeholders are no targets
    assert abs(loss - ref_loss) / ref_loss <= 1e-4
    named = hf_named(cfg, grads)
    assert set(named) == set(ref_grads)
    worst = {n: rel(named[n], ref_grads[n]) for n in ref_grads}
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    return cfg, named, ref_grads


def export_matches_transformers(cfg, folder, hf_class):
    """Our own initialisation of ``cfg``'s family exports to ``folder``: transformers loads it
    as ``hf_class`` with our log-probs within 1e-4, and our loader reads back the same tensors
    (also the Qwen3.5 VL tests'). Returns ``(model, the config read back)``."""
    state = ParallelState()
    family = family_of(cfg)
    model = family.build(cfg, state, seed=3)
    family.export_hf(model, state, folder)
    s = stream(seed=4)
    ref_lp, _ = reference_scores(folder, s)
    ours, _, _, _ = score_and_grads(model, cfg, state, s)
    assert float((ours.double() - ref_lp).abs().max()) <= 1e-4
    hf = load(folder, torch.float32)
    assert isinstance(hf, hf_class)
    again, again_cfg = family.load_hf(folder, state)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    return model, again_cfg


@pytest.mark.parametrize("tie", [False, True])
def test_matches_transformers(tie, tmp_path):
    save_hf_model(seed=0, folder=tmp_path, tie=tie)
    _, named, ref_grads = matches_transformers(tmp_path, load_hf_model)
    deep = [n for n in named if "deepstack_merger_list" in n]
    assert deep and all(float(ref_grads[n].abs().max()) > 0 for n in deep)


def test_export_loads_in_transformers_with_the_same_outputs(tmp_path):
    save_hf_model(seed=0, folder=tmp_path / "src")  # only its config.json is used
    cfg = config_from_hf(tmp_path / "src")
    export_matches_transformers(cfg, tmp_path / "out", transformers.Qwen3VLForConditionalGeneration)


@pytest.mark.parametrize("fault", ["no_add", "shifted_rows"])
def test_deepstack_add_matters(fault, tmp_path, monkeypatch):
    """The reference comparison fails when DeepStack is dropped or added one row off."""
    save_hf_model(seed=0, folder=tmp_path)
    s = stream(seed=1)
    ref_lp, _ = reference_scores(tmp_path, s)
    model, cfg = load_hf_model(tmp_path, ParallelState())
    decode = model.text.decode

    def broken(h, position_ids, packing, labels, output, temperature, after_layer=None):
        def hook(i, out):
            if fault == "no_add":
                return out
            return after_layer(i, out.roll(1, 0)).roll(-1, 0)  # rows added one token off

        return decode(h, position_ids, packing, labels, output, temperature, hook)

    monkeypatch.setattr(model.text, "decode", broken)
    plan, inputs = local_inputs(ParallelState(), s["input_ids"], s["cu_seqlens"], cfg,
                                **vision_kwargs(s))
    with torch.no_grad():
        logprobs, _ = model(**inputs, output="logprobs")
    assert float((logprobs.double() - ref_lp).abs().max()) > 1e-2


def test_counts_and_flops_match_transformers(tmp_path):
    save_hf_model(seed=0, folder=tmp_path)
    cfg = config_from_hf(tmp_path)
    hf = load(tmp_path, torch.float32)
    counts = num_params(cfg)
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    assert counts["vision"] == sum(p.numel() for p in hf.model.visual.parameters())
    text = cfg.text
    dense = counts["total"] - counts["vision"] - counts["embedding"]
    attention = 12 * text.num_layers * text.num_heads * text.head_dim * 100
    assert flops_per_token(cfg, 100) == 6.0 * dense + attention


@pytest.mark.parametrize(("case", "message"), [
    ("pixels", "pixel_values has shape"),
    ("rows", "disagree between input_ids"),
])
def test_bad_inputs_raise_before_compute(case, message, tmp_path):
    save_hf_model(seed=0, folder=tmp_path)
    model, cfg = load_hf_model(tmp_path, ParallelState())
    s = stream(seed=1)
    _, inputs = local_inputs(ParallelState(), s["input_ids"], s["cu_seqlens"], cfg,
                             **vision_kwargs(s))
    if case == "pixels":
        inputs["pixel_values"] = inputs["pixel_values"][:-4]
    else:
        inputs["vision_rows"] = inputs["vision_rows"].clone()
        inputs["vision_rows"][0] = 0
    with pytest.raises(ValueError, match=message):
        model(**inputs, output="logprobs")
