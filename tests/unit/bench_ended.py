"""A benchmark script's run ended during transformers' rows, on the CPU: what a device call's
time limit does to it. The benchmarks (bench_moe, bench_qwen35, bench_vl) write our rows first,
with ``hf`` set to ``bench_qwen35.HF_UNFINISHED``; their tests read what such a run left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def ended_in_transformers_rows(monkeypatch, module, step: str, out: Path, *argv: str) -> dict:
    """``module.main([out, *argv])`` with CUDA hidden and ``module.<step>`` (its transformers
    rows) ending the process; the JSON it left at ``out``."""

    def ended(*args, **kwargs):
        raise SystemExit("killed")

    monkeypatch.setattr(module, step, ended)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="killed"):
        module.main([str(out), *argv])
    return json.loads(out.read_text())
