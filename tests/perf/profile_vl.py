"""Where mpcore's VL training step spends its time: torch.profiler over a few steps of the
Qwen2-VL-2B shape on the shipped real images (the step and batches of ``bench_vl.py``).

    python tests/perf/profile_vl.py [OUT.txt] [bench_vl options]

Warms up over every distinct batch twice (so no shape is seen for the first time while
profiled: a new image size builds cuDNN graphs and may compile a Triton variant), then:
- the host syncs of one step: ``torch.cuda.set_sync_debug_mode("warn")``, each sync counted by
  the innermost line of this repository that caused it;
- 3 profiled steps: the device's busy time (the union of its kernels' intervals) against the
  wall time, and the top operators by device time and by host time.
"""

from __future__ import annotations

import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WARMUP_ROUNDS = 2  # passes over the distinct batches before anything is measured
PROFILED = 3


def _sync_sites(step, i: int) -> collections.Counter:
    """Host syncs of ``step(i)`` by the innermost repository line (``file:line  code``)."""
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f.filename.startswith(str(REPO)) and "/tests/perf/" not in f.filename]
        where = frames[-1] if frames else None
        key = (f"{Path(where.filename).relative_to(REPO)}:{where.lineno}  {where.line}"
               if where else f"{filename}:{lineno}")
        sites[key] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(i)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def _busy_ms(prof) -> float:
    """Milliseconds in which at least one kernel or device copy ran (union of intervals)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e3


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = argv.pop(0) if argv and not argv[0].startswith("--") else "/tmp/profile_vl.txt"
    captured = {}
    distinct = bench_vl.parse_args([*argv]).distinct_batches

    def timed(step, steps, warmup):
        first = WARMUP_ROUNDS * distinct
        for i in range(first):
            step(i)
        captured["syncs"] = _sync_sites(step, first)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(first + 1, first + 1 + PROFILED):
                step(i)
            torch.cuda.synchronize()
        captured["wall_ms"] = 1e3 * (time.perf_counter() - start) / PROFILED
        captured["prof"] = prof
        return {"step_ms": 1.0, "peak_gib": 0.0, "first_loss": 0.0, "last_loss": 0.0}

    bench_vl._timed = timed
    bench_vl.main([str(Path(out).with_suffix(".json")), "--skip-hf", *argv])
    prof = captured["prof"]
    syncs = captured["syncs"]
    head = [f"per profiled step: wall {captured['wall_ms']:.1f} ms (under the profiler), device "
            f"busy {_busy_ms(prof) / PROFILED:.1f} ms",
            f"host syncs in one step: {sum(syncs.values())}"]
    head += [f"  {n:4d}  {site}" for site, n in syncs.most_common()]
    events = prof.key_averages()
    text = ("\n".join(head) + "\n\n"
            + events.table(sort_by="cuda_time_total", row_limit=40) + "\n"
            + events.table(sort_by="self_cuda_time_total", row_limit=30) + "\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=25))
    Path(out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
