"""Benchmark: one linear layer fwd+bwd, bf16 (``F.linear`` under autocast) vs FP8
(``mpcore.kernels.fp8_linear``, tensorwise), fp32 master weight, bf16 activations, on one GPU.

Usage: python -m tests.perf.bench_fp8_linear [OUT.json] (default
tests/perf/results/fp8_linear_h200.json). Shapes: the Llama-3.2-1B projections at 16384
tokens (qkv 2048 -> 3072, wo 2048 -> 2048, w13 2048 -> 16384, w2 8192 -> 2048). Median of
``triton.testing.do_bench``; TFLOP/s counts the three GEMMs (6 N K M).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from mpcore.kernels.fp8_linear import fp8_linear

REPO = Path(__file__).resolve().parents[2]

DEFAULT_OUT = Path(__file__).parent / "results" / "fp8_linear_h200.json"
SHAPES = {"wqkv": (2048, 3072), "wo": (2048, 2048), "w13": (2048, 16384), "w2": (8192, 2048)}
TOKENS = 16384


def _time(fn, k, m) -> float:
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(m, k, device="cuda") * 0.02).requires_grad_()
    dy = torch.randn(TOKENS, m, device="cuda", dtype=torch.bfloat16)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, w)
        y.backward(dy)

    step()
    return do_bench(step, warmup=25, rep=200, return_mode="median")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_path = Path(argv[0]) if argv else DEFAULT_OUT
    rows = []
    for name, (k, m) in SHAPES.items():
        bf16, fp8 = _time(F.linear, k, m), _time(fp8_linear, k, m)
        flop = 6 * TOKENS * k * m
        rows.append({"name": name, "tokens": TOKENS, "in": k, "out": m, "bf16_ms": bf16,
                     "fp8_ms": fp8, "speedup": bf16 / fp8, "bf16_tflops": flop / bf16 / 1e9,
                     "fp8_tflops": flop / fp8 / 1e9})
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "recipe": "tensorwise", "timing": "fwd+bwd, median ms (triton do_bench)",
              "rows": rows}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        print(f"{r['name']:5s} {TOKENS} x {r['in']} -> {r['out']}: bf16 {r['bf16_ms']:.3f} ms "
              f"({r['bf16_tflops']:.0f} TF/s)  fp8 {r['fp8_ms']:.3f} ms "
              f"({r['fp8_tflops']:.0f} TF/s)  x{r['speedup']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
