"""Benchmark: the attention primitive's backends, fwd+bwd, on one GPU (bf16, 32 q / 8 kv heads).

Usage: python tests/perf/bench_attention.py [OUT.json] (default
tests/perf/results/attention_h200.json).

Cases, 16384 query tokens each:
- causal, fixed-length documents of L tokens (L = 256 .. 16384): the local step of a
  fixed-length batch, Ulysses' gathered stream, a zigzag rank's own block. flash vs
  sdpa_cudnn, through ``context_attention`` with autograd (what a layer runs).
- full (non-causal) 8 x (2048 queries over 1024 keys): a zigzag ring's remote block. flash vs
  sdpa_cudnn, through the planned call (``flash.run_forward``/``run_backward``).
- packed: 8 documents of 300 .. 4634 tokens: flash only (the dense path cannot take it); and
  the ragged cuDNN forward (``aten._cudnn_attention_forward`` with cu_seqlens) timed alone, to
  check ../shared/notes/GPU.md's 60 ms.
Median of ``triton.testing.do_bench``. ``parallel/attention/backends.py``'s
``AUTO_SDPA_MIN_LEN`` is read off the causal rows; tests/unit/test_attention_backends.py checks
it against this file.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from triton.testing import do_bench

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from parallel.attention import AttentionPlan, context_attention, flash  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results" / "attention_h200.json"
TOKENS, HEADS, KV_HEADS, DIM = 16384, 32, 8, 64
PACKED = [300, 4634, 1200, 2500, 3100, 900, 1700, 2050]  # sums to 16384


def _qkv(num_q, num_k):
    q = torch.randn(num_q, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_k, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(num_k, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    return [t.requires_grad_() for t in (q, k, v)]


def _meta(lengths):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return doc, torch.arange(sum(lengths)) - starts[doc], cu


def _time_layer(lengths, backend) -> float:
    """fwd+bwd ms of context_attention over documents ``lengths``, plan made once."""
    q, k, v = _qkv(TOKENS, TOKENS)
    doc, pos, cu = _meta(lengths)
    plan = AttentionPlan(doc, pos, cu, backend=backend)
    dout = torch.randn_like(q)

    def step():
        out = context_attention(q, k, v, plan=plan)
        out.backward(dout)

    step()
    return do_bench(step, warmup=25, rep=200, return_mode="median")


def _time_full(backend) -> float:
    """fwd+bwd ms of one full call: 8 segments of 2048 queries over 1024 keys."""
    segs, len_q, len_k = 8, 2048, 1024
    q, k, v = (t.detach() for t in _qkv(segs * len_q, segs * len_k))
    cu_q = torch.arange(0, segs * len_q + 1, len_q, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, segs * len_k + 1, len_k, dtype=torch.int32, device="cuda")
    call = flash.FlashCall(False, None, None, cu_q, cu_k, len_q, len_k, True)
    call = replace(call, backend=backend)
    dout = torch.randn_like(q)
    scale = DIM ** -0.5

    def step():
        out, lse = flash.run_forward(q, k, v, [call], scale)
        flash.run_backward(dout, q, k, v, out, lse, [call], scale)

    step()
    return do_bench(step, warmup=25, rep=200, return_mode="median")


def _time_ragged_cudnn() -> dict:
    """The ragged cuDNN forward alone (5 calls after 1 warm-up), or the error it raised."""
    q, k, v = (t.detach() for t in _qkv(TOKENS, TOKENS))
    _, _, cu = _meta(PACKED)
    cu, longest = cu.cuda(), max(PACKED)
    try:
        def fwd():
            return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest,
                                                           longest, True, 0.0, True)
        fwd()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fwd()
        end.record()
        torch.cuda.synchronize()
        return {"fwd_ms": start.elapsed_time(end) / 5}
    except (RuntimeError, TypeError) as e:
        return {"error": str(e)[:300]}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_path = Path(argv[0]) if argv else DEFAULT_OUT
    cases = []
    for length in (256, 512, 1024, 2048, 4096, 16384):
        ms = {b: _time_layer([length] * (TOKENS // length), b) for b in ("flash", "sdpa_cudnn")}
        cases.append({"name": f"causal {TOKENS // length} x {length}", "causal": True,
                      "uniform": True, "len_q": length, "len_k": length, "ms": ms})
    cases.append({"name": "full 8 x (2048 q over 1024 k)", "causal": False, "uniform": True,
                  "len_q": 2048, "len_k": 1024,
                  "ms": {b: _time_full(b) for b in ("flash", "sdpa_cudnn")}})
    cases.append({"name": "packed 8 docs 300..4634", "causal": True, "uniform": False,
                  "len_q": max(PACKED), "len_k": max(PACKED),
                  "ms": {"flash": _time_layer(PACKED, "flash")}})
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tokens": TOKENS, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
              "dtype": "bfloat16", "timing": "fwd+bwd, median ms (triton do_bench)",
              "cases": cases, "ragged_cudnn_packed": _time_ragged_cudnn()}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'case':34s} {'flash':>8s} {'sdpa_cudnn':>11s}")
    for c in cases:
        cells = [f"{c['ms'][b]:8.3f}" if b in c["ms"] else f"{'-':>8s}"
                 for b in ("flash", "sdpa_cudnn")]
        print(f"{c['name']:34s} {cells[0]} {cells[1]:>11s}")
    print("ragged cuDNN forward (packed):", report["ragged_cudnn_packed"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
