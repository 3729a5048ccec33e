"""Where a VL training step spends its time: torch.profiler over a few steps of the
Qwen2-VL-2B shape (or ``--family``'s) on the shipped real images (the step and batches of
``bench_vl.py``); mpcore's step, or transformers' with ``--side hf`` (SDPA), to set the two
side by side.

    python -m tests.perf.profile_vl [OUT.txt] [--side mpcore|hf] [bench_vl options]

Warms up over every distinct batch twice (so no shape is seen for the first time while
profiled: a new image size builds cuDNN graphs and may compile a Triton variant), then
profiles 3 steps and prints the device's idle gaps, the top operators by device time and by
host time, and the lines that synchronise with the device in one more step (the idle gaps and
the sync count are ``profile_train.py``'s). The forward passes of the whole model and of its tower
are marked as ``fwd:model`` / ``fwd:visual`` ranges (``MARKED``): the first table then splits
the forward's time between the tower and the rest (decoder and loss head).

``--stacks aten::index,...``: the profiled steps also record Python stacks (the host times
grow with it), and the report lists where each named operator was called from (its innermost
``STACK_FRAMES`` frames), calls and host time per call site: what a table row alone cannot
say (the H200 profile's 17 ``aten::index`` calls per step at 1.2 ms of host time each).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tests.perf import bench_vl
from tests.perf.bench_train import _sync
from tests.perf.profile_train import host_syncs, idle_gaps

WARMUP_ROUNDS = 2  # passes over the distinct batches before anything is measured
PROFILED = 3
# module paths of the whole model and of its tower on each side (the first that exists is
# marked); the decoder's forward is the difference (ours runs it through ``text.decode``, no
# module call)
MARKED = {"model": ("",), "visual": ("visual", "model.visual")}
STACK_FRAMES = 5


def mark_ranges(model: torch.nn.Module) -> list[str]:
    """Wrap the forward of each ``MARKED`` module of ``model`` in a ``record_function`` range
    named ``fwd:<part>``; the paths it marked."""
    modules = dict(model.named_modules())
    marked = []
    for part, paths in MARKED.items():
        path = next((p for p in paths if p in modules), None)
        if path is None:
            continue
        ranges = []
        modules[path].register_forward_pre_hook(
            lambda *_, part=part, ranges=ranges: ranges.append(
                torch.profiler.record_function(f"fwd:{part}").__enter__()))
        modules[path].register_forward_hook(
            lambda *_, ranges=ranges: ranges.pop().__exit__(None, None, None))
        marked.append(path)
    return marked


def call_sites(prof, ops: list[str]) -> str:
    """Each of ``ops``' call sites in a profile recorded with stacks: calls (over the
    ``PROFILED`` steps), self host and device time, and its innermost ``STACK_FRAMES``
    frames; the sites by host time."""
    rows = [e for e in prof.key_averages(group_by_stack_n=STACK_FRAMES) if e.key in ops]
    lines = [f"call sites of {', '.join(ops)} over {PROFILED} steps (stacks recorded: host "
             "times inflated)"]
    for e in sorted(rows, key=lambda e: -e.self_cpu_time_total):
        lines.append(f"{e.key}: {e.count} calls, self host {e.self_cpu_time_total / 1e3:.3f} ms,"
                     f" self device {getattr(e, 'self_device_time_total', 0.0) / 1e3:.3f} ms")
        lines += [f"    {frame}" for frame in e.stack[:STACK_FRAMES]] or ["    (no stack)"]
    lines += [f"{op}: none called" for op in ops if all(e.key != op for e in rows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = argv.pop(0) if argv and not argv[0].startswith("--") else "/tmp/profile_vl.txt"
    sides = argparse.ArgumentParser(add_help=False)  # the rest are bench_vl's options
    sides.add_argument("--side", default="mpcore", choices=["mpcore", "hf"])
    sides.add_argument("--stacks", default="", help="operators (comma-separated) to list "
                       "the call sites of (module docstring)")
    known, argv = sides.parse_known_args(argv)
    side = known.side
    stack_ops = [op for op in known.stacks.split(",") if op]
    stacks = dict(with_stack=True, experimental_config=torch._C._profiler._ExperimentalConfig(
        verbose=True)) if stack_ops else {}  # verbose: the stacks reach the op events
    captured = {}
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    distinct = bench_vl.parse_args([*argv]).distinct_batches

    def timed(step, steps, warmup, **_):  # bench_vl._timed, profiled instead
        first = WARMUP_ROUNDS * distinct
        for i in range(first):
            step(i)
        _sync()
        with profile(activities=activities, **stacks) as prof:
            for i in range(first, first + PROFILED):
                step(i)
            _sync()
        captured["prof"] = prof
        captured["syncs"] = (host_syncs(lambda: step(first + PROFILED)) if cuda
                             else "no CUDA: host syncs not counted\n")
        return {"step_ms": 1.0, "peak_gib": 0.0, "first_loss": 0.0, "last_loss": 0.0}

    make_optimizer = bench_vl._optimizer

    def optimizer(model, cuda):  # both sides make theirs once the model is built
        captured["marked"] = mark_ranges(model)
        return make_optimizer(model, cuda)

    bench_vl._timed, bench_vl._optimizer = timed, optimizer
    if side == "hf":  # main's one side is transformers' step
        bench_vl.bench_mpcore = bench_vl.bench_hf
    side_json = Path(out).with_suffix(".json")
    bench_vl.main([str(side_json), "--skip-hf", *argv])
    if side == "hf":  # main filed its one side under "mpcore": name it for what ran
        report = json.loads(side_json.read_text())
        report["hf"] = report.pop("mpcore")
        side_json.write_text(json.dumps(report, indent=1) + "\n")
    prof = captured["prof"]
    events = prof.key_averages()
    text = (f"side: {side}; forward ranges on {captured['marked']}\n"
            + (events.table(sort_by="cuda_time_total", row_limit=40) + "\n"
               + events.table(sort_by="self_cuda_time_total", row_limit=30) + "\n" if cuda
               else events.table(sort_by="cpu_time_total", row_limit=40) + "\n")
            + events.table(sort_by="self_cpu_time_total", row_limit=25) + "\n"
            + idle_gaps(prof, PROFILED) + "\n" + captured["syncs"]
            + (call_sites(prof, stack_ops) if stack_ops else ""))
    Path(out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
