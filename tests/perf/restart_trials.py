"""How reliably ``torchrun --max-restarts`` restarts and resumes a run after a worker dies.

    python -m tests.perf.restart_trials [--trials 10] [--out results/restart_trials_cpu.json]

Each trial starts ``torchrun --nproc-per-node 2 --max-restarts 2 launch/pretrain.py`` (tiny
model, CPU, a checkpoint every 4 steps) in a fresh folder, waits until step 6 is logged, kills
the rank-1 worker with SIGKILL, and waits for torchrun to end. A trial counts as restarted and
resumed when torchrun exits 0, the workers logged "resumed from", and metrics.jsonl reaches the
last step. Writes one JSON object: the trials and how many succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers(pid: int) -> dict[int, int]:
    """rank -> pid of the torchrun agent's worker processes."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"RANK="):
                    out[int(item[5:])] = int(child)
    return out


def last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def trial(folder: Path, data_dir: Path, timeout: float = 300.0) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "2", "--master-port", str(free_port()),
           str(REPO / "launch" / "pretrain.py"), "model.hidden_size=64", "model.num_layers=2",
           "model.intermediate_size=128", "data.seq_len=64", "data.micro_batch=2",
           f"data.cache_dir={data_dir}", "training.device=cpu", f"training.max_steps={STEPS}",
           "logging.log_every=1", "checkpoint.every=4", "parallel.init_timeout_s=60",
           f"logging.run_dir={folder}/run"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = open(folder / "torchrun.log", "w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    metrics = folder / "run" / "metrics.jsonl"
    killed_at = None
    while proc.poll() is None and time.monotonic() - start < timeout:
        if killed_at is None and last_step(metrics) >= 6:
            pids = workers(proc.pid)
            if 1 in pids:
                os.kill(pids[1], signal.SIGKILL)
                killed_at = last_step(metrics)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    rc = proc.wait()
    log.close()
    text = (folder / "torchrun.log").read_text()
    ok = rc == 0 and "resumed from" in text and last_step(metrics) == STEPS
    return {"ok": ok, "rc": rc, "killed_at_step": killed_at, "final_step": last_step(metrics),
            "seconds": round(time.monotonic() - start, 1),
            "tail": "" if ok else text[-1500:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--out", type=Path,
                        default=REPO / "tests" / "perf" / "results" / "restart_trials_cpu.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        for i in range(args.trials):
            folder = Path(tmp) / f"trial{i}"
            folder.mkdir()
            results.append(trial(folder, data_dir))
            print(f"trial {i}: {results[-1]['ok']} rc={results[-1]['rc']} "
                  f"{results[-1]['seconds']} s", flush=True)
    summary = {"trials": len(results), "restarted_and_resumed": sum(r["ok"] for r in results),
               "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{summary['restarted_and_resumed']} of {summary['trials']} restarted and resumed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
