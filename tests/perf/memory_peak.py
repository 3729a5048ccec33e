"""What is live at a step's peak of allocated CUDA memory, by the line of code that allocated it.

``peak_report(step)`` records the allocator's history over one ``step()``
(``torch.cuda.memory._record_memory_history``, Python stacks only) and replays it: the memory
allocated before the step (parameters, gradients, optimizer state, caches) is the baseline;
the allocations of the step are followed alloc by free to the moment their sum peaks, and
the ones live then are grouped by the innermost line of this repository that made them (or
the innermost Python line when none of ours is on the stack; "(no Python frame)" for the
autograd engine's own buffers). Used by ``profile_train.py --memory``.
"""

from __future__ import annotations

import collections
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])


def where(frames: list[dict], repo: str = REPO) -> str:
    """The innermost frame of ``repo`` outside tests/perf (else the innermost frame) as
    ``path:line (function)``; frames are innermost first, as the allocator records them."""
    if not frames:
        return "(no Python frame)"
    ours = [f for f in frames if f["filename"].startswith(repo)
            and "tests/perf" not in f["filename"]]
    f = ours[0] if ours else frames[0]
    name = f["filename"][len(repo) + 1:] if f["filename"].startswith(repo) else f["filename"]
    return f"{name}:{f['line']} ({f['name']})"


def peak_from_trace(trace: list[dict], repo: str = REPO) -> tuple[int, dict[str, int]]:
    """Replay one device's allocator trace: the peak of the bytes allocated during it (frees
    of blocks allocated before it are counted too, so the peak is relative to the start) and
    the bytes live at that peak per allocating line (``where``)."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], where(event.get("frames", []), repo))
            now += event["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif action == "free_completed":
            now -= event["size"]
            live.pop(event["addr"], None)
    groups: dict[str, int] = collections.Counter()
    for size, line in at_peak.values():
        groups[line] += size
    return peak, dict(groups)


def peak_report(step, rows: int = 25) -> str:
    """Run ``step()`` once with the allocator's history on; the baseline, the step's peak and
    what is live at it, largest first."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=2_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    peak, groups = peak_from_trace(snap["device_traces"][device])
    gib = 1 << 30
    lines = [f"memory before the step: {base / gib:.2f} GiB; the step's peak: "
             f"{torch.cuda.max_memory_allocated() / gib:.2f} GiB allocated "
             f"(replayed: baseline + {peak / gib:.2f} GiB); live at the peak, by line:"]
    for line, size in sorted(groups.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"{size / gib:8.3f} GiB  {line}")
    return "\n".join(lines) + "\n"
