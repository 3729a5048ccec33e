"""Benchmark: RMSNorm forward + backward, Triton vs PyTorch, against the memory-bandwidth floor.

Usage: python -m tests.perf.bench_rmsnorm [OUT.json] [--bandwidth-gbs GB/s]

Shapes x [M, H] in bf16 with weight [H]: [4*4096, 2048] and [8192, 4096]. One step is
y = f(x, w); y.backward(dy). The floor counts the bytes a fused fwd+bwd must move at least:
forward reads x and writes y, backward reads x and dy and writes dx, so 5 * M * H * 2 bytes
(weights, rstd and dweight partials are < 1% here and left out), divided by the HBM bandwidth
(H200: 4.8 TB/s nominal; override with --bandwidth-gbs for another device).

Two timings per implementation: "eager" (triton.testing.do_bench: what an eager loop sees,
Python and launch overhead included, which dominates when the GPU work is this short) and
"graph" (do_bench_cudagraph: the same step replayed as a CUDA graph, i.e. GPU time only, which
is what the bandwidth floor bounds).
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

# Runnable from a plain checkout, without `pip install -e .`.
from mpcore.kernels.rmsnorm import rms_norm_reference, rms_norm_triton

SHAPES = [(4 * 4096, 2048), (8192, 4096)]
EPS = 1e-6
DEFAULT_OUT = Path(__file__).parent / "results" / "rmsnorm_h200.json"


def _implementations() -> dict:
    impls = {"triton": rms_norm_triton, "torch_reference": rms_norm_reference}
    if hasattr(F, "rms_norm"):
        impls["torch_F_rms_norm"] = lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)
    return impls


def _time_fwd_bwd_ms(fn, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> dict:
    """Median ms of one fwd+bwd step, eager and replayed as a CUDA graph."""

    def step():
        fn(x, weight, EPS).backward(dy)

    grads = [x, weight]
    eager = do_bench(step, warmup=25, rep=200, grad_to_none=grads, return_mode="median")
    graph = do_bench_cudagraph(step, rep=200, grad_to_none=grads, return_mode="median")
    return {"eager": eager, "graph": graph}


def run(bandwidth_gbs: float) -> dict:
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "bandwidth_gbs": bandwidth_gbs,
        "cases": [],
    }
    for num_rows, hidden in SHAPES:
        x = torch.randn(num_rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(num_rows, hidden, device="cuda", dtype=torch.bfloat16)
        floor_bytes = 5 * num_rows * hidden * x.element_size()
        floor_ms = floor_bytes / (bandwidth_gbs * 1e9) * 1e3
        case = {"shape": [num_rows, hidden], "floor_ms": floor_ms, "ms": {}, "graph_gbs": {}}
        for name, fn in _implementations().items():
            ms = _time_fwd_bwd_ms(fn, x, weight, dy)
            case["ms"][name] = ms
            case["graph_gbs"][name] = floor_bytes / (ms["graph"] * 1e-3) / 1e9
        results["cases"].append(case)
    return results


def _print_table(results: dict) -> None:
    names = list(results["cases"][0]["ms"])
    print(f"RMSNorm fwd+bwd, bf16, {results['device']}, floor at {results['bandwidth_gbs']} GB/s")
    print(f"{'shape':>14} {'mode':>6} {'floor ms':>9} " + " ".join(f"{n:>22}" for n in names))
    for case in results["cases"]:
        shape = "x".join(str(d) for d in case["shape"])
        for mode in ("eager", "graph"):
            cells = [
                f"{case['ms'][n][mode]:8.3f} ms ({case['floor_ms'] / case['ms'][n][mode]:4.0%})"
                for n in names
            ]
            row = " ".join(c.rjust(22) for c in cells)
            print(f"{shape:>14} {mode:>6} {case['floor_ms']:9.3f} {row}")
    print("(percent = floor / time: the fraction of peak bandwidth reached)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_rmsnorm.py needs a CUDA GPU")
    results = run(args.bandwidth_gbs)
    _print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
