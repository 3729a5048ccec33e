"""tests/perf/memory_peak.py on the CPU: the replay of an allocator trace (in the format of
``torch.cuda.memory._snapshot()["device_traces"]``, which ``torch.cuda._memory_viz`` reads the
same way) finds the peak and names the lines behind what is live there."""

from __future__ import annotations

from pathlib import Path

from tests.perf.memory_peak import peak_from_trace, where

REPO = Path(__file__).resolve().parents[2]

ROOT = "/repo"


def _frames(*places):
    return [{"filename": f, "line": line, "name": name} for f, line, name in places]


def _event(action, addr, size, *places):
    return {"action": action, "addr": addr, "size": size, "frames": _frames(*places)}


TORCH = ("/site/torch/nn/functional.py", 10, "linear")
LAYER = (f"{ROOT}/models/common/decoder.py", 42, "forward")
HEAD = (f"{ROOT}/kernels/linear_cross_entropy.py", 7, "forward")
BENCH = (f"{ROOT}/tests/perf/bench_train.py", 99, "step")


def test_where_names_our_innermost_line_outside_the_benchmarks():
    assert where(_frames(TORCH, LAYER, BENCH), ROOT) == "models/common/decoder.py:42 (forward)"
    assert where(_frames(TORCH, BENCH), ROOT) == "/site/torch/nn/functional.py:10 (linear)"
    assert where([], ROOT) == "(no Python frame)"


def test_replay_finds_the_peak_and_what_is_live_there():
    trace = [
        _event("segment_alloc", 0, 1 << 21),         # segments are not allocations
        _event("alloc", 1, 100, TORCH, LAYER),
        _event("alloc", 2, 50, TORCH, LAYER),
        _event("free_requested", 1, 100, TORCH, LAYER),  # freed only when completed
        _event("alloc", 3, 400, HEAD),                 # peak: 100 + 50 + 400
        _event("free_completed", 1, 100),
        _event("free_completed", 3, 400),
        _event("alloc", 4, 300, HEAD),                 # 50 + 300: below the peak
        _event("free_completed", 9, 1000),             # a block from before the trace
        _event("alloc", 5, 200, LAYER),                # now 50 + 300 - 1000 + 200: below
    ]
    peak, groups = peak_from_trace(trace, ROOT)
    assert peak == 550
    assert groups == {"models/common/decoder.py:42 (forward)": 150,
                      "kernels/linear_cross_entropy.py:7 (forward)": 400}
    assert peak_from_trace([], ROOT) == (0, {})
