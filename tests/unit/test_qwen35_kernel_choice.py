"""Which Gated DeltaNet kernel runs, and why (``mpcore.models.common.hybrid.kernels.choose``):
the line score.py and pretrain log, the fallbacks of ``gdn_kernel=auto`` and the errors of a
named ``fla`` (no CUDA, fla-core missing, fla refusing the GPU and Triton, unsupported head
sizes). fla-core itself is CUDA-only; its presence and refusals are stood in for by patching
the one module that detects it."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpcore.models import describe_kernels
from mpcore.models.common.hybrid import deltanet, kernels
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.hybrid.layers import GatedDeltaNet
from mpcore.models.common.hybrid.model import build
from mpcore.parallel.state import ParallelState

CFG = Qwen35Config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=16, intermediate_size=48, linear_num_key_heads=2,
                   linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fla_present(monkeypatch):
    """fla-core importable (its ops never called here), running on this GPU."""
    monkeypatch.setattr(kernels, "fla_ops", lambda: (None, None, None))
    monkeypatch.setattr(kernels, "fla_version", lambda: "fla-core 0.6.0 on Triton 3.7.1")
    monkeypatch.setattr(kernels, "fla_refusal", lambda index: None)


def test_auto_choices_and_reasons(fla_present, monkeypatch):
    assert kernels.choose("auto", CUDA, torch.bfloat16, 128, 128) == (
        "fla", "gdn_kernel=auto, fla-core 0.6.0 on Triton 3.7.1, bfloat16")
    kernel, why = kernels.choose("auto", CUDA, torch.float32, 128, 128)
    assert kernel == "reference" and "TF32" in why
    kernel, why = kernels.choose("auto", "cpu", torch.bfloat16, 128, 128)
    assert kernel == "reference" and "CUDA-only" in why
    kernel, why = kernels.choose("auto", CUDA, torch.bfloat16, 512, 128)
    assert kernel == "reference" and "key dim 512" in why and "16..256" in why
    monkeypatch.setattr(kernels, "fla_refusal", lambda index: "RuntimeError: Triton too old")
    kernel, why = kernels.choose("auto", CUDA, torch.bfloat16, 128, 128)
    assert kernel == "reference" and "Triton too old" in why and "triton==3.7.1" in why
    monkeypatch.setattr(kernels, "fla_ops", lambda: None)
    kernel, why = kernels.choose("auto", CUDA, torch.bfloat16, 128, 128)
    assert kernel == "reference" and "not installed" in why and "pip install fla-core" in why
    assert kernels.choose("reference", CUDA, torch.bfloat16, 128, 128)[0] == "reference"


def test_named_fla_errors_name_the_reason_and_the_install(fla_present, monkeypatch):
    assert kernels.choose("fla", CUDA, torch.bfloat16, 128, 128)[0] == "fla"
    with pytest.raises(ValueError, match="key dim 512.*16..256.*gdn_kernel='auto'"):
        kernels.choose("fla", CUDA, torch.bfloat16, 512, 128)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        kernels.choose("fla", "cpu", torch.bfloat16, 128, 128)
    monkeypatch.setattr(kernels, "fla_refusal", lambda index: "RuntimeError: Triton too old")
    with pytest.raises(ValueError, match="refuses this GPU and Triton: RuntimeError: Triton too "
                                         "old; pip install fla-core==0.6.0 triton==3.7.1"):
        kernels.check_available("fla", CUDA)
    monkeypatch.setattr(kernels, "fla_ops", lambda: None)
    with pytest.raises(ValueError, match="not installed; pip install fla-core"):
        kernels.check_available("fla", CUDA)


def test_layer_refuses_unsupported_heads_only_when_fla_is_named():
    cfg = dataclasses.replace(CFG, linear_key_head_dim=8)
    with pytest.raises(ValueError, match="key dim 8.*gdn_kernel='auto' or 'reference'"):
        GatedDeltaNet(cfg, tp_group=None, sequence_parallel=False, gdn_kernel="fla")
    layer = GatedDeltaNet(cfg, tp_group=None, sequence_parallel=False, gdn_kernel="auto")
    assert "reference" in layer.describe_kernel(CUDA, torch.bfloat16)


def test_describe_kernels_one_line_per_choice(fla_present):
    model = build(CFG, ParallelState())
    assert describe_kernels(model, CUDA, torch.bfloat16) == [
        "Gated DeltaNet kernel: fla chunk (Triton); gdn_kernel=auto, fla-core 0.6.0 on "
        "Triton 3.7.1, bfloat16"]
    (line,) = describe_kernels(model, "cpu", torch.float32)
    assert line.startswith("Gated DeltaNet kernel: reference") and "CUDA-only" in line


def test_score_script_prints_the_kernel(tmp_path):
    """score.py on the CPU names the reference and why, once, before scoring."""
    from mpcore.models.common.hybrid.hf import export_hf

    model = build(CFG, ParallelState(), seed=1)
    export_hf(model, ParallelState(), tmp_path / "ckpt")
    (tmp_path / "in.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(repo / "launch" / "score.py"), "--hf-checkpoint",
                           str(tmp_path / "ckpt"), "--input", str(tmp_path / "in.jsonl"),
                           "--output", str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stdout.splitlines() if "Gated DeltaNet kernel" in x]
    assert lines == ["score.py: Gated DeltaNet kernel: reference (PyTorch chunked, fp32 math); "
                     "gdn_kernel=auto on cpu: fla-core's kernels are CUDA-only"]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_fla_probe_runs_its_backward_under_a_callers_no_grad(mode):
    """score.py asks first, under ``inference_mode``: the probe's backward must still run (on
    the H200 it failed there with 'does not require grad', and the cached refusal made every
    later Qwen3.5 layer of the process take the reference). A stand-in rule with fla's
    signature, on the CPU; a real fla error still comes back as the refusal."""
    def rule(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens):
        return (q * k * v).sum(-1, keepdim=True) * beta[..., None] + g[..., None], None

    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        assert kernels.probe(rule, torch.device("cpu")) is None

    def refusing(*args, **kwargs):
        raise RuntimeError("Triton too old")

    assert kernels.probe(refusing, torch.device("cpu")) == "RuntimeError: Triton too old"


@pytest.mark.parametrize("takes_host", [True, False])
def test_fla_gets_the_segments_host_copy_when_it_takes_one(monkeypatch, takes_host):
    # The batch's host copy of cu_seqlens reaches fla's conv and delta rule as cu_seqlens_cpu
    # (they then plan chunks without a device sync); an fla without that argument gets none.
    from mpcore.batches import to_device
    from mpcore.models.common.hybrid import cp as deltanet_cp
    from mpcore.parallel.attention import AttentionPlan
    seen = []
    if takes_host:  # fla-core 0.6's signatures name the host copy
        def conv(x, weight, activation=None, cu_seqlens=None, cu_seqlens_cpu=None):
            seen.append(("conv", cu_seqlens, {"cu_seqlens_cpu": cu_seqlens_cpu}))
            return x

        def rule(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None,
                 use_qk_l2norm_in_kernel=False):
            seen.append(("rule", cu_seqlens, {"cu_seqlens_cpu": cu_seqlens_cpu}))
            return v, None
    else:
        def conv(x, weight, activation=None, cu_seqlens=None, **rest):
            seen.append(("conv", cu_seqlens, rest))
            return x

        def rule(q, k, v, g, beta, cu_seqlens=None, use_qk_l2norm_in_kernel=False, **rest):
            seen.append(("rule", cu_seqlens, rest))
            return v, None

    monkeypatch.setattr(kernels, "fla_ops", lambda: (rule, conv, None))
    kernels._host_segments_taken.cache_clear()  # and again at the end: it read the stand-ins
    cu_host = torch.tensor([0, 3, 7], dtype=torch.int32)
    batch = to_device({"cu_seqlens": cu_host}, torch.device("cpu"), -100)
    doc, pos = torch.tensor([0] * 3 + [1] * 4), torch.tensor([0, 1, 2, 0, 1, 2, 3])
    seq = deltanet_cp.sequence_of(AttentionPlan(doc, pos, batch["cu_seqlens"]), "cpu")
    assert seq.cu_host.tolist() == [0, 3, 7] and seq.cu_host.dtype == torch.int64
    x = torch.randn(7, 4)
    kernels.short_conv(x, torch.randn(4, 2), seq.positions, seq.cu_seqlens, "fla", seq.cu_host)
    kernels.gated_delta_rule(x.view(7, 1, 4), x.view(7, 1, 4), x.view(7, 1, 4), x[:, :1],
                             x[:, :1], seq.cu_seqlens, "fla", seq.cu_host)
    kernels._host_segments_taken.cache_clear()
    assert [name for name, *_ in seen] == ["conv", "rule"]
    for _, cu, rest in seen:
        assert cu.tolist() == [0, 3, 7] and cu.dtype == torch.int64
        assert (rest.get("cu_seqlens_cpu") is seq.cu_host) if takes_host else not rest
    # Without cu_seqlens the segments are found from doc_id, on the host as well.
    seq = deltanet_cp.sequence_of(AttentionPlan(doc, pos), "cpu")
    assert seq.cu_host.tolist() == seq.cu_seqlens.tolist() == [0, 3, 7]


def test_fla_conv_gets_the_weight_in_its_own_dtype(monkeypatch):
    # fla's conv reads its weight into fp32 and sums the weight's gradient in fp32: an fp32
    # weight under bf16 operands must reach it unrounded, as it reaches the reference (a bf16
    # copy was one rounding that every token shared; at 32k it moved A_log's gradient). The
    # stand-in computes with exactly what it was given, so the two paths agree bit for bit
    # only if the weight and its gradient went through unrounded.
    cu = torch.tensor([0, 5, 13])
    pos = deltanet.segment_positions(cu, 13)
    given = []

    def conv(x, weight, activation=None, cu_seqlens=None, cu_seqlens_cpu=None):
        given.append(weight)
        return deltanet.causal_conv1d(x[0], weight, pos)[None], None

    monkeypatch.setattr(kernels, "fla_ops", lambda: (None, conv, None))
    kernels._host_segments_taken.cache_clear()
    try:
        x = torch.randn(13, 6, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(6, 4, requires_grad=True)
        upstream = torch.randn(13, 6, dtype=torch.bfloat16)
        outs = [kernels.short_conv(x, weight, pos, cu, kernel) for kernel in ("fla", "reference")]
        grads = [torch.autograd.grad(out, (x, weight), upstream) for out in outs]
    finally:
        kernels._host_segments_taken.cache_clear()
    assert given[0].dtype == torch.float32
    assert torch.equal(outs[0], outs[1]) and outs[0].dtype == torch.bfloat16
    assert grads[0][1].dtype == torch.float32
    for a, b in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, b)
