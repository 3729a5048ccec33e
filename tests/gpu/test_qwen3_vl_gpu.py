"""Qwen3-VL on CUDA (the tower's and decoder's flash attention in bf16, Triton kernels) vs
transformers: fp32 against transformers in float64 on the CPU (the numerics policy), bf16 judged
against transformers' own bf16 run on the GPU (our error vs float64 at most twice theirs, plus a
small floor). The tiny model and the packed stream (images of several grids, a video, text-only
documents) are those of the CPU tests (tests/dist/hf_qwen3_vl_tiny.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.qwen3_vl.config import Qwen3VisionConfig
from mpcore.models.common.qwen3_vl.vision import Qwen3VisionTower
from mpcore.models.qwen3_vl import load_hf_model, local_inputs
from mpcore.parallel.state import ParallelState
from tests.dist.hf_qwen3_vl_tiny import (
    IMAGE,
    VIDEO,
    doc_inputs,
    load,
    reference_scores,
    save_hf_model,
    stream,
)
from tests.gpu.gpu_checks import second_run_never_syncs

pytestmark = pytest.mark.gpu
VISION = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _ours(folder, dtype, s: dict) -> torch.Tensor:
    state = ParallelState.build()
    model, cfg = load_hf_model(folder, state, device="cuda")
    cuda = {k: (v.cuda() if k.startswith("pixel") and v is not None else v)
            for k, v in s.items() if k in VISION}
    _, inputs = local_inputs(state, s["input_ids"].cuda(), s["cu_seqlens"].cuda(), cfg, **cuda)
    with torch.no_grad(), torch.autocast("cuda", dtype, enabled=dtype != torch.float32):
        logprobs, _ = model(**inputs, output="logprobs")
    return logprobs.double().cpu()


def _hf_bf16(folder, s: dict) -> torch.Tensor:
    model = load(folder, torch.bfloat16).to("cuda")
    out = torch.zeros(s["input_ids"].numel(), dtype=torch.float64)
    with torch.no_grad():
        for d in range(len(s["per_doc"])):
            kwargs, a, b = doc_inputs(s, d, torch.bfloat16)
            doc = kwargs["input_ids"][0]
            kwargs = {k: v.cuda() for k, v in kwargs.items()}
            logp = F.log_softmax(model(**kwargs).logits[0].double(), -1).cpu()
            target = logp[:-1].gather(1, doc[1:, None])[:, 0]
            placeholder = (doc[1:] == IMAGE) | (doc[1:] == VIDEO)
            out[a:b - 1] = torch.where(placeholder, 0.0, target)
    return out


def test_qwen3_vl_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    save_hf_model(seed=0, folder=tmp_path)
    s = stream(seed=1)
    ref, _ = reference_scores(tmp_path, s)
    fp32 = _ours(tmp_path, torch.float32, s)
    assert float((fp32 - ref).abs().max()) <= 1e-4
    ours = float((_ours(tmp_path, torch.bfloat16, s) - ref).abs().max())
    theirs = float((_hf_bf16(tmp_path, s) - ref).abs().max())
    assert ours <= 2 * theirs + 2e-2, (ours, theirs)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_tower_forward_never_waits_for_the_gpu(kernel):
    """The tower's host-built tables (position taps, rotary positions, attention segments)
    reach the GPU through pinned asynchronous copies (mpcore.kernels.host_checked.copy_to): its
    forward and backward make no host sync, so the host can run ahead of the device. The
    checked run equals the first one, made outside the check."""
    cfg = Qwen3VisionConfig(depth=2, hidden_size=128, num_heads=2, intermediate_size=256,
                            out_hidden_size=64, patch_size=2, temporal_patch_size=2,
                            spatial_merge_size=2, in_channels=3, num_position_embeddings=64,
                            deepstack_visual_indexes=(0,))
    torch.manual_seed(0)
    with torch.device("meta"):
        tower = Qwen3VisionTower(cfg, attention_kernel=kernel)
    tower.to_empty(device="cuda")
    init_weights(tower, seed=0)
    grid = [[1, 8, 12], [3, 4, 6], [1, 6, 10]]
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), cfg.patch_dim, device="cuda")

    def run():
        with torch.autocast("cuda", torch.bfloat16):
            out = tower.rows(pixels, grid)
        out.float().square().sum().backward()
        return out.detach().float()

    expected, got = second_run_never_syncs(run, tower.zero_grad)
    assert torch.equal(got, expected)
