"""Where mpcore's VL training step spends its time: torch.profiler over a few steps of the
Qwen2-VL-2B shape on the shipped real images (the step and batches of ``bench_vl.py``).

    python -m tests.perf.profile_vl [OUT.txt] [bench_vl options]

Warms up over every distinct batch twice (so no shape is seen for the first time while
profiled: a new image size builds cuDNN graphs and may compile a Triton variant), then
profiles 3 steps and prints the device's idle gaps, the top operators by device time and by
host time, and the lines that synchronise with the device in one more step (the idle gaps and
the sync count are ``profile_train.py``'s).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tests.perf import bench_vl
from tests.perf.profile_train import host_syncs, idle_gaps

WARMUP_ROUNDS = 2  # passes over the distinct batches before anything is measured
PROFILED = 3


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = argv.pop(0) if argv and not argv[0].startswith("--") else "/tmp/profile_vl.txt"
    captured = {}
    distinct = bench_vl.parse_args([*argv]).distinct_batches

    def timed(step, steps, warmup, **_):  # bench_vl._timed, profiled instead
        first = WARMUP_ROUNDS * distinct
        for i in range(first):
            step(i)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(first, first + PROFILED):
                step(i)
            torch.cuda.synchronize()
        captured["prof"] = prof
        captured["syncs"] = host_syncs(lambda: step(first + PROFILED))
        return {"step_ms": 1.0, "peak_gib": 0.0, "first_loss": 0.0, "last_loss": 0.0}

    bench_vl._timed = timed
    bench_vl.main([str(Path(out).with_suffix(".json")), "--skip-hf", *argv])
    prof = captured["prof"]
    events = prof.key_averages()
    text = (events.table(sort_by="cuda_time_total", row_limit=40) + "\n"
            + events.table(sort_by="self_cuda_time_total", row_limit=30) + "\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=25) + "\n"
            + idle_gaps(prof, PROFILED) + "\n" + captured["syncs"])
    Path(out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
