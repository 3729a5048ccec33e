"""Benchmark: the vision tower's segment attention, fwd+bwd, at the Qwen2-VL-2B tower's shape.

Usage: python -m tests.perf.bench_vision_attention [OUT.json] (default
tests/perf/results/vision_attention_h200.json).

16 heads of dim 80, bf16, non-causal, five images' frames of 1764 .. 5476 patches (16.6k
rows, about what bench_vl.py's five images give). Rows: flash varlen (one call), and the dense
cuDNN calls per segment length (``mpcore.models.common.vision_attention._CudnnSegments``, the default), at
head dim 80 and with q, k, v zero-padded to 96, 112 and 128 (the pads and the slices are in
the timing; q.k and the softmax are unchanged by zero columns). Median of
``triton.testing.do_bench``; TFLOP/s counts the unpadded math (4 * sum(L^2) * H * D forward,
2.5x that backward). Measured on the H200 (results/vision_attention_h200.json): 80 as it is
is the fastest (3.70 ms against 4.64-4.72 padded, 5.06 flash), so the tower does not pad.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from mpcore.models.common import vision_attention as va

REPO = Path(__file__).resolve().parents[2]

DEFAULT_OUT = Path(__file__).parent / "results" / "vision_attention_h200.json"
LENGTHS, HEADS, DIM = [1764, 2704, 3364, 4096, 4692], 16, 80


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = Path(argv[0]) if argv else DEFAULT_OUT
    cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    segments = va.Segments(cu, max(LENGTHS), torch.device("cuda"))
    num = sum(LENGTHS)
    q, k, v = (torch.randn(num, HEADS, DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    f = torch.nn.functional
    dout = torch.randn(num, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    flops = 4 * sum(n * n for n in LENGTHS) * HEADS * DIM * 3.5
    rows, reference = [], None
    cases = [("flash", "flash", None)] + [(f"cudnn d{p}", "cudnn", p) for p in (80, 96, 112, 128)]
    for name, kernel, padded in cases:
        pad = (0, (padded or DIM) - DIM)

        def step(pad=pad, kernel=kernel):
            q.grad = k.grad = v.grad = None
            qp, kp, vp = (f.pad(t, pad) for t in (q, k, v))
            out = va.segment_attention(qp, kp, vp, segments, DIM ** -0.5, kernel)
            out[..., :DIM].backward(dout)

        step()
        got = torch.cat([q.grad, k.grad, v.grad]).float()
        err = 0.0 if reference is None else ((got - reference).norm() / reference.norm()).item()
        reference = got if reference is None else reference
        ms = do_bench(step, warmup=10, rep=100)
        rows.append({"name": name, "ms": ms, "tflops": flops / ms / 1e9,
                     "grad_rel_err_vs_flash": err})
        print(f"{name:12s} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  grads vs flash {err:.1e}")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "segments": LENGTHS, "heads": HEADS, "head_dim": DIM, "dtype": "bfloat16",
              "timing": "fwd+bwd, median ms (triton do_bench)", "rows": rows}
    out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
