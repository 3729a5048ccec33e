"""Benchmark: the Qwen3.5 training step with and without multi-token prediction (issue 37, sec. 3).

One command on one GPU (fla-core installed: the DeltaNet layers take its kernels):
    python -m tests.perf.bench_qwen35_mtp
CPU smoke run (a tiny config, seconds): ``python -m tests.perf.bench_qwen35_mtp OUT.json --tiny``.
Options: ``[OUT.json] [--config HF_CONFIG.json] [--seq 8192] [--steps 10] [--warmup 3]
[--weight 0.1] [--tiny]``.

Both runs: the same model (default: the released Qwen3.5-0.8B shape,
tests/dist/qwen35_0p8b_config.json, whose config has ``mtp_num_hidden_layers: 1``), fp32
parameters, bf16 autocast on CUDA (fp32 on CPU), one document of ``--seq`` random tokens per
step, AdamW, clipping at 1.0. ``plain``: ``mtp_loss_weight = 0`` (the MTP block is not built).
``mtp``: ``mtp_loss_weight = --weight`` (0.1: Megatron-Bridge's Qwen3.5 recipe), the loss
``main / N + w * mtp / N_mtp`` through the fused head (``hybrid.mtp.local_inputs``).

The claim checked (issue 37): the step with MTP costs at most the MTP block's share of the
FLOPs over the step without it. ``flop_share = F_mtp / F_plain - 1`` from
``mpcore.models.common.hybrid.counts.flops_per_token`` (the MTP block's fc, its attention layer
and SwiGLU, and the second pass through the shared head); ``time_ratio = t_mtp / t_plain``;
``within_flop_share``: ``time_ratio - 1 <= flop_share``. JSON goes to OUT (default
tests/perf/results/qwen35_mtp_h200.json; with ``--tiny``, qwen35_mtp_tiny_cpu.json there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from mpcore.models import family_named
from mpcore.models.common.hybrid import kernels
from mpcore.models.common.hybrid.counts import flops_per_token
from mpcore.models.common.hybrid.hf import config_from_hf
from mpcore.models.common.hybrid.model import build
from mpcore.models.common.hybrid.mtp import MtpOutput
from mpcore.parallel.state import ParallelState
from tests.perf.step_timing import adamw, autocast, placed_inputs, timed

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).parent / "results"
DEFAULT_CONFIG = REPO / "tests" / "dist" / "qwen35_0p8b_config.json"
# A few-layer Qwen3.5 text config (3 DeltaNet + 1 full attention) for the CPU smoke run.
TINY = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1}


def bench(cfg, batches, device, steps: int, warmup: int) -> dict:
    """The median step time of ``cfg`` (MTP on iff ``cfg.uses_mtp``) over ``batches``."""
    state = ParallelState()
    model = build(cfg, state, seed=0, device=device)
    opt = adamw(model.parameters(), device)
    it = iter(batches)
    family = family_named("qwen3_5")

    def step() -> float:
        ids = next(it)
        inputs = placed_inputs(family, state, ids, cfg, device)
        with autocast(device):
            out = model(**inputs, output="loss_sum")
        if isinstance(out, MtpOutput):  # one document: N - 1 and N - 2 valid targets
            loss = out.main / (ids.numel() - 1) + cfg.mtp_loss_weight * out.mtp / (
                ids.numel() - 2)
        else:
            loss = out / (ids.numel() - 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    out = timed(step, steps, warmup, device)
    out["tokens_per_s"] = batches[0].numel() / out["step_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=None)
    p.add_argument("--config", default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--weight", type=float, default=0.1)
    p.add_argument("--tiny", action="store_true", help="the CPU smoke run (a tiny config)")
    args = p.parse_args(argv)
    small = dict(seq=64, steps=2, warmup=1) if args.tiny else dict(seq=8192, steps=10, warmup=3)
    for key, value in small.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.weight <= 0:
        raise SystemExit("--weight must be > 0 (the MTP run's model.mtp_loss_weight)")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    hf = TINY if args.tiny and args.config is None else json.loads(
        Path(args.config or DEFAULT_CONFIG).read_text())
    plain = dataclasses.replace(config_from_hf(hf), mtp_num_hidden_layers=1)
    with_mtp = dataclasses.replace(plain, mtp_loss_weight=args.weight)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, plain.vocab_size, (args.seq,), generator=gen)
               for _ in range(args.steps + args.warmup)]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "config": "tiny" if hf is TINY else str(args.config or DEFAULT_CONFIG),
              "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
              "mtp_loss_weight": args.weight,
              "gdn_kernel": kernels.resolve("auto", torch.empty(1, device=device,
                                                                dtype=torch.bfloat16)),
              "plain": bench(plain, batches, device, args.steps, args.warmup)}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["mtp"] = bench(with_mtp, batches, device, args.steps, args.warmup)
    f_plain, f_mtp = flops_per_token(plain, args.seq), flops_per_token(with_mtp, args.seq)
    result["flops_per_token"] = {"plain": f_plain, "mtp": f_mtp}
    result["flop_share"] = f_mtp / f_plain - 1
    result["time_ratio"] = result["mtp"]["step_s"] / result["plain"]["step_s"]
    result["within_flop_share"] = result["time_ratio"] - 1 <= result["flop_share"]
    out = Path(args.out) if args.out else RESULTS / (
        "qwen35_mtp_tiny_cpu.json" if args.tiny else "qwen35_mtp_h200.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
