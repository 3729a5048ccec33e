"""Where the fused CE head's time goes: torch.profiler over its forward + backward (CUDA).

    python -m tests.perf.profile_loss [OUT.txt] [--shape N,H,V ...] [--chunk-mib M]

bf16 hidden and weight (``bench_loss.py``'s inputs), reduction "mean", 3 warm-up runs, then 3
profiled ones. Per shape: the measured ms per run and the 6NHV floor at the bf16 matmul rate
of the same run (``bench_loss.matmul_tflops``), then every CUDA kernel with its calls and
device ms per run, so a GEMM that runs below the rate, or a pass that costs more than its
bytes, shows by name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mpcore.kernels import _lce_chunks, linear_cross_entropy
from tests.perf import bench_loss

RUNS = 3


def kernel_table(prof, runs: int) -> list[tuple[str, int, float]]:
    """``(kernel name, calls per run, device ms per run)``, longest first."""
    rows: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            rows.setdefault(event.name, []).append(event.device_time_total / 1e3)
    out = [(name, len(t) // runs, sum(t) / runs) for name, t in rows.items()]
    return sorted(out, key=lambda r: -r[2])


def profile_shape(n: int, h: int, v: int, rate: float) -> str:
    hidden, weight, labels = bench_loss._inputs(n, h, v)

    def run():
        return bench_loss._step(linear_cross_entropy, hidden, weight, labels)

    ms = bench_loss._time(run)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(RUNS):
            run()
        torch.cuda.synchronize()
    floor = 6 * n * h * v / (rate * 1e9)
    lines = [f"N={n} H={h} V={v}: {ms:.2f} ms per run, floor {floor:.2f} ms "
             f"({ms / floor:.3f}x) at {rate:.1f} TFLOP/s; chunk budget "
             f"{_lce_chunks.CHUNK_BYTES >> 20} MiB",
             f"{'device ms/run':>14} {'calls':>6}  kernel"]
    for name, calls, dev in kernel_table(prof, RUNS):
        lines.append(f"{dev:14.3f} {calls:6d}  {name[:110]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="/tmp/profile_loss.txt")
    parser.add_argument("--shape", action="append", default=None,
                        help="N,H,V (repeatable; default: the 1B step's 16384,2048,128256)")
    parser.add_argument("--chunk-mib", type=int, default=None)
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(",")) for s in (args.shape or ["16384,2048,128256"])]
    rate = bench_loss.matmul_tflops()
    with _lce_chunks.chunk_budget(None if args.chunk_mib is None else args.chunk_mib << 20):
        text = "\n\n".join(profile_shape(*s, rate) for s in shapes)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
