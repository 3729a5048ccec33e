"""Benchmark: Qwen3.5 text training steps, mpcore vs transformers, and the DeltaNet layer vs fla.

Usage (one GPU; fla-core installed so both sides take its kernels):
    python -m tests.perf.bench_qwen35 [OUT.json] [--config HF_CONFIG.json] [--seq 8192]
        [--steps 10] [--warmup 3] [--skip-hf]

``--config``: a Qwen3.5 ``config.json`` (default: the Qwen3.5-0.8B shape,
tests/dist/qwen35_0p8b_config.json; its text decoder is what runs). Both sides: fp32 parameters,
bf16 autocast on CUDA (fp32 on CPU), one document of ``--seq`` random tokens per step, AdamW
(fused on CUDA) with lr 1e-4, gradient clipping at 1.0. mpcore: ``mpcore.models.common.hybrid.model.build``
(``gdn_kernel=auto``: fla when installed), the training head's ``loss_sum`` output over the
valid tokens. transformers: ``Qwen3_5ForCausalLM`` of the same config (SDPA attention; its own
fla path when fla is installed), ``labels`` loss.

Reported per side: median step time over ``--steps`` (after ``--warmup``), tokens/s, peak
allocated memory (reset between sides; null on CPU), first and last loss. ``layer``: one
``GatedDeltaNet`` forward + backward on ``[seq, hidden]`` bf16 vs fla's ``causal_conv1d`` +
``chunk_gated_delta_rule`` called directly on the same shapes (``overhead`` = ours / fla - 1:
the projections, gates, norm and layout around the kernels); null without CUDA and fla.
JSON goes to OUT (default tests/perf/results/qwen35_h200.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.hybrid import kernels
from mpcore.models.common.hybrid.hf import config_from_hf, text_fields
from mpcore.models.common.hybrid.layers import GatedDeltaNet
from mpcore.models.common.hybrid.model import build
from mpcore.models.common.inputs import local_text_inputs
from mpcore.parallel.attention import AttentionPlan
from mpcore.parallel.state import ParallelState
from tests.perf.step_timing import adamw, autocast, timed

REPO = Path(__file__).resolve().parents[2]

DEFAULT_OUT = Path(__file__).parent / "results" / "qwen35_h200.json"
DEFAULT_CONFIG = REPO / "tests" / "dist" / "qwen35_0p8b_config.json"


def bench_mpcore(hf: dict, batches, device, steps, warmup) -> dict:
    cfg = config_from_hf(hf)
    state = ParallelState()
    model = build(cfg, state, seed=0, device=device)
    opt = adamw(model.parameters(), device)
    it = iter(batches)

    def step() -> float:
        ids = next(it).to(device)
        cu = torch.tensor([0, ids.numel()], device=device)
        _, inputs = local_text_inputs(state, ids, cu)
        with autocast(device):
            loss = model(**inputs, output="loss_sum") / (ids.numel() - 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    out = timed(step, steps, warmup, device)
    out["gdn_kernel"] = kernels.resolve("auto", torch.empty(1, device=device,
                                                            dtype=torch.bfloat16))
    return out


def bench_hf(hf: dict, batches, device, steps, warmup) -> dict:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text = {k: v for k, v in text_fields(hf).items()
            if k not in ("attn_output_gate", "mtp_num_hidden_layers", "model_type")}
    model = Qwen3_5ForCausalLM._from_config(Qwen3_5TextConfig(**text),
                                            attn_implementation="sdpa").to(device)
    model.train()
    opt = adamw(model.parameters(), device)
    it = iter(batches)

    def step() -> float:
        ids = next(it).to(device)[None]
        with autocast(device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return timed(step, steps, warmup, device)


def bench_layer(hf: dict, seq: int, device, steps, warmup) -> dict | None:
    """Our DeltaNet layer vs fla's two kernels alone, forward + backward, bf16."""
    if device.type != "cuda" or kernels.fla_ops() is None:
        return None
    cfg = config_from_hf(hf)
    with torch.device("meta"):
        layer = GatedDeltaNet(cfg, tp_group=None, sequence_parallel=False, gdn_kernel="fla")
    layer = layer.to_empty(device=device)
    init_weights(layer, 0)
    x = torch.randn(seq, cfg.hidden_size, device=device, requires_grad=True)
    plan = AttentionPlan(torch.zeros(seq, dtype=torch.int64, device=device),
                         torch.arange(seq, device=device),
                         torch.tensor([0, seq], dtype=torch.int32, device=device))

    def ours() -> float:
        with autocast(device):
            y = layer(x, plan)
        y.float().sum().backward()
        return 0.0

    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    bf = dict(device=device, dtype=torch.bfloat16)
    conv_x = torch.randn(seq, 2 * hk * dk + hv * dv, **bf, requires_grad=True)
    conv_w = torch.randn(conv_x.shape[1], cfg.linear_conv_kernel_dim, **bf, requires_grad=True)
    g = torch.randn(seq, hv, device=device).sigmoid().log().requires_grad_()
    beta = torch.rand(seq, hv, **bf, requires_grad=True)
    cu = torch.tensor([0, seq], device=device)
    pos = torch.arange(seq, device=device)

    def fla() -> float:
        mixed = kernels.short_conv(conv_x, conv_w, pos, cu, "fla")
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        o = kernels.gated_delta_rule(q.reshape(seq, hk, dk), k.reshape(seq, hk, dk),
                                     v.reshape(seq, hv, dv), g, beta, cu, "fla")
        o.float().sum().backward()
        return 0.0

    a, b = timed(ours, steps, warmup, device), timed(fla, steps, warmup, device)
    return {"ours_ms": 1e3 * a["step_s"], "fla_ms": 1e3 * b["step_s"],
            "overhead": a["step_s"] / b["step_s"] - 1, "ours_peak_gib": a["peak_gib"],
            "fla_peak_gib": b["peak_gib"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = json.loads(Path(args.config).read_text())
    vocab = config_from_hf(hf).vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.seq,), generator=gen)
               for _ in range(args.steps + args.warmup)]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "config": str(args.config), "seq": args.seq,
              "mpcore": bench_mpcore(hf, batches, device, args.steps, args.warmup)}
    result["mpcore"]["tokens_per_s"] = args.seq / result["mpcore"]["step_s"]
    if not args.skip_hf:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["hf"] = bench_hf(hf, batches, device, args.steps, args.warmup)
        result["hf"]["tokens_per_s"] = args.seq / result["hf"]["step_s"]
        result["speedup"] = result["hf"]["step_s"] / result["mpcore"]["step_s"]
        if device.type == "cuda":
            result["memory_ratio"] = result["mpcore"]["peak_gib"] / result["hf"]["peak_gib"]
    result["layer"] = bench_layer(hf, args.seq, device, args.steps, args.warmup)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
