"""GLM-4V vs transformers' ``Glm4vForConditionalGeneration``, single process, fp32 on the CPU.

One packed stream mixing text-only documents of odd lengths, documents with images of different
grids and a document with a 3-frame video: position ids equal ``get_rope_index`` per document;
per-token log-probs within 1e-4 of transformers run per document (tied and untied); the loss and
every parameter's gradient, tower included, within 1e-4 rel; config round trips and bad inputs
raise before compute. (The export round trip: tests/dist/test_family_suite.py.)
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from mpcore.models import family_of, family_of_hf
from mpcore.models.glm4v import (
    config_from_dict,
    config_from_hf,
    hf_config_dict,
    load_hf_model,
    local_glm4v_inputs,
    mm_token_types,
    position_ids,
)
from mpcore.parallel.state import ParallelState
from tests.dist.hf_glm4v_tiny import (
    IMAGE,
    make_hf_model,
    reference_logprobs,
    reference_loss_grads,
    reference_positions,
    save_hf_model,
    stream,
)


def _logprobs(model, cfg, state, s):
    plan, inputs = local_glm4v_inputs(
        state, s["input_ids"], s["cu_seqlens"], cfg, pixel_values=s["pixel_values"],
        image_grid_thw=s["image_grid_thw"], pixel_values_videos=s["pixel_values_videos"],
        video_grid_thw=s["video_grid_thw"], sequence_parallel=model.sequence_parallel)
    with torch.no_grad():
        logprobs, _ = model(**inputs, output="logprobs")
    return plan.gather(logprobs, state.cp_group)


def _doc_ends(s):
    keep = torch.ones(s["input_ids"].numel(), dtype=torch.bool)
    keep[s["cu_seqlens"][1:] - 1] = False
    # a placeholder target scores 0 in ours (never a target); compare real targets only
    nxt = torch.cat([s["input_ids"][1:], s["input_ids"][:1]])
    return keep & (nxt != IMAGE)


def test_positions_and_types_match_transformers():
    hf = make_hf_model(seed=1)
    cfg = config_from_hf(hf.config.to_dict())
    s = stream(seed=2)
    got, rows = position_ids(s["input_ids"], s["cu_seqlens"], cfg, s["image_grid_thw"],
                             s["video_grid_thw"])
    assert torch.equal(got, reference_positions(hf, s))
    cu = s["cu_seqlens"].tolist()
    assert torch.equal(mm_token_types(s["input_ids"], cu, cfg), s["types"])
    assert torch.equal(rows >= 0, s["input_ids"] == IMAGE)
    # tower rows: images first, then the video's frames
    num_image_rows = int(s["image_grid_thw"].prod(-1).sum()) // 4
    assert rows[s["types"] == 2].min().item() == num_image_rows


@pytest.mark.parametrize("tie", [False, True])
def test_matches_transformers(tie, tmp_path):
    save_hf_model(seed=3, folder=tmp_path, tie=tie)
    hf = transformers.Glm4vForConditionalGeneration.from_pretrained(tmp_path).eval()
    state = ParallelState.build()
    model, cfg = load_hf_model(tmp_path, state)
    assert family_of_hf(tmp_path).name == "glm4v" and family_of(cfg).name == "glm4v"
    assert cfg.text.tie_embeddings == tie
    s = stream(seed=4)
    got, want = _logprobs(model, cfg, state, s), reference_logprobs(hf, s)
    keep = _doc_ends(s)
    assert (got - want)[keep].abs().max().item() < 1e-4
    assert want[keep].abs().mean().item() > 1.0


def test_loss_and_gradients_match_transformers(tmp_path):
    """The mean loss and every parameter's gradient (tower included) within 1e-4 rel."""
    from mpcore.models.common.hf_io import gather_full
    from mpcore.models.glm4v import shard_map

    save_hf_model(seed=9, folder=tmp_path)
    hf = transformers.Glm4vForConditionalGeneration.from_pretrained(tmp_path).eval()
    state = ParallelState.build()
    model, cfg = load_hf_model(tmp_path, state)
    s = stream(seed=10)
    _, inputs = local_glm4v_inputs(
        state, s["input_ids"], s["cu_seqlens"], cfg, pixel_values=s["pixel_values"],
        image_grid_thw=s["image_grid_thw"], pixel_values_videos=s["pixel_values_videos"],
        video_grid_thw=s["video_grid_thw"])
    total = model(**inputs, output="loss").sum()
    count = int((inputs["labels"] != -100).sum())
    (total / count).backward()
    want_loss, want = reference_loss_grads(hf, s)
    assert abs(float(total.detach()) / count - want_loss) / want_loss < 1e-5
    grads = gather_full({n: p.grad for n, p in model.named_parameters()},
                        [shard_map(cfg, 1, 0)], None)
    assert set(grads) == set(want)
    for name, g in grads.items():
        err = float((g - want[name]).norm() / want[name].norm())
        assert err < 1e-4, (name, err)


