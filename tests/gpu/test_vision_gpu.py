"""Vision tower on CUDA: flash and cuDNN segment attention and the bf16 tower vs references.

- The flash path (non-causal varlen, one call over all segments) vs the SDPA reference path on
  the same bf16 q, k, v (frames and Qwen2.5-VL windows of three images): forward and backward,
  both judged against the reference run in fp32 (rel <= 1e-2, flash error <= 2x the bf16
  reference's + a floor), and the flash kernel is actually called.
- Whole towers loaded from a transformers checkpoint: fp32 on CUDA vs transformers in float64
  on the CPU (output <= 1e-4 abs, gradients rel <= 1e-4); bf16 (flash, Triton RMSNorm, RoPE,
  SwiGLU) judged against transformers' own bf16 run on the GPU: our error vs float64 may not
  exceed twice theirs plus a floor, for the output and every parameter's gradient.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from mpcore.models.common.vision_attention import Segments, attention_reference, segment_attention
from mpcore.models.qwen2_vl import (
    load_vision_tower,
    plan_vision,
    vision_config_from_hf,
    vision_shard_map,
)
from mpcore.models.qwen2_vl.vision_hf import shard_from_full
from mpcore.parallel.attention import flash

pytestmark = pytest.mark.gpu

TEXT = dict(vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=64,
            rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12],
                             "rope_theta": 10000.0})
HF = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", dict(
        depth=2, embed_dim=256, hidden_size=128, num_heads=4, mlp_ratio=2)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", dict(
        depth=3, hidden_size=256, out_hidden_size=128, intermediate_size=512, num_heads=4,
        window_size=112, fullatt_block_indexes=[1])),
}
# 16x24, 8x10 (two frames) and 14x14 merged units: 4-unit windows, partial ones included.
GRID = [[1, 32, 48], [2, 16, 20], [1, 28, 28]]
NUM_PATCHES = sum(t * h * w for t, h, w in GRID)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _attend(fn, q, k, v, segments, cotangent):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, segments, q.shape[-1] ** -0.5)
    (out.float() * cotangent).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("which", ["frames", "windows"])
def test_flash_segments_match_reference(which, kernel, monkeypatch):
    cfg = vision_config_from_hf(HF["qwen2_5_vl"][2], "qwen2_5_vl")
    plan = plan_vision(cfg, GRID)
    cu, max_len = ((plan.frame_cu, plan.max_frame) if which == "frames"
                   else (plan.window_cu, plan.max_window))
    calls = []
    original = flash.flash_forward
    monkeypatch.setattr(flash, "flash_forward",
                        lambda *a, **kw: calls.append(1) or original(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(NUM_PATCHES, 4, 64, device="cuda", generator=gen).bfloat16()
               for _ in range(3))
    cotangent = torch.randn(NUM_PATCHES, 4, 64, device="cuda", generator=gen)
    segments = Segments(cu, max_len, torch.device("cuda"))
    got = _attend(lambda *a: segment_attention(*a, kernel=kernel), q, k, v, segments,
                  cotangent)
    assert bool(calls) == (kernel == "flash"), "the flash kernel ran iff asked for"
    ref16 = _attend(attention_reference, q, k, v, segments, cotangent)
    ref32 = _attend(attention_reference, q.float(), k.float(), v.float(), segments, cotangent)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, ref16, ref32, strict=True):
        assert a.dtype == torch.bfloat16, name
        err, base = _rel(a, c), _rel(b, c)
        assert err <= 1e-2 and err <= 2 * base + 2e-3, (name, err, base)


@pytest.fixture(scope="module", params=sorted(HF))
def checkpoint(request, tmp_path_factory):
    """(arch, folder, config, inputs, fp64 CPU reference, transformers bf16 GPU run)."""
    import transformers

    arch = request.param
    config_name, model_name, vision = HF[arch]
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(
        text_config=TEXT, vision_config=vision)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm = name.endswith("weight") and ("norm" in name or "ln_q" in name)
            p.copy_(1.0 + 0.2 * noise if is_norm else 0.04 * noise)
    folder = tmp_path_factory.mktemp(arch)
    model.save_pretrained(folder)
    cfg = vision_config_from_hf(json.loads((folder / "config.json").read_text())[
        "vision_config"], arch)
    pixels = torch.randn(NUM_PATCHES, cfg.patch_dim, generator=gen)
    cotangent = torch.randn(NUM_PATCHES // 4, cfg.out_hidden_size, generator=gen)
    visual = model.model.visual
    ref64 = _hf_run(copy.deepcopy(visual).double(), pixels, cotangent)
    hf16 = _hf_run(copy.deepcopy(visual).to("cuda", torch.bfloat16), pixels, cotangent)
    return arch, folder, cfg, (pixels, cotangent), ref64, hf16


def _hf_run(visual, pixels, cotangent):
    device, dtype = visual.patch_embed.proj.weight.device, visual.patch_embed.proj.weight.dtype
    out = visual(pixels.to(device, dtype), grid_thw=torch.tensor(GRID, device=device))
    (out.pooler_output.double() * cotangent.to(device).double()).sum().backward()
    grads = {"visual." + n: p.grad.double().cpu() for n, p in visual.named_parameters()}
    return out.pooler_output.detach().double().cpu(), grads


def _ours(folder, cfg, dtype, pixels, cotangent):
    tower = load_vision_tower(folder, cfg, device="cuda", dtype=dtype)
    out = tower(pixels.cuda(), GRID)
    assert out.dtype == dtype
    (out.double() * cotangent.cuda().double()).sum().backward()
    return out.detach().double().cpu(), {n: p.grad for n, p in tower.named_parameters()}


def test_fp32_tower_on_cuda_matches_float64(checkpoint):
    _, folder, cfg, (pixels, cotangent), (ref, ref_grads), _ = checkpoint
    out, grads = _ours(folder, cfg, torch.float32, pixels, cotangent)
    assert (out - ref).abs().max() <= 1e-4
    table = vision_shard_map(cfg, 1, 0)
    for name, g in grads.items():
        rel = _rel(g, shard_from_full(ref_grads, table[name]))
        assert rel <= 1e-4, (name, rel)


def test_bf16_tower_within_twice_transformers_error(checkpoint):
    _, folder, cfg, (pixels, cotangent), (ref, ref_grads), (hf16, hf16_grads) = checkpoint
    out, grads = _ours(folder, cfg, torch.bfloat16, pixels, cotangent)
    err, theirs = _rel(out, ref), _rel(hf16, ref)
    assert err <= 2 * theirs + 1e-3, (err, theirs)
    table = vision_shard_map(cfg, 1, 0)
    for name, g in grads.items():
        want = shard_from_full(ref_grads, table[name])
        err, theirs = _rel(g, want), _rel(shard_from_full(hf16_grads, table[name]), want)
        assert err <= 1e-2 or err <= 2 * theirs + 1e-3, (name, err, theirs)
