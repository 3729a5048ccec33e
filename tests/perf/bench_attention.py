"""Benchmark: the attention primitive's backends, fwd+bwd, on one GPU (bf16, 32 q / 8 kv heads).

Usage: python -m tests.perf.bench_attention [OUT.json] (default
tests/perf/results/attention_h200.json).

Cases, 16384 query tokens each:
- causal, fixed-length documents of L tokens (L = 256 .. 16384): the local step of a
  fixed-length batch, Ulysses' gathered stream, a zigzag rank's own block. flash vs
  sdpa_cudnn, through ``context_attention`` with autograd (what a layer runs).
- full (non-causal) 8 x (2048 queries over 1024 keys): a zigzag ring's remote block. flash vs
  sdpa_cudnn, through the planned call (``flash.run_forward``/``run_backward``).
- packed: 8 documents of 300 .. 4634 tokens, and 64 short documents of 196 .. 315 (causal,
  through ``context_attention``); a ring's remote block of the 8 packed documents (full, each
  document's queries over half as many keys, the planned call): flash only of the two torch
  backends (the dense path cannot take them); and the ragged cuDNN forward
  (``aten._cudnn_attention_forward`` with cu_seqlens) timed alone, to check
  the 60 ms measured for it on the H200 before.
Every case also times ``te_fused`` (TransformerEngine's THD fused attention) when TE is
importable; a te_fused failure is recorded in ``te_fused_errors`` and leaves the other columns.
Median of ``triton.testing.do_bench``. ``parallel/attention/backends.py``'s
``AUTO_SDPA_MIN_LEN`` is read off the uniform rows and ``AUTO_TE_RAGGED_*`` off the others and
the uniform causal rows by length (flash vs te_fused); tests/unit/test_attention_backends.py
checks both against this file.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from triton.testing import do_bench

from mpcore.parallel.attention import AttentionPlan, context_attention, flash
from mpcore.parallel.te import te_available

REPO = Path(__file__).resolve().parents[2]

DEFAULT_OUT = Path(__file__).parent / "results" / "attention_h200.json"
TOKENS, HEADS, KV_HEADS, DIM = 16384, 32, 8, 64
PACKED = [300, 4634, 1200, 2500, 3100, 900, 1700, 2050]  # sums to 16384
SHORT = [196 + (37 * i) % 129 for i in range(63)]
SHORT.append(TOKENS - sum(SHORT))  # 64 documents, 196 .. 315 tokens
assert sum(PACKED) == TOKENS and 196 <= SHORT[-1] <= 315


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


def _time_full(backend, lengths_q=(2048,) * 8, lengths_k=(1024,) * 8) -> float:
    """fwd+bwd ms of one full call: segments of ``lengths_q`` queries over ``lengths_k`` keys
    (default 8 x (2048 over 1024))."""
    q, k, v = (t.detach() for t in _qkv(sum(lengths_q), sum(lengths_k)))
    cu_q, cu_k = (_meta(list(n))[2].cuda() for n in (lengths_q, lengths_k))
    uniform = len(set(lengths_q)) == 1 and len(set(lengths_k)) == 1
    call = flash.FlashCall(False, None, None, cu_q, cu_k, max(lengths_q), max(lengths_k),
                           uniform)
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


def _te_versions() -> dict | None:
    """TransformerEngine's version and the cuDNN it runs, or None without TE."""
    if not te_available():
        return None
    version = getattr(importlib.import_module("transformer_engine"), "__version__", "?")
    cudnn = importlib.import_module("transformer_engine.pytorch.utils").get_cudnn_version()
    return {"version": version, "cudnn": ".".join(map(str, cudnn))}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_path = Path(argv[0]) if argv else DEFAULT_OUT
    te_versions, te_errors = _te_versions(), {}

    def timed(name: str, backends, time) -> dict:
        """{backend: ms} for ``backends`` plus te_fused where TE is (its failures noted)."""
        ms = {b: time(b) for b in backends}
        if te_versions is not None:
            try:
                ms["te_fused"] = time("te_fused")
            except (RuntimeError, ValueError) as e:
                te_errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
        return ms

    cases = []
    for length in (256, 512, 1024, 2048, 4096, 16384):
        name = f"causal {TOKENS // length} x {length}"
        ms = timed(name, ("flash", "sdpa_cudnn"),
                   lambda b, n=length: _time_layer([n] * (TOKENS // n), b))
        cases.append({"name": name, "causal": True, "uniform": True, "len_q": length,
                      "len_k": length, "ms": ms})
    name = "full 8 x (2048 q over 1024 k)"
    cases.append({"name": name, "causal": False, "uniform": True, "len_q": 2048, "len_k": 1024,
                  "ms": timed(name, ("flash", "sdpa_cudnn"), _time_full)})
    for name, lengths in (("packed 8 docs 300..4634", PACKED),
                          ("packed 64 docs 196..315", SHORT)):
        cases.append({"name": name, "causal": True, "uniform": False, "len_q": max(lengths),
                      "len_k": max(lengths),
                      "ms": timed(name, ("flash",), lambda b, n=lengths: _time_layer(n, b))})
    half = [n // 2 for n in PACKED]
    name = "full packed 8 docs (300..4634 q over half as many k)"
    cases.append({"name": name, "causal": False, "uniform": False, "len_q": max(PACKED),
                  "len_k": max(half),
                  "ms": timed(name, ("flash",), lambda b: _time_full(b, PACKED, half))})
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tokens": TOKENS, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
              "dtype": "bfloat16", "timing": "fwd+bwd, median ms (triton do_bench)",
              "cases": cases, "ragged_cudnn_packed": _time_ragged_cudnn(),
              "transformer_engine": te_versions, "te_fused_errors": te_errors}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    columns = ("flash", "sdpa_cudnn", "te_fused")
    print(f"{'case':52s}" + "".join(f"{b:>11s}" for b in columns))
    for c in cases:
        cells = [f"{c['ms'][b]:11.3f}" if b in c["ms"] else f"{'-':>11s}" for b in columns]
        print(f"{c['name']:52s}" + "".join(cells))
    print("ragged cuDNN forward (packed):", report["ragged_cudnn_packed"])
    print("TransformerEngine:", te_versions, "te_fused errors:", te_errors or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
