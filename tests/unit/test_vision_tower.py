"""Vision tower (Qwen2-VL, Qwen2.5-VL) vs transformers, one process on the CPU.

Tiny random transformers models (fresh weights for every parameter, norms and biases included),
saved with ``save_pretrained`` and loaded through ``vision_shard_map``, so the loader is tested
too. Three images in one call: 8x12 patches, a 2-frame 4x6 video, 6x10; with ``window_size``
giving 3x3-unit windows the Qwen2.5-VL grids have several windows, partial ones included, and
block 1 attends over whole frames.

transformers' vision rotary embedding computes in float32 whatever the input dtype (``q.float()``
is a downcast for float64), which alone limits a float64 comparison to ~1e-7. The float64 test
replaces that one function by the same formula in the input dtype; the float32 test runs
transformers as it is.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_position_ids,
    get_vision_window_index,
)

from mpcore.models.qwen2_vl import (
    VisionConfig,
    VisionTower,
    build_vision_tower,
    export_vision_weights,
    hf_vision_config_dict,
    load_vision_tower,
    plan_vision,
    vision_config_from_hf,
    vision_shard_map,
)
from mpcore.models.qwen2_vl.vision_hf import shard_from_full

TEXT = dict(vocab_size=64, hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=32,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                             "rope_theta": 10000.0})
HF = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", modeling_qwen2_vl, dict(
        depth=3, embed_dim=32, hidden_size=24, num_heads=4, mlp_ratio=2, patch_size=2)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", modeling_qwen2_5_vl,
                   dict(depth=3, hidden_size=32, out_hidden_size=24, intermediate_size=48,
                        num_heads=4, patch_size=2, window_size=12, fullatt_block_indexes=[1])),
}
GRID = [[1, 8, 12], [2, 4, 6], [1, 6, 10]]
NUM_PATCHES = sum(t * h * w for t, h, w in GRID)  # 204


def _fresh_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm = name.endswith("weight") and ("norm" in name or "ln_q" in name)
            p.copy_(1.0 + 0.2 * noise if is_norm else 0.15 * noise)


@pytest.fixture(scope="module", params=sorted(HF))
def checkpoint(request, tmp_path_factory):
    """(arch, folder, our config read from its config.json, the HF vision model in fp32)."""
    arch = request.param
    config_name, model_name, _, vision = HF[arch]
    config = getattr(transformers, config_name)(text_config=TEXT, vision_config=vision)
    model = getattr(transformers, model_name)(config).eval()
    _fresh_weights(model, seed=1)
    folder = tmp_path_factory.mktemp(arch)
    model.save_pretrained(folder)
    vision_config = json.loads((folder / "config.json").read_text())["vision_config"]
    return arch, folder, vision_config_from_hf(vision_config, arch), model.model.visual


def _inputs(cfg: VisionConfig, dtype, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(NUM_PATCHES, cfg.patch_dim, generator=gen).to(dtype)
    merged = NUM_PATCHES // cfg.merge_unit
    return pixels, torch.randn(merged, cfg.out_hidden_size, generator=gen).to(dtype)


def _hf_reference(visual, pixels, cotangent):
    """transformers' merged output and gradients by hub name (``visual.`` + name)."""
    out = visual(pixels, grid_thw=torch.tensor(GRID)).pooler_output
    (out * cotangent).sum().backward()
    return out.detach(), {"visual." + n: p.grad for n, p in visual.named_parameters()}