def test_config_forms_and_meta_round_trip():
    hf = make_hf_model(seed=1).config.to_dict()
    cfg = config_from_hf(hf)
    assert cfg.text.rotary_dim == 8 and cfg.text.mrope_section == (2, 1, 1)
    assert cfg.text.rope_style == "gptj" and cfg.text.qkv_bias
    assert config_from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    assert config_from_hf(hf_config_dict(cfg)) == cfg
    # the 4.5x form: rope_scaling with "type", partial_rotary_factor at the text level
    old = json.loads(json.dumps(hf))
    text = old["text_config"]
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope["rope_theta"], partial_rotary_factor=0.5,
                rope_scaling={"type": "default", "mrope_section": [2, 1, 1]})
    old["architectures"] = ["Glm4vForConditionalGeneration"]
    assert config_from_hf(old) == cfg


def _with(hf: dict, **text) -> dict:
    out = json.loads(json.dumps(hf))
    out["text_config"]["rope_parameters"].update(text)
    return out


def test_bad_configs_raise():
    hf = make_hf_model(seed=1).config.to_dict()
    with pytest.raises(ValueError, match="does not fit the rotary dims"):
        config_from_hf(_with(hf, mrope_section=[2, 2, 2]))
    with pytest.raises(ValueError, match="does not fit the rotary dims"):
        config_from_hf(_with(hf, partial_rotary_factor=1.0))
    square = json.loads(json.dumps(hf))
    square["vision_config"]["image_size"] = [8, 6]
    with pytest.raises(ValueError, match="must be square"):
        config_from_hf(square)
    qwen = {**hf, "architectures": ["Qwen2VLForConditionalGeneration"]}
    with pytest.raises(ValueError, match="is not GLM-4V"):
        config_from_hf(qwen)


def test_placeholder_counts_must_match_grid():
    cfg = config_from_hf(make_hf_model(seed=1).config.to_dict())
    s = stream(seed=2)
    ids, cu = s["input_ids"], s["cu_seqlens"]
    bad = s["image_grid_thw"].clone()
    bad[0, 2] += 2
    with pytest.raises(ValueError, match=r"image 0 \(grid \[1, 4, 8\]\) needs 8"):
        position_ids(ids, cu, cfg, bad, s["video_grid_thw"])
    with pytest.raises(ValueError, match="video frame placeholder runs than"):
        position_ids(ids, cu, cfg, s["image_grid_thw"], None)
    with pytest.raises(ValueError, match="grids give 5 images"):
        position_ids(ids, cu, cfg, torch.cat([s["image_grid_thw"], bad[:1]]),
                     s["video_grid_thw"])


def test_shipped_shape_matches_glm41v_9b():
    """launch/configs/glm4v_9b.yaml counts as many parameters as transformers' GLM-4.1V-9B
    (its config's defaults are that checkpoint's shape), both built on meta."""
    from pathlib import Path

    from mpcore.config import load_config
    from mpcore.models.glm4v import FAMILY, Glm4vModel

    root = Path(__file__).resolve().parents[2]
    ids = dict(image_token_id=151343, video_token_id=151344, vision_start_token_id=151339,
               vision_end_token_id=151340)
    cfg = FAMILY.config_from_section(load_config(root / "launch/configs/glm4v_9b.yaml").model,
                                     ids)
    state = ParallelState.build()
    with torch.device("meta"):
        hf = transformers.Glm4vForConditionalGeneration(transformers.Glm4vConfig())
        ours = Glm4vModel(cfg, state)
    counts = FAMILY.num_params(cfg)
    total = sum(p.numel() for p in hf.parameters())
    assert counts["total"] == total == sum(p.numel() for p in ours.parameters())
    assert counts["vision"] == sum(p.numel() for p in hf.model.visual.parameters())
    assert cfg.text.rotary_dim == 64 and cfg.vision.grid_side == 24
    assert 9e9 < total < 11e9


def test_checkpoint_position_grid_must_match_config(tmp_path):
    """A position table that is not the config's square grid is refused before any compute."""
    from safetensors.torch import load_file, save_file

    save_hf_model(seed=1, folder=tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.visual.embeddings.position_embedding.weight"
    tensors[name] = tensors[name][:12].contiguous()  # 12 rows: no square grid
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="position_embedding.weight has shape"):
        load_hf_model(tmp_path, ParallelState.build())
