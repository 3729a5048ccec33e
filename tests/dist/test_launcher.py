"""``python -m mpcore.torchrun`` (torchrun's launcher, quiet) with 2 real workers: a user error
and a Ctrl-C print our message and nothing else, and the exit code is the worker's (2 user error,
75 preempted and saved); a worker killed by a signal is named in one line, exit 1. The stderr
line counts of plain torchrun are printed for comparison (its ChildFailedError and
SignalException trailers are 30-45 lines)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mpcore.processes import EXIT_CRASH, EXIT_PREEMPTED, EXIT_USER_ERROR
from tests.dist.test_processes import PRETRAIN, env, free_port, last_step, small, wait_for, workers  # noqa: F401

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc"),
              pytest.mark.slow]
QUIET = [sys.executable, "-m", "mpcore.torchrun"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def launch(launcher: list[str], *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([*launcher, "--nproc-per-node", "2", "--master-port",
                             str(free_port()), PRETRAIN, *args], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_user_error_prints_one_line_and_exits_2(tmp_path, small):  # noqa: F811
    counts = {}
    for name, launcher in (("torchrun", TORCHRUN), ("mpcore.torchrun", QUIET)):
        proc = launch(launcher, *small, "training.nope=1", cwd=tmp_path)
        out, err = proc.communicate(timeout=120)
        counts[name] = (proc.returncode, len(err.splitlines()))
        if launcher is QUIET:
            assert proc.returncode == EXIT_USER_ERROR, err
            assert err.splitlines() == [
                "error: unknown config key 'training.nope'; did you mean 'training.dtype'? "
                "(valid sections: model, parallel, data, optimizer, schedule, checkpoint, "
                "logging, training)"], err
    print("exit code, stderr lines:", counts)
    assert counts["torchrun"][1] > 20  # the trailer this launcher removes


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGUSR1])
def test_stop_signal_to_the_job_saves_and_exits_75_quietly(tmp_path, small, sig):  # noqa: F811
    """``sig`` to every process of the job (what Ctrl-C at a terminal or Slurm's --signal
    does): the workers save at the step boundary, the launcher exits 75 and adds nothing; the
    same command resumes from that checkpoint."""
    run_dir = tmp_path / "run"
    args = [*small, "training.max_steps=100000", "checkpoint.every=0",
            f"logging.run_dir={run_dir}"]
    proc = launch(QUIET, *args, cwd=tmp_path, start_new_session=True)
    try:
        wait_for(lambda: last_step(run_dir) >= 3, 120, "step 3")
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    step = last_step(run_dir)
    tail = err.splitlines()[-1]
    assert tail == (f"[rank0] WARNING {sig.name}: stopped after step {step}; the last checkpoint "
                    f"is {run_dir}/checkpoints/step-{step}; rerun the same command to resume")
    for noise in ("Traceback", "SignalException", "ChildFailedError", "closing signal"):
        assert noise not in err, err[-3000:]
    assert f"preempted at step {step}" in out
    again = launch(QUIET, *small, f"training.max_steps={step + 2}", "checkpoint.every=0",
                   f"logging.run_dir={run_dir}", cwd=tmp_path)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step-{step}" in err
    assert f"done at step {step + 2}" in out


def test_worker_killed_by_a_signal_is_named_in_one_line(tmp_path, small):  # noqa: F811
    run_dir = tmp_path / "run"
    proc = launch(QUIET, *small, "training.max_steps=100000", "checkpoint.every=0",
                  f"logging.run_dir={run_dir}", cwd=tmp_path)
    try:
        wait_for(lambda: last_step(run_dir) >= 2, 120, "step 2")
        pid = workers(proc.pid)[1]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_CRASH, err[-3000:]
    assert f"error: rank 1 (pid {pid}) was killed by SIGKILL; its output above says more" in err
    assert "ChildFailedError" not in err and time.monotonic() - start < 60
