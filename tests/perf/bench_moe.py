"""Benchmark: a Qwen3-MoE training step, mpcore vs transformers, and the expert GEMMs' rate.

Usage (one GPU):
    python tests/perf/bench_moe.py [OUT.json] [--layers 6] [--seq 4096] [--steps 10]
        [--warmup 3] [--hf-experts grouped_mm,batched_mm,eager] [--skip-hf] [--tiny]

The model is Qwen3-30B-A3B (launch/configs/qwen3_30b_a3b.yaml: hidden 2048, 32 heads, 4 KV
heads of 128, 128 experts of width 768, top 8, vocab 151936, untied head) cut to ``--layers``
decoder layers, the number that fits one GPU with fp32 parameters and AdamW state (each layer
holds 0.6 B parameters, 16 bytes each with the optimizer: about 9.7 GB). ``--tiny``: a shape
that runs on a CPU in seconds (for the smoke test). Both sides: fp32 parameters, bf16 autocast
on CUDA (fp32 on CPU), one document of ``--seq`` random tokens per step, the mean token
cross-entropy plus ``router_aux_loss_coef`` times the load-balancing loss, AdamW (fused on
CUDA), lr 1e-4, clipping at 1.0. mpcore: the qwen3_moe family's model (experts backend auto:
PyTorch's grouped GEMM on CUDA), the aux loss through ``mpcore.moe_step.MoeStep`` as training
computes it. transformers: ``Qwen3MoeForCausalLM`` of the same config with SDPA attention and
``output_router_logits``, once per experts implementation of ``--hf-experts`` that this
transformers has (the fastest is the peer).

Reported per side: median step time over ``--steps`` (after ``--warmup``), tokens/s, peak
allocated memory (reset between sides; null on CPU), first and last loss. ``experts``: one MoE
layer's expert computation alone (its ``seq * top_k`` routed rows, counts drawn from a random
router), forward + backward, in TFLOP/s through the grouped GEMM, beside the same FLOPs done as
one dense SwiGLU GEMM pair (the dense GEMM rate of this machine at that shape). JSON goes to
OUT (default tests/perf/results/moe_h200.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_timing import adamw, autocast, timed  # noqa: E402

from models.common.moe import run_experts  # noqa: E402
from models.registry import family_named  # noqa: E402
from mpcore.moe_step import MoeStep  # noqa: E402
from parallel.state import ParallelState  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results" / "moe_h200.json"
# Qwen3-30B-A3B's config.json (its shape fields; num_hidden_layers set by --layers).
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1e6, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
TINY = {**QWEN3_30B_A3B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32}
HF_EXPERTS = ("grouped_mm", "batched_mm", "eager")


def _train_step(model, opt, device, loss_of):
    def step() -> float:
        with autocast(device):
            loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def bench_mpcore(hf: dict, batches, device, steps, warmup) -> dict:
    family = family_named("qwen3_moe")
    cfg = family.config_from_hf(hf)
    state = ParallelState()
    model = family.build(cfg, state, seed=0, device=device)
    opt = adamw(model.parameters(), device)
    it = iter(batches)

    def loss_of():
        ids = next(it).to(device)
        _, inputs = family.local_inputs(state, ids, torch.tensor([0, ids.numel()],
                                                                 device=device), cfg)
        moe = MoeStep.start(model, [inputs], state, lambda inp: model(**inp, output="loss_sum"))
        ce = model(**inputs, output="loss_sum") / (ids.numel() - 1)
        return ce + moe.share()

    return timed(_train_step(model, opt, device, loss_of), steps, warmup, device)


def hf_experts_available() -> tuple[str, ...]:
    """The experts implementations this transformers registers (of ``HF_EXPERTS``); () when
    it has no experts interface (then its one implementation runs, named ``default``)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return ()
    names = set(ALL_EXPERTS_FUNCTIONS.valid_keys()) | {"eager"}
    return tuple(n for n in HF_EXPERTS if n in names)


def bench_hf(hf: dict, batches, device, steps, warmup, experts: str) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{k: v for k, v in hf.items() if k != "architectures"},
                            output_router_logits=True)
    kwargs = {"attn_implementation": "sdpa"}
    if experts != "default":
        kwargs["experts_implementation"] = experts
    with torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(config, **kwargs)
    model.train()
    opt = adamw(model.parameters(), device)
    it = iter(batches)

    def loss_of():
        ids = next(it).to(device)[None]
        return model(input_ids=ids, labels=ids).loss  # includes coef * aux loss

    return timed(_train_step(model, opt, device, loss_of), steps, warmup, device)


