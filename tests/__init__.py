"""mpcore's tests, one package so helpers import by name from the repository root.

``from tests.dist.harness import run_distributed``; the benchmark scripts run as modules from
the repository root (``python -m tests.perf.bench_train ...``).
"""
