"""Benchmark: forward + backward of the Llama-3.2-1B shape, mpcore vs transformers (+ liger).

    python -m tests.perf.bench_model [OUT.json] [--config PATH] [--steps 20] [--seq 4096]
        [--micro-batch 4]   (any other bench_train.py option too, torchrun layouts included)

The model alone (issue: decoder models): ``bench_train.py`` with ``--forward-backward-only``,
so both sides build, feed and autocast exactly as in the training benchmark, without gradient
clipping and optimizer steps. Tokens/s and peak memory per side; JSON to OUT (default
tests/perf/results/model_h200.json). Without CUDA it runs on the CPU as bench_train.py does
(tests/unit/test_bench_smoke.py runs it that way with launch/configs/tiny.yaml).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.perf import bench_train

DEFAULT_OUT = Path(__file__).parent / "results" / "model_h200.json"

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not argv or argv[0].startswith("--"):
        argv = [str(DEFAULT_OUT), *argv]
    sys.exit(bench_train.main([*argv, "--forward-backward-only"]))
