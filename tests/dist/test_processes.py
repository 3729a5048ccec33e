"""launch/pretrain.py as processes: a rendezvous that cannot complete ends within
parallel.init_timeout_s; a user error under torchrun is printed once, without a traceback; a
worker killed with SIGKILL is restarted by torchrun --max-restarts and the run resumes; when
the launcher itself is SIGKILLed its workers exit (Linux: PR_SET_PDEATHSIG)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpcore.data import prepare_default

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "launch" / "pretrain.py")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Overrides of a small, fast run on a prepared copy of the default corpus."""
    data = tmp_path_factory.mktemp("data")
    prepare_default(data, 512)
    return ["model.vocab_size=512", "model.hidden_size=32", "model.num_layers=1",
            "model.intermediate_size=64", f"data.cache_dir={data}", "data.default_vocab_size=512",
            "data.seq_len=32", "data.micro_batch=2", "training.device=cpu",
            "logging.log_every=1", "parallel.init_timeout_s=60"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), *args]


def workers(pid: int) -> dict[int, int]:
    """rank -> pid of the children of torchrun agent ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks = [int(v[5:]) for v in environ if v.startswith(b"RANK=")]
            if ranks:
                out[ranks[0]] = int(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError):
        return 0


def test_rendezvous_that_cannot_complete_ends_within_the_timeout(tmp_path, small):
    """World size 2 with only rank 0 started: it exits with the message, not after 30 min."""
    rdzv = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    start = time.monotonic()
    out = subprocess.run([sys.executable, PRETRAIN, *small, "parallel.init_timeout_s=3"],
                         cwd=tmp_path, env={**env(), **rdzv}, capture_output=True, text=True,
                         timeout=60)
    took = time.monotonic() - start
    assert out.returncode == 4, out.stderr
    assert ("rank 0 of 2: the process group did not form within parallel.init_timeout_s=3 s"
            in out.stderr) and "raise parallel.init_timeout_s" in out.stderr
    assert "Traceback" not in out.stderr
    assert took < 30, took


def test_user_error_under_torchrun_is_printed_once(tmp_path, small):
    """A data error after the process group formed, on both ranks: one line, no traceback,
    and torchrun's summary quotes it."""
    out = subprocess.run(torchrun(PRETRAIN, *small, f"data.paths=[{tmp_path}/nope]",
                                  f"data.tokenizer={tmp_path}/nope.model"),
                         cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    message = f"tokenizer model {tmp_path}/nope.model does not exist; create it with"
    printed = [line for line in text.splitlines() if line.startswith("error")]
    assert len(printed) == 1 and message in printed[0], text[-3000:]
    assert "traceback : " + message in text  # torchrun's root cause names the real error
    assert f'File "{PRETRAIN}"' not in text  # no worker traceback (torchrun prints its own)


@pytest.mark.slow
def test_worker_sigkill_restarts_and_resumes_then_launcher_sigkill_stops_workers(tmp_path,
                                                                                  small):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "torchrun.log", "w")
    agent = subprocess.Popen(torchrun("--max-restarts", "1", PRETRAIN, *small,
                                      "training.max_steps=100000", "checkpoint.every=2",
                                      f"logging.run_dir={run_dir}"),
                             cwd=tmp_path, env=env(), stdout=log, stderr=subprocess.STDOUT)
    seen = []  # every worker pid, killed at the end if a failed check left it running
    try:
        wait_for(lambda: last_step(run_dir) >= 3, 120, "step 3")
        first = workers(agent.pid)
        seen += first.values()
        os.kill(first[1], signal.SIGKILL)
        text = lambda: (tmp_path / "torchrun.log").read_text()  # noqa: E731
        wait_for(lambda: "resumed from" in text(), 120, "the restarted run to resume")
        resumed = wait_for(lambda: last_step(run_dir), 60, "a step after the resume")
        wait_for(lambda: last_step(run_dir) >= resumed + 2, 60, "training after the resume")
        second = workers(agent.pid)
        seen += second.values()
        assert set(second) == {0, 1} and not set(second.values()) & set(first.values())
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        wait_for(lambda: not any(alive(p) for p in second.values()), 60,
                 "the workers of a SIGKILLed launcher to exit")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        log.close()
        for pid in seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