def _ours(tower, pixels, cotangent):
    out = tower(pixels, torch.tensor(GRID))
    (out * cotangent).sum().backward()
    return out.detach(), {n: p.grad for n, p in tower.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _rotate_in_input_dtype(q, k, cos, sin):
    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    rot = modeling_qwen2_vl.rotate_half
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _check_against_hf(checkpoint, dtype, out_tol, grad_tol):
    arch, folder, cfg, visual = checkpoint
    visual = copy.deepcopy(visual).to(dtype)
    pixels, cotangent = _inputs(cfg, dtype)
    ref, ref_grads = _hf_reference(visual, pixels, cotangent)
    tower = load_vision_tower(folder, cfg, dtype=dtype)
    out, grads = _ours(tower, pixels, cotangent)
    assert out.shape == (NUM_PATCHES // 4, cfg.out_hidden_size) and out.dtype == dtype
    assert (out - ref).abs().max() <= out_tol
    table = vision_shard_map(cfg, 1, 0)
    rel = {n: _rel(g, shard_from_full(ref_grads, table[n])) for n, g in grads.items()}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= grad_tol, (worst, rel[worst])


def test_matches_transformers_float64(checkpoint, monkeypatch):
    module = HF[checkpoint[0]][2]
    monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", _rotate_in_input_dtype)
    _check_against_hf(checkpoint, torch.float64, out_tol=1e-6, grad_tol=1e-5)


def test_matches_transformers_float32(checkpoint):
    _check_against_hf(checkpoint, torch.float32, out_tol=1e-4, grad_tol=1e-5)


def test_activation_checkpointing_is_identical(checkpoint):
    _, folder, cfg, _ = checkpoint
    pixels, cotangent = _inputs(cfg, torch.float64, seed=3)
    plain = _ours(load_vision_tower(folder, cfg, dtype=torch.float64), pixels, cotangent)
    tower = load_vision_tower(folder, cfg, dtype=torch.float64, activation_checkpointing=True)
    ckpt = _ours(tower, pixels, cotangent)
    assert torch.equal(plain[0], ckpt[0])
    assert all(torch.equal(plain[1][n], g) for n, g in ckpt[1].items())


def test_precomputed_plan_and_list_grid(checkpoint):
    _, folder, cfg, _ = checkpoint
    tower = load_vision_tower(folder, cfg)
    pixels, _ = _inputs(cfg, torch.float32, seed=4)
    with torch.no_grad():
        a = tower(pixels, torch.tensor(GRID))
        b = tower(pixels, GRID, plan=tower.plan(GRID))
    assert torch.equal(a, b)


def test_export_gives_the_checkpoint_back(checkpoint):
    _, folder, cfg, _ = checkpoint
    exported = export_vision_weights(load_vision_tower(folder, cfg))
    saved = {k: v for k, v in load_file(folder / "model.safetensors").items()
             if k.startswith("visual.")}
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_config_round_trip(checkpoint):
    arch, _, cfg, visual = checkpoint
    written = hf_vision_config_dict(cfg)
    assert vision_config_from_hf(written, arch) == cfg
    hf_class = type(visual.config)
    with torch.device("meta"):
        hf = type(visual)(hf_class(**written))
        ours = VisionTower(cfg)
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())


def test_config_from_transformers_4_dicts():
    qwen2 = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
             "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2,
             "temporal_patch_size": 2, "model_type": "qwen2_vl"}
    cfg = vision_config_from_hf(qwen2, "qwen2_vl")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size) == (1280, 5120, 1536)
    assert cfg.hidden_act == "quick_gelu" and cfg.rope_theta == 10000.0
    qwen25 = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
              "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
              "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
              "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
              "temporal_patch_size": 2, "rope_theta": 5000.0}
    cfg = vision_config_from_hf(qwen25, "qwen2_5_vl")
    assert cfg.fullatt_block_indexes == (7, 15, 23, 31) and cfg.window_units == 4
    assert cfg.rope_theta == 5000.0 and cfg.out_hidden_size == 2048


