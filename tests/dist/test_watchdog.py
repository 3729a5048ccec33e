"""A hung rank under a real 2-process gloo run: the step watchdog stops every rank within
seconds of parallel.step_timeout_s with one message naming the rank that is behind and its
step (instead of gloo's 30-minute collective timeout), exit code 5; the rerun resumes from the
last checkpoint and continues the uninterrupted run's losses exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mpcore.processes import EXIT_STUCK
from mpcore.watchdog import stuck_message
from tests.dist.test_processes import env, free_port, small  # noqa: F401

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc"),
              pytest.mark.slow]
CHILD = """import json, logging, os, sys, time
import torch.distributed
from mpcore.config import load_config
from mpcore.processes import init_distributed
from mpcore.train import train

logging.basicConfig(level=logging.INFO if os.environ["RANK"] == "0" else logging.WARNING)
cfg = load_config(None, json.loads(sys.argv[1]))
hang = json.loads(sys.argv[2])  # [rank, step] that never finishes its data phase, or null
store = init_distributed(cfg.parallel.init_timeout_s)

def hook(step):
    if hang and int(os.environ["RANK"]) == hang[0] and step == hang[1]:
        print("hanging at step", step, flush=True)
        time.sleep(3600)

try:
    train(cfg, step_hook=hook, store=store)
finally:  # as pretrain.py does; without it one full-suite run saw rank 1 abort at exit
    # ("terminate called without an active exception") after all 8 steps and saves
    torch.distributed.destroy_process_group()
"""


def run_child(script, overrides, hang, timeout=180) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "mpcore.torchrun", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(script), json.dumps(overrides), json.dumps(hang)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=script.parent, env=env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - start


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_hung_rank_stops_the_run_by_name_and_the_rerun_resumes(tmp_path, small):  # noqa: F811
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    args = [*small, "training.max_steps=8", "checkpoint.every=2"]
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    done, _ = run_child(script, [*args, f"logging.run_dir={reference}"], None)
    assert done.returncode == 0, done.stderr[-3000:]

    hung, took = run_child(script, [*args, f"logging.run_dir={run_dir}",
                                    "parallel.step_timeout_s=3"], [1, 5])
    assert hung.returncode == EXIT_STUCK, hung.stderr[-3000:]
    assert "hanging at step 5" in hung.stdout
    errors = [line for line in hung.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, hung.stderr[-3000:]
    assert ("(parallel.step_timeout_s=3): rank 1 is behind, at step 5 (data); rank 0 reached "
            "step 5 (forward/backward) and waits for it. Every rank stops (exit 5)") in errors[0]
    print(errors[0], f"(exit after {took:.1f} s in all)")
    assert "Traceback" not in hung.stderr
    # Startup (two process launches, the first 4 steps) plus the 3 s timeout and ~1 s polling,
    # far below gloo's 30 minutes.
    assert took < 60, took
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]

    again, _ = run_child(script, [*args, f"logging.run_dir={run_dir}"], None)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step-4" in again.stderr
    got, want = metrics(run_dir), metrics(reference)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


def test_stuck_message_names_silent_and_lagging_ranks():
    marks = {0: (7, "forward/backward"), 1: (7, "data"), 2: (7, "forward/backward")}
    assert "rank 3 published no progress" in stuck_message(marks, 4, 12.0, 10.0)
    assert ("rank 1 is behind, at step 7 (data); ranks 0, 2 reached step 7 (forward/backward) "
            "and wait for it" in stuck_message(marks, 3, 12.0, 10.0))
    same = {0: (7, "optimizer"), 1: (7, "optimizer")}
    assert "every rank is at step 7 (optimizer)" in stuck_message(same, 2, 12.0, 10.0)
