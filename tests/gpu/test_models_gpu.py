"""Models on CUDA (Triton RMSNorm and loss heads, flash attention in 16-bit) vs transformers.

References: transformers in float64 on the CPU, per document. fp32 must match to the numerics
policy; bf16 is judged against transformers' own bf16 run on the GPU: our error vs float64 may
not exceed twice theirs (plus a small floor). With two or more GPUs, launch/score.py also runs
under torchrun with nccl at tp=2 and at cp=2 (ulysses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mpcore.launch.score import score_stream
from mpcore.models import local_text_inputs
from mpcore.models.llama.hf import load_hf_model
from mpcore.parallel.state import ParallelState

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
VOCAB = 1000
LENGTHS = [37, 100, 1, 64, 15]
BASE = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=512, rms_norm_eps=1e-5)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=64, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("hf_gpu")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=gen)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    out = {}
    for family, (model_name, config_name, extra) in FAMILIES.items():
        config = getattr(transformers, config_name)(**BASE, **extra)
        model = getattr(transformers, model_name)(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.06 * noise)
        model.save_pretrained(root / family)
        ref64 = _hf_scores(model.double(), ids, cu)
        gpu16 = _hf_scores(model.to("cuda", torch.bfloat16), ids.cuda(), cu)
        out[family] = (str(root / family), ref64, gpu16)
    return ids, cu, out


def _hf_scores(model, ids, cu):
    """Per-token (logprobs, entropy) float64 on the CPU, per document (last token: logprob 0)."""
    logprobs = torch.zeros(ids.numel(), dtype=torch.float64)
    entropy = torch.zeros(ids.numel(), dtype=torch.float64)
    with torch.no_grad():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            logp = F.log_softmax(model(ids[None, a:b]).logits[0].double(), -1).cpu()
            entropy[a:b] = -(logp.exp() * logp).sum(-1)
            logprobs[a:b - 1] = logp[:-1].gather(1, ids[a + 1:b, None].cpu())[:, 0]
    return logprobs, entropy


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_on_cuda(setup, family, dtype):
    ids, cu, families = setup
    folder, (ref_lp, ref_ent), (hf16_lp, hf16_ent) = families[family]
    model, _ = load_hf_model(folder, ParallelState(), device="cuda", dtype=dtype)
    logprobs, entropy = score_stream(model, ParallelState(), ids.cuda(), cu.cuda())
    err_lp = (logprobs.double().cpu() - ref_lp).abs().max().item()
    err_ent = (entropy.double().cpu() - ref_ent).abs().max().item()
    if dtype == torch.float32:
        assert err_lp <= 1e-4 and err_ent <= 1e-4, (err_lp, err_ent)
    else:
        hf_lp = (hf16_lp - ref_lp).abs().max().item()
        hf_ent = (hf16_ent - ref_ent).abs().max().item()
        assert err_lp <= 2 * hf_lp + 1e-2 and err_ent <= 2 * hf_ent + 1e-2, (
            err_lp, hf_lp, err_ent, hf_ent)


def test_grads_on_cuda_fp32(setup):
    """Loss and gradients at fp32 on CUDA equal those on the CPU (same code, CPU references)."""
    ids, cu, families = setup
    folder = families["qwen3"][0]
    grads = []
    for device in ("cpu", "cuda"):
        model, _ = load_hf_model(folder, ParallelState(), device=device)
        _, inputs = local_text_inputs(ParallelState(), ids.to(device), cu.to(device))
        loss = model(**inputs, output="loss").sum() / (ids.numel() - len(LENGTHS))
        loss.backward()
        grads.append({n: p.grad.double().cpu() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        rel = ((grads[1][name] - g).norm() / g.norm()).item()
        assert rel <= 1e-4, (name, rel)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("layout", [("2", "1", "ring"), ("1", "2", "ulysses")])
def test_score_script_two_gpus(setup, tmp_path, layout):
    ids, cu, families = setup
    folder, (ref_lp, _), (hf16_lp, _) = families["llama"]
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"input_ids": ids[a:b].tolist()}) + "\n" for a, b in bounds))
    tp, cp, mode = layout
    for dtype in ("float32", "bfloat16"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(REPO / "launch" / "score.py"),
               "--hf-checkpoint", folder, "--tp", tp, "--cp", cp, "--cp-mode", mode,
               "--dtype", dtype, "--input", str(tmp_path / "in.jsonl"),
               "--output", str(tmp_path / "out.jsonl")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        got = torch.tensor([v for r in rows for v in [*r["logprobs"], 0.0]], dtype=torch.float64)
        err = (got - ref_lp).abs().max().item()
        bound = 1e-4 if dtype == "float32" else 2 * (hf16_lp - ref_lp).abs().max().item() + 1e-2
        assert err <= bound, (layout, dtype, err, bound)


def test_autocast_residual_stream_on_cuda(setup):
    """``residual_dtype="autocast"`` under bf16 autocast on CUDA (the Triton add + norm on a bf16
    stream, both ways): the layers see bf16, the loss and every gradient stay within bf16
    rounding of the fp32-stream run's (the same model, the same tokens), and the fp32 master
    weights get fp32 gradients."""
    ids, cu, families = setup
    folder = families["llama"][0]
    runs = []
    for residual in ("float32", "autocast"):
        model, _ = load_hf_model(folder, ParallelState(), device="cuda")
        model.residual_dtype = residual
        seen = []
        model.layers[1].register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0].dtype))
        _, inputs = local_text_inputs(ParallelState(), ids.cuda(), cu.cuda())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**inputs, output="loss").sum() / (ids.numel() - len(LENGTHS))
        loss.backward()
        runs.append((seen, loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (seen32, loss32, grads32), (seen16, loss16, grads16) = runs
    assert seen32 == [torch.float32] and seen16 == [torch.bfloat16]
    assert abs(loss16 - loss32) <= 1e-2 * abs(loss32), (loss16, loss32)
    for name, g in grads32.items():
        assert grads16[name].dtype == torch.float32, name
        rel = ((grads16[name] - g).norm() / g.norm()).item()
        assert rel <= 5e-2, (name, rel)
