"""Where mpcore's training step spends its time: torch.profiler over a few Llama-3.2-1B steps.

    python -m tests.perf.profile_train [OUT.txt] [--seq 4096] [--micro-batch 4] [bench_train flags]

Builds the run exactly as ``bench_train.py`` does (pretrain's code path, random tokens), warms
up, profiles 3 steps and prints the top operators by device time and by host time, then the
elementwise and copy operators grouped by their input shapes (to find the casts, copies and
passes that can go), the device's idle gaps (host syncs, launch-bound stretches), and the lines
that synchronise with the device in one more step, and what is live at the peak of allocated
memory in another (``memory_peak.py``: by the line that allocated it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tests.perf import (
    bench_train,
    memory_peak,
)

ELEMENTWISE = ("aten::copy_", "aten::_to_copy", "aten::add", "aten::add_", "aten::fill_",
               "aten::cat", "aten::sum", "aten::clone", "aten::repeat_interleave", "aten::mul")


def by_input_shape(prof, rows: int = 40) -> str:
    """Device time of the elementwise/copy operators per (operator, input shapes): what the
    casts and copies are, by the tensors they move."""
    shaped = prof.key_averages(group_by_input_shape=True)
    keep = [e for e in shaped if e.key in ELEMENTWISE and e.device_time_total > 0]
    keep.sort(key=lambda e: -e.device_time_total)
    lines = ["elementwise and copy operators by input shapes (device ms over the profiled "
             "steps, calls, shapes):"]
    for e in keep[:rows]:
        lines.append(f"{e.device_time_total / 1e3:9.2f} ms {e.count:6d}  {e.key:24s} "
                     f"{e.input_shapes}")
    return "\n".join(lines) + "\n"


def idle_gaps(prof, steps: int = 3, rows: int = 15) -> str:
    """Where the GPU waits: the gaps between consecutive device activities (kernels, copies,
    memsets) of the profiled steps, their total per step, and the longest ones with the
    activity on each side."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"])
                   for e in trace.get("traceEvents", [])
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    gaps, end, last = [], None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append((start - end, last, name))
        if end is None or stop > end:
            end, last = stop, name
    total = sum(g for g, _, _ in gaps)
    lines = [f"device idle between activities: {total / 1e3 / steps:.2f} ms per step "
             f"({len(gaps)} gaps over {steps} steps); longest:"]
    for gap, before, after in sorted(gaps, reverse=True)[:rows]:
        lines.append(f"{gap / 1e3:8.3f} ms  after {before[:60]!r}  before {after[:60]!r}")
    return "\n".join(lines) + "\n"


def host_syncs(step) -> str:
    """The lines of Python that synchronise with the device during one ``step()``, counted
    (``torch.cuda.set_sync_debug_mode``): each is a point where the GPU drains and waits for
    the host."""
    where = sync_sites(step)
    lines = [f"host syncs in one step: {sum(where.values())}"]
    lines += [f"{n:5d}  {place}" for place, n in where.most_common()]
    return "\n".join(lines) + "\n"


def sync_sites(step):
    """``collections.Counter`` of the places that synchronised with the device during
    ``step()``: the innermost Python line, and the innermost line of this repository behind
    it when that is another."""
    import collections
    import traceback
    import warnings

    where = collections.Counter()
    repo = str(Path(__file__).resolve().parents[2])

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):  # not the mode switch's own notice
            return
        # The warning names the innermost Python frame (often inside torch); the innermost
        # frame of this repository says which of our lines asked for it.
        ours = [f for f in traceback.extract_stack()[:-1]
                if f.filename.startswith(repo) and "tests/perf" not in f.filename]
        place = f"{Path(filename).name}:{lineno}"
        if ours and ours[-1].filename != filename:
            place += f" (from {Path(ours[-1].filename).name}:{ours[-1].lineno})"
        where[place] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # the step's work done; not counted (it is ours, not the step's)
    return where


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = argv.pop(0) if argv and not argv[0].startswith("--") else "/tmp/profile_train.txt"
    args = bench_train.parse_args(argv)
    captured = {}

    def timed(step, steps, warmup, finish=float, steady=False):
        for i in range(3):
            finish(step(i))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     record_shapes=True) as prof:
            if steady:  # each step read after the next one starts, as in fit
                bench_train.back_to_back(step, range(3, 6), finish)
            else:
                for i in range(3, 6):
                    finish(step(i))
            torch.cuda.synchronize()
        captured["prof"] = prof
        launched = []
        captured["syncs"] = host_syncs(lambda: launched.append(step(6)))
        finish(launched[0])
        captured["memory"] = memory_peak.peak_report(lambda: finish(step(7)))
        return {"step_ms": 1.0, "peak_gib": 0.0, "first_loss": 0.0, "last_loss": 0.0}

    bench_train._timed = timed
    bench_train.bench_mpcore(args)
    events = captured["prof"].key_averages()
    text = (events.table(sort_by="cuda_time_total", row_limit=30) + "\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=20) + "\n"
            + by_input_shape(captured["prof"]) + "\n" + idle_gaps(captured["prof"]) + "\n"
            + captured["syncs"] + "\n" + captured["memory"])
    Path(out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
