"""VLModel on CUDA (flash attention in the tower and decoder in bf16, Triton kernels) vs
transformers: fp32 against transformers in float64 on the CPU (the numerics policy), bf16 judged
against transformers' own bf16 run on the GPU (our error vs float64 at most twice theirs, plus a
small floor). The tiny models and the packed image-text stream are those of the CPU tests."""

from __future__ import annotations

import pytest
import torch

from mpcore.models.qwen2_vl.hf import load_hf_vl_model
from mpcore.models.qwen2_vl.inputs import local_vl_inputs
from mpcore.parallel.state import ParallelState
from tests.dist.hf_vl_tiny import _load, reference_scores, save_hf_vl_model, vl_stream
from tests.gpu.gpu_checks import second_run_never_syncs

pytestmark = pytest.mark.gpu


def _ours(folder, dtype, ids, cu, pixels, grid):
    state = ParallelState.build()
    model, cfg = load_hf_vl_model(folder, state, device="cuda")
    _, inputs = local_vl_inputs(state, ids.cuda(), cu.cuda(), cfg, pixel_values=pixels.cuda(),
                                image_grid_thw=grid)
    with torch.no_grad(), torch.autocast("cuda", dtype, enabled=dtype != torch.float32):
        logprobs, _ = model(**inputs, output="logprobs")
    return logprobs.double().cpu()


def _hf_bf16(folder, ids, cu, pixels, grid, per_doc):
    model = _load(folder).to("cuda", torch.bfloat16)
    out = torch.zeros(ids.numel(), dtype=torch.float64)
    from tests.dist.hf_vl_tiny import IMAGE, _doc_inputs, _doc_logits

    with torch.no_grad():
        for d in range(cu.numel() - 1):
            doc, pix, g, a, b = _doc_inputs(ids, cu, pixels, grid, per_doc, d)
            logp = torch.log_softmax(_doc_logits(model, doc.cuda(), pix.cuda().bfloat16(),
                                                 g.cuda()), -1).cpu()
            target = logp[:-1].gather(1, doc[1:, None])[:, 0]
            out[a:b - 1] = torch.where(doc[1:] == IMAGE, 0.0, target)
    return out


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_vl_model_on_cuda(arch, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    save_hf_vl_model(arch, seed=0, folder=tmp_path)
    ids, cu, pixels, grid, per_doc = vl_stream(seed=1)
    ref, _ = reference_scores(tmp_path, ids, cu, pixels, grid, per_doc)
    fp32 = _ours(tmp_path, torch.float32, ids, cu, pixels, grid)
    assert float((fp32 - ref).abs().max()) <= 1e-4
    ours = float((_ours(tmp_path, torch.bfloat16, ids, cu, pixels, grid) - ref).abs().max())
    theirs = float((_hf_bf16(tmp_path, ids, cu, pixels, grid, per_doc) - ref).abs().max())
    assert ours <= 2 * theirs + 2e-2, (ours, theirs)


def test_placed_step_never_waits_for_the_gpu(tmp_path):
    """A VL training step's forward and backward, inputs placed as the trainer places them
    (``mpcore.batches.place``: pinned asynchronous copies that keep the host copies the
    placeholder checks read), make no CPU-GPU sync, so the host queues a step while the
    device still runs the last one. The checked run equals the first one, made unchecked."""
    from mpcore.batches import place
    from mpcore.models.registry import family_of

    save_hf_vl_model("qwen2_vl", seed=0, folder=tmp_path)
    state = ParallelState.build()
    model, cfg = load_hf_vl_model(tmp_path, state, device="cuda")
    ids, cu, pixels, grid, _ = vl_stream(seed=1)

    def step():
        _, local = local_vl_inputs(state, ids, cu, cfg, pixel_values=pixels,
                                   image_grid_thw=grid)
        inputs = place(local, family_of(cfg), torch.device("cuda"))
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(**inputs, output="loss").sum()
        loss.backward()
        return loss.detach()

    expected, got = second_run_never_syncs(step, model.zero_grad)
    assert torch.equal(got, expected)
