"""score.py in bfloat16 for every Qwen3.5 family on the CPU (text, MoE, VL, VL-MoE; tiny
checkpoints with 16-dim DeltaNet heads; text documents of 1, 2, 3, 77 and 300 tokens, the VL
families with images, a video and text-only documents): the model loads and scores in bf16
(once it crashed on a dtype mismatch), and its error against transformers in float64 is at
most twice transformers' own bf16 error plus a floor (max |difference| of log-probs and of
entropies). The GPU version, with fla's kernels, is tests/gpu/test_qwen35_score_gpu.py."""

import pytest
import torch

from tests.gpu.qwen35_hf_scores import FAMILIES, errors, hf_scores, make_checkpoint, ours


@pytest.mark.slow  # about 4 s per family on 2 cores
@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_scores_within_twice_transformers_bf16(family, tmp_path):
    kind, s = make_checkpoint(family, tmp_path, head_dim=16, lengths=[1, 2, 3, 77, 300])
    truth = hf_scores(tmp_path, kind, s, "cpu", torch.float64)
    mine = ours(tmp_path, s, torch.bfloat16, device="cpu")
    assert mine[0].dtype == torch.float64 and torch.isfinite(mine[0]).all()
    theirs = errors(hf_scores(tmp_path, kind, s, "cpu", torch.bfloat16), truth)
    err = errors(mine, truth)
    assert err[0] <= 2 * theirs[0] + 1e-2 and err[1] <= 2 * theirs[1] + 1e-2, (err, theirs)
    assert errors(ours(tmp_path, s, torch.float32, device="cpu"), truth)[0] <= 1e-4
