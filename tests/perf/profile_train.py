"""Where mpcore's training step spends its time: torch.profiler over a few Llama-3.2-1B steps.

    python tests/perf/profile_train.py [OUT.txt] [--seq 4096] [--micro-batch 4]

Builds the run exactly as ``bench_train.py`` does (pretrain's code path, random tokens), warms
up, profiles 3 steps and prints the top operators by device time and by host time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = argv.pop(0) if argv and not argv[0].startswith("--") else "/tmp/profile_train.txt"
    args = bench_train.parse_args(argv)
    captured = {}

    def timed(step, steps, warmup):
        for i in range(3):
            step(i)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(3, 6):
                step(i)
            torch.cuda.synchronize()
        captured["prof"] = prof
        return {"step_ms": 1.0, "peak_gib": 0.0, "first_loss": 0.0, "last_loss": 0.0}

    bench_train._timed = timed
    bench_train.bench_mpcore(args)
    events = captured["prof"].key_averages()
    text = (events.table(sort_by="cuda_time_total", row_limit=30) + "\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=20))
    Path(out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
