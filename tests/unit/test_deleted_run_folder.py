"""A run whose folder is deleted (or replaced) while it trains stops at its next step boundary,
writing nothing more, with a message and exit code 2 (``mpcore.rundir``: the deleted run
folder). Issue 39: the first run kept training, created the folder again at its next save, and
the same command started again took a new lock there and resumed the first run's checkpoint,
both appending to one metrics.jsonl."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import pytest

import tests.unit.test_checkpoint_safety as safety
from mpcore import lockfile
from mpcore.processes import EXIT_USER_ERROR
from mpcore.rundir import LOCK, RunLock
from tests.unit.test_checkpoint_safety import ENV, REPO, overrides_for

data_dir = safety.data_dir
PRETRAIN = str(REPO / "launch" / "pretrain.py")


def test_a_lock_knows_when_its_folder_was_deleted_or_replaced(tmp_path):
    folder = tmp_path / "run"
    lock = RunLock([folder], ["logging.run_dir"])
    assert lock.lost() is None
    shutil.rmtree(folder)
    assert lock.lost() == (f"{folder} was deleted or replaced while this run was using it "
                           f"({folder / LOCK} is gone)")
    folder.mkdir()
    other = lockfile.take(folder / LOCK)  # the same command, started again
    assert f"({folder / LOCK} is another file now, held by pid " in lock.lost()
    other.close()
    lock.release()


def _start(overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, PRETRAIN, *overrides], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        out, err = proc.communicate()
    finally:
        watchdog.cancel()
    return proc.returncode, out, err


@pytest.mark.slow  # two training processes
def test_deleting_a_running_runs_folder_stops_it_and_the_rerun_owns_the_folder(tmp_path,
                                                                               data_dir):
    run_dir = tmp_path / "run"
    args = overrides_for(run_dir, data_dir, "model.num_layers=1", "training.max_steps=20",
                         "checkpoint.every=2", "logging.log_every=5")
    first = _start(args)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    while first.poll() is None and time.monotonic() < deadline:
        try:
            if latest.read_text() == "step-2\n":  # step 2 saved; the run trains on
                break
        except OSError:
            pass
        time.sleep(0.005)
    assert first.poll() is None, "the first run ended before its folder could be deleted"
    while run_dir.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
    second = _start(args)  # the same command again, while the first may still run
    code, _, err = _finish(first)
    assert code == EXIT_USER_ERROR, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].startswith(f"error: {run_dir} was deleted or replaced while this run was "
                                f"using it ({run_dir / LOCK} is "), errors[0]
    assert "wrote nothing more" in errors[0]
    code, out, err = _finish(second)
    assert code == 0, err[-3000:]
    assert "resumed from" not in err and "done at step 20" in out
    steps = [json.loads(line)["step"]
             for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 5, 10, 15, 20], steps  # each once: the first run wrote none here
