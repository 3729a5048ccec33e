"""Vision tower at tp = 2 and tp = 4 (gloo, fp32, CPU) vs tp = 1 and vs transformers.

One 4-process spawn runs every case (process groups are the expensive part), for both archs
(Qwen2-VL; Qwen2.5-VL with windows, partial ones included, and one full-attention block), on
two images in one call (8x12 patches and a 2-frame 4x6 video):
  - ``build_vision_tower`` from one seed at tp = 2 and tp = 4 holds the same logical weights
    as at tp = 1 (bitwise), and gives the same output (<= 1e-5) and the same gradient of every
    parameter, gathered to logical HF tensors (rel <= 1e-5);
  - the tower loaded from a transformers checkpoint at tp = 2 and 4 matches our tp = 1 load the
    same way, and transformers' own output (<= 1e-4) and gradients (rel <= 1e-5);
  - export at tp = 2 and 4 gives the checkpoint's tensors back.
transformers runs in the parent only (the spawned ranks do not import it).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mpcore.models.qwen2_vl import (
    build_vision_tower,
    export_vision_weights,
    load_vision_tower,
    vision_config_from_hf,
    vision_hf_tensors,
)
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.slow  # the vision tower at every tp

TEXT = dict(vocab_size=64, hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=32,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                             "rope_theta": 10000.0})
HF = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", dict(
        depth=2, embed_dim=32, hidden_size=24, num_heads=4, mlp_ratio=2, patch_size=2)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", dict(
        depth=3, hidden_size=32, out_hidden_size=24, intermediate_size=48, num_heads=4,
        patch_size=2, window_size=12, fullatt_block_indexes=[1])),
}
GRID = [[1, 8, 12], [2, 4, 6]]
NUM_PATCHES = sum(t * h * w for t, h, w in GRID)  # 144


def _inputs(patch_dim: int, out_dim: int):
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(NUM_PATCHES, patch_dim, generator=gen),
            torch.randn(NUM_PATCHES // 4, out_dim, generator=gen))


def _run(tower, pixels, cotangent):
    """Output and the gradient of every parameter, as full HF tensors (collective over tp)."""
    out = tower(pixels, torch.tensor(GRID))
    (out * cotangent).sum().backward()
    grads = {n: p.grad for n, p in tower.named_parameters()}
    return out.detach(), vision_hf_tensors(grads, tower.cfg, tower.tp_group)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _compare(got, want) -> dict:
    """Max output difference and the worst gradient (rel) of ``got`` against ``want``."""
    rel = {n: _rel(g, want[1][n]) for n, g in got[1].items()}
    worst = max(rel, key=rel.get)
    return {"out": float((got[0] - want[0]).abs().max()), "grad": rel[worst], "worst": worst,
            "names": set(got[1]) == set(want[1])}


def _worker(rank, world, checkpoints):
    states = {2: ParallelState.build(tp=2), 4: ParallelState.build(tp=4)}
    results = {}
    for arch, (folder, hf_out, hf_grads) in checkpoints.items():
        cfg = vision_config_from_hf(json.loads((folder / "config.json").read_text())[
            "vision_config"], arch)
        pixels, cotangent = _inputs(cfg.patch_dim, cfg.out_hidden_size)
        seeded = build_vision_tower(cfg, None, seed=11)
        seeded_weights = export_vision_weights(seeded)
        seeded_base = _run(seeded, pixels, cotangent)
        loaded_base = _run(load_vision_tower(folder, cfg), pixels, cotangent)
        saved = {k: v for k, v in load_file(folder / "model.safetensors").items()
                 if k.startswith("visual.")}
        results[(arch, 1, "hf")] = _compare(loaded_base, (hf_out, hf_grads))
        for tp, state in states.items():
            tower = build_vision_tower(cfg, state, seed=11)
            weights = export_vision_weights(tower)
            same_init = all(torch.equal(weights[k], v) for k, v in seeded_weights.items())
            results[(arch, tp, "seed")] = {**_compare(_run(tower, pixels, cotangent), seeded_base),
                                           "same_init": same_init}
            tower = load_vision_tower(folder, cfg, state)
            exported = export_vision_weights(tower)
            round_trip = set(exported) == set(saved) and all(
                torch.equal(exported[k], v) for k, v in saved.items())
            got = _run(tower, pixels, cotangent)
            results[(arch, tp, "load")] = {**_compare(got, loaded_base), "round_trip": round_trip}
            results[(arch, tp, "hf")] = _compare(got, (hf_out, hf_grads))
    return results


def _fresh_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm = name.endswith("weight") and ("norm" in name or "ln_q" in name)
            p.copy_(1.0 + 0.2 * noise if is_norm else 0.15 * noise)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (folder, transformers' fp32 output, its gradients by hub name)."""
    import transformers

    out = {}
    for arch, (config_name, model_name, vision) in HF.items():
        config = getattr(transformers, config_name)(text_config=TEXT, vision_config=vision)
        model = getattr(transformers, model_name)(config).eval()
        _fresh_weights(model, seed=5)
        folder = tmp_path_factory.mktemp(arch)
        model.save_pretrained(folder)
        visual = model.model.visual
        patch_dim = 3 * 2 * 2 * 2
        pixels, cotangent = _inputs(patch_dim, 24)
        ref = visual(pixels, grid_thw=torch.tensor(GRID)).pooler_output
        (ref * cotangent).sum().backward()
        grads = {"visual." + n: p.grad.clone() for n, p in visual.named_parameters()}
        out[arch] = (folder, ref.detach(), grads)
    return out


def test_vision_tower_same_function_at_every_tp(checkpoints):
    results = run_distributed(_worker, 4, checkpoints)
    for rank, by_case in enumerate(results):
        for (arch, tp, kind), r in by_case.items():
            where = f"rank {rank} {arch} tp={tp} {kind}: {r}"
            assert r["names"], where
            assert r["out"] <= (1e-4 if kind == "hf" else 1e-5), where
            assert r["grad"] <= 1e-5, where
            assert r.get("same_init", True) and r.get("round_trip", True), where