@pytest.mark.parametrize("arch", sorted(HF))
def test_full_size_tower_builds_on_meta(arch):
    """Qwen2-VL-2B / Qwen2.5-VL-3B shapes: no compute, parameter count equals transformers'."""
    vision = (dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4)
              if arch == "qwen2_vl" else
              dict(depth=32, hidden_size=1280, out_hidden_size=2048, intermediate_size=3420,
                   num_heads=16, fullatt_block_indexes=[7, 15, 23, 31]))
    module = HF[arch][2]
    hf_model = (module.Qwen2VisionTransformerPretrainedModel if arch == "qwen2_vl"
                else module.Qwen2_5_VisionTransformerPretrainedModel)
    hf_config = (transformers.Qwen2VLConfig if arch == "qwen2_vl"
                 else transformers.Qwen2_5_VLConfig).sub_configs["vision_config"]
    with torch.device("meta"):
        hf = hf_model(hf_config(**vision))
        ours = VisionTower(vision_config_from_hf(vision, arch))
    assert all(p.is_meta for p in ours.parameters())
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("grid", [[[1, 8, 12]], GRID, [[1, 12, 12], [3, 6, 2], [1, 2, 14]]])
def test_plan_matches_transformers(grid):
    cfg = VisionConfig("qwen2_5_vl", depth=2, hidden_size=32, num_heads=4, intermediate_size=48,
                       out_hidden_size=24, patch_size=2, window_size=12)
    g = torch.tensor(grid)
    window_index, cu_windows = get_vision_window_index(g, 2, 12, 2)
    rows = (window_index[:, None] * 4 + torch.arange(4)).flatten()
    plan = plan_vision(cfg, g)
    assert torch.equal(plan.row_order, rows)
    assert torch.equal(plan.window_cu, cu_windows)
    assert torch.equal(plan.frame_cu, get_vision_cu_seqlens(g))
    assert torch.equal(plan.positions, get_vision_position_ids(g, 2)[rows])
    assert torch.equal(plan.unit_inverse, torch.argsort(window_index))


def _tiny(arch: str) -> VisionConfig:
    extra = dict(window_size=12, fullatt_block_indexes=(1,)) if arch == "qwen2_5_vl" else {}
    return VisionConfig(arch, depth=2, hidden_size=32, num_heads=4, intermediate_size=64,
                        out_hidden_size=24, patch_size=2, **extra)


@pytest.mark.parametrize("arch", sorted(HF))
def test_no_images(arch):
    tower = build_vision_tower(_tiny(arch), seed=5)
    pixels = torch.zeros(0, tower.cfg.patch_dim, requires_grad=True)
    out = tower(pixels, torch.zeros(0, 3, dtype=torch.int64))
    assert out.shape == (0, 24)
    out.sum().backward()


def test_init_is_seeded():
    a, b = build_vision_tower(_tiny("qwen2_5_vl"), seed=7), build_vision_tower(_tiny(
        "qwen2_5_vl"), seed=7)
    c = build_vision_tower(_tiny("qwen2_5_vl"), seed=8)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(),
                               strict=True):
        assert torch.equal(p, q), name
        if "norm" not in name and not name.endswith("w2.bias") and not name.endswith("wo.bias"):
            assert not torch.equal(p, r), name
    pixels, _ = _inputs(a.cfg, torch.float32)
    with torch.no_grad():
        assert torch.isfinite(a(pixels, GRID)).all()


BAD_INPUTS = [
    (lambda x: (x[:, :-1], GRID), r"pixel_values must be \[num_patches, 24\] \(in_channels 3"),
    (lambda x: (x[:-4], GRID), r"has 200 rows but grid_thw .* sum\(t\*h\*w\) = 204"),
    (lambda x: (x, [[1, 8, 12], [2, 4, 6], [1, 6, 9]]),
     r"grid_thw\[2\] = \[1, 6, 9\]: h and w must be multiples of the spatial merge size 2"),
    (lambda x: (x, [[1, 8, 12], [0, 4, 6], [1, 6, 10]]),
     r"grid_thw\[1\] = \[0, 4, 6\] must be three positive ints"),
    (lambda x: (x, torch.tensor(GRID, dtype=torch.float32)), r"grid_thw must hold integers"),
    (lambda x: (x, torch.tensor(GRID)[:, :2]), r"grid_thw must be \[num_images, 3\]"),
    (lambda x: (x.long(), GRID), r"pixel_values must be floating point"),
]


