"""Benchmark and profiling scripts, not collected by pytest; run them as modules from the
repository root: ``python -m tests.perf.bench_train OUT.json ...``."""
