"""tests/perf/bench_loss.py's verl row on the CPU: its guard and its loader.

verl's Triton head itself cannot run here: it asserts CUDA tensors and opens NVTX ranges, so
even ``TRITON_INTERPRET=1`` does not reach its kernels on the CPU; the comparison of its
outputs with ours runs on the GPU, inside bench_loss, before any time is taken. Here: the
guard (``compare_rl_heads``) passes a head that computes our function, written in float64
torch in this file, and refuses heads that differ the ways a wrong call would (the negative
log-likelihood for the log-prob, no zero at ignored labels, a temperature, shifted labels);
with the verl wheel on the path (skipped otherwise), verl's kernel modules import without ray.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.perf import bench_loss

REPO = Path(__file__).resolve().parents[2]


def _inputs(n=48, h=32, v=80):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::7] = bench_loss.IGNORE
    return hidden, weight, labels


def _head(temperature=1.0, sign=1.0, zero_ignored=True, shift=0):
    """Per-token log p(label) and entropy in float64 torch, cast back to fp32."""
    def head(hidden, weight, labels):
        labels = labels.roll(shift)
        log_p = torch.log_softmax(hidden.double() @ weight.double().T / temperature, -1)
        valid = labels != bench_loss.IGNORE
        lp = sign * log_p.gather(1, labels.clamp(min=0)[:, None])[:, 0]
        if zero_ignored:
            lp = torch.where(valid, lp, 0.0)
        ent = -(log_p.exp() * log_p).sum(-1)
        return lp.float(), ent.float()
    return head


def test_guard_passes_our_function():
    errors = bench_loss.compare_rl_heads(_head(), *_inputs())
    assert errors["ok"], errors
    assert errors["logprob_max_abs"] < 1e-5 and errors["grad_weight_rel"] < 1e-5


@pytest.mark.parametrize("head, worst", [
    (_head(sign=-1.0), "logprob_max_abs"),            # a loss (NLL) taken for a log-prob
    (_head(zero_ignored=False), "logprob_max_abs"),   # ignored rows scored
    (_head(temperature=2.0), "entropy_max_abs"),      # another temperature
    (_head(shift=1), "logprob_max_abs"),              # labels shifted once more
])
def test_guard_refuses_another_function(head, worst):
    errors = bench_loss.compare_rl_heads(head, *_inputs())
    assert not errors["ok"]
    assert errors[worst] > 10 * bench_loss.RL_TOLERANCE[worst]


def test_guard_refuses_nan():
    def nan_head(hidden, weight, labels):
        lp, ent = _head()(hidden, weight, labels)
        return lp, ent * float("nan")
    assert not bench_loss.compare_rl_heads(nan_head, *_inputs())["ok"]


def test_rl_heads_ratio_and_floors():
    results = {bench_loss.OURS_RL: {"ms": 60.0, "ms_over_floor": 1.5},
               bench_loss.VERL_RL: {"ms": 90.0, "ms_over_floor": 2.25}}
    rl = bench_loss.rl_heads(results, floor_ms=40.0)
    assert rl["verl_over_mpcore"] == 1.5
    assert (rl["mpcore_over_8nhv"], rl["verl_over_8nhv"]) == (1.125, 1.688)
    results[bench_loss.VERL_RL] = {"mismatch": {"ok": False}}
    assert bench_loss.rl_heads(results, floor_ms=40.0) is None


@pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                    reason="needs the verl wheel on the path (tests/perf/NOTES.md)")
def test_verl_kernel_imports_without_ray():
    fn = bench_loss.verl_logprobs_fn()
    assert callable(fn), fn
    assert "verl.utils.kernel.kernels" in sys.modules
    assert "verl.protocol" not in sys.modules  # verl/__init__.py (ray, DataProto) not run


def test_chunk_budget_rows_set_the_budget_for_the_whole_step(monkeypatch):
    """An ``@N MiB`` row runs forward and backward (the RL head re-chunks there) with its own
    ``CHUNK_BYTES``, gives the default rows' gradients, and leaves the default in place."""
    from mpcore.kernels import _lce_chunks

    seen = []
    chunk_rows = _lce_chunks.Head.chunk_rows
    monkeypatch.setattr(_lce_chunks.Head, "chunk_rows",
                        lambda self, n, v: seen.append(chunk_rows(self, n, v)) or seen[-1])
    hidden, weight, labels = _inputs()
    default = _lce_chunks.CHUNK_BYTES
    peers = bench_loss._peers(chunk_mibs=(1,))
    for name in ("mpcore CE", "mpcore logprobs+entropy"):
        small = peers[f"{name} @1 MiB"]
        small.chunk_bytes = 16 * 80 * 4  # 16 rows of 80 fp32 logits: 3 chunks of the 48 rows
        seen.clear()
        want = bench_loss._step(peers[name], hidden, weight, labels)
        assert set(seen) == {48}
        seen.clear()
        got = bench_loss._step(small, hidden, weight, labels)
        assert set(seen) == {16} and len(seen) == (1 if name == "mpcore CE" else 2)
        assert _lce_chunks.CHUNK_BYTES == default
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