@pytest.mark.parametrize("make, match", BAD_INPUTS)
def test_bad_inputs_raise(make, match):
    tower = build_vision_tower(_tiny("qwen2_vl"))
    pixels, _ = _inputs(tower.cfg, torch.float32)
    with pytest.raises(ValueError, match=match):
        tower(*make(pixels))


def test_tp_must_divide_heads_and_widths():
    cfg = _tiny("qwen2_vl")
    with pytest.raises(ValueError, match=r"num_heads = 4 is not divisible by tp = 3; choose"):
        cfg.check_parallel(3)
    with pytest.raises(ValueError, match=r"num_heads = 4 is not divisible by tp = 8"):
        vision_shard_map(cfg, 8, 0)
    odd = VisionConfig("qwen2_vl", depth=1, hidden_size=32, num_heads=4, intermediate_size=34,
                       out_hidden_size=24)
    with pytest.raises(ValueError, match=r"intermediate_size = 34 is not divisible by tp = 4"):
        odd.check_parallel(4)


BAD_CONFIGS = [
    (dict(arch="qwen3_vl"), r"arch must be one of"),
    (dict(hidden_act="gelu"), r"qwen2_5_vl uses hidden_act='silu', got 'gelu'"),
    (dict(fullatt_block_indexes=(2,)), r"entry 2 is not a block index in \[0, depth=2\)"),
    (dict(num_heads=3), r"not divisible by num_heads 3"),
    (dict(num_heads=16), r"must be a multiple of 4"),
    (dict(window_size=3), r"window_size 3 is smaller than one merged unit"),
    (dict(depth=0), r"depth must be a positive integer"),
]


@pytest.mark.parametrize("change, match", BAD_CONFIGS)
def test_bad_configs_raise(change, match):
    base = dict(arch="qwen2_5_vl", depth=2, hidden_size=32, num_heads=4, intermediate_size=48,
                out_hidden_size=24, patch_size=2, window_size=12)
    with pytest.raises(ValueError, match=match):
        VisionConfig(**{**base, **change})


def test_hf_dict_errors_name_the_key():
    base = dict(depth=2, embed_dim=32, hidden_size=24, num_heads=4, mlp_ratio=2)
    with pytest.raises(ValueError, match=r"fullatt_block_indexes is a qwen2_5_vl feature"):
        VisionConfig("qwen2_vl", 2, 32, 4, 64, 24, fullatt_block_indexes=(0,))
    with pytest.raises(ValueError, match=r"hidden_act='gelu_pytorch_tanh'"):
        vision_config_from_hf({**base, "hidden_act": "gelu_pytorch_tanh"}, "qwen2_vl")
    with pytest.raises(ValueError, match=r"\['deepstack_visual_indexes'\]"):
        vision_config_from_hf({**base, "deepstack_visual_indexes": [1]}, "qwen2_vl")
    with pytest.raises(ValueError, match=r"rope_type='2d'"):
        vision_config_from_hf({**base, "rope_parameters": {"rope_type": "2d"}}, "qwen2_vl")
    with pytest.raises(ValueError, match=r"patch_size=\[14, 16\]"):
        vision_config_from_hf({**base, "patch_size": [14, 16]}, "qwen2_vl")
    with pytest.raises(ValueError, match=r"integer mlp_ratio"):
        hf_vision_config_dict(VisionConfig("qwen2_vl", 2, 32, 4, 48, 24))


def test_unknown_attention_kernel_raises():
    from mpcore.models.qwen2_vl import VisionConfig, VisionTower

    cfg = VisionConfig(arch="qwen2_vl", depth=1, hidden_size=16, num_heads=2,
                       intermediate_size=32, out_hidden_size=8, patch_size=2)
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        VisionTower(cfg, attention_kernel="ring")