def bench_experts(hf: dict, seq: int, device, steps, warmup) -> dict | None:
    """One layer's experts alone, fwd + bwd, bf16: grouped GEMM vs one dense GEMM pair of the
    same FLOPs (module docstring). Null without CUDA."""
    if device.type != "cuda":
        return None
    e, k = hf["num_experts"], hf["num_experts_per_tok"]
    h, i = hf["hidden_size"], hf["moe_intermediate_size"]
    gen = torch.Generator().manual_seed(0)
    # Expert of each of the seq * k routed rows: k distinct experts per token, at random.
    picks = torch.rand(seq, e, generator=gen).topk(k, dim=-1).indices.flatten()
    counts = torch.bincount(picks, minlength=e).tolist()
    rows = seq * k
    bf = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(rows, h, **bf, requires_grad=True)
    w13 = (torch.randn(e, 2 * i, h, **bf) * h ** -0.5).requires_grad_()
    w2 = (torch.randn(e, h, i, **bf) * i ** -0.5).requires_grad_()
    dense13 = (torch.randn(1, 2 * i, h, **bf) * h ** -0.5).requires_grad_()
    dense2 = (torch.randn(1, h, i, **bf) * i ** -0.5).requires_grad_()
    flops = 3 * 2 * rows * (h * 2 * i + i * h)  # forward + backward (twice the forward)

    def grouped() -> float:
        run_experts(x, w13, w2, counts, "grouped").float().sum().backward()
        return 0.0

    def dense() -> float:
        run_experts(x, dense13, dense2, [rows], "grouped").float().sum().backward()
        return 0.0

    a, b = timed(grouped, steps, warmup, device), timed(dense, steps, warmup, device)
    return {"rows": rows, "experts": e, "min_rows": min(counts), "max_rows": max(counts),
            "grouped_ms": 1e3 * a["step_s"], "grouped_tflops": flops / a["step_s"] / 1e12,
            "dense_ms": 1e3 * b["step_s"], "dense_tflops": flops / b["step_s"] / 1e12}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hf-experts", default=",".join(HF_EXPERTS),
                   help="transformers experts implementations to time (those it has)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized shape (smoke test)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = {**(TINY if args.tiny else QWEN3_30B_A3B), "num_hidden_layers": args.layers}
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, hf["vocab_size"], (args.seq,), generator=gen)
               for _ in range(args.steps + args.warmup)]
    counts = family_named("qwen3_moe").num_params(family_named("qwen3_moe").config_from_hf(hf))
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "shape": "tiny" if args.tiny else "Qwen3-30B-A3B", "layers": args.layers,
              "seq": args.seq, "params": counts["total"], "active_params": counts["active"],
              "torch": torch.__version__,
              "mpcore": bench_mpcore(hf, batches, device, args.steps, args.warmup)}
    result["mpcore"]["tokens_per_s"] = args.seq / result["mpcore"]["step_s"]
    print(f"mpcore: {json.dumps(result['mpcore'])}", flush=True)
    if not args.skip_hf:
        import transformers

        result["transformers"] = transformers.__version__
        wanted = [n for n in args.hf_experts.split(",") if n]
        have = hf_experts_available()
        names = [n for n in wanted if n in have] if have else ["default"]
        result["hf"] = {}
        for name in names:
            try:
                r = bench_hf(hf, batches, device, args.steps, args.warmup, name)
                r["tokens_per_s"] = args.seq / r["step_s"]
            except torch.OutOfMemoryError as e:  # batched_mm gathers a weight copy per row
                r = {"error": f"out of memory: {str(e).splitlines()[0]}"}
                torch.cuda.empty_cache()
            result["hf"][name] = r
            print(f"transformers {name}: {json.dumps(r)}", flush=True)
        ran = [n for n in result["hf"] if "step_s" in result["hf"][n]]
        if not ran:
            raise SystemExit("no transformers experts implementation ran: "
                             + json.dumps(result["hf"]))
        fastest = min(ran, key=lambda n: result["hf"][n]["step_s"])
        result["hf_fastest"] = fastest
        peer = result["hf"][fastest]
        result["speedup"] = peer["step_s"] / result["mpcore"]["step_s"]
        if device.type == "cuda":
            result["memory_ratio"] = result["mpcore"]["peak_gib"] / peer["peak_gib"]
    result["experts"] = bench_experts(hf, args.seq, device, args.steps, args.warmup)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
