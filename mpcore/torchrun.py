"""A quiet torchrun: ``python -m mpcore.torchrun [torchrun's arguments] launch/pretrain.py ...``.

torchrun turns any worker that exits non-zero into a ``ChildFailedError`` traceback of 30-45
lines printed after the worker's own message, and exits 1 whatever the worker's code was; a
Ctrl-C becomes a ``SignalException`` traceback, and torchrun forwards the signal and then
SIGKILLs the workers after its shutdown timeout, whether they finished their save or not.
Nothing a worker does can change that (it is the launcher's own exception), so this module runs
torchrun's launcher (``torch.distributed.run``: the same arguments, rendezvous and
``--max-restarts``) with three changes:

- SIGTERM, SIGINT and SIGUSR1 reaching the launcher are passed on to the workers (the launcher's
  children) and the launcher keeps waiting: the workers save at their next step boundary and
  exit 75 (``mpcore.train``). A Ctrl-C at the terminal reaches the workers twice (from the
  terminal and from here); they count SIGINTs closer than ``mpcore.train.SAME_CTRL_C_S`` apart
  as one. SIGHUP and SIGQUIT keep torchrun's handling.
- The end: when the first failing worker exited with a code whose message it printed itself
  (``mpcore.processes.REPORTED``: user error, diverged, rendezvous, stuck rank, preempted,
  interrupted), the launcher exits with that code and prints nothing. Any other failure (a
  crash, a worker killed by a signal) prints one line naming the rank, its exit code or signal
  and its error file's first line, and exits 1 (the worker's traceback is above it).
- torchrun's own log lines (``Sending process ... closing signal``, the OMP_NUM_THREADS notice)
  are hidden; the workers' output is unchanged.

Plain ``torchrun`` keeps working; this is what ``launch/slurm/pretrain.sbatch`` runs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from mpcore.processes import EXIT_CRASH, REPORTED

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def children() -> list[int]:
    """Pids of this process's children (Linux ``/proc``; empty elsewhere)."""
    out = []
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return out
    for task in tasks.iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _forward(signum, frame) -> None:
    for pid in children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # exited meanwhile
            pass


def _quiet_torchrun_logs() -> None:
    """torchrun's loggers each set their own level when created (env LOGLEVEL), so the level
    is set on each one; the workers are other processes and keep theirs."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _failure_line(err: ChildFailedError) -> tuple[int, str | None]:
    """(exit code, the line to print or None) for torchrun's failure ``err``."""
    # A worker that reported its own error (exit 2, 3, ...) decides the run's code: the
    # workers torchrun stopped after it (SIGTERM) are its consequence, even when their failure
    # was recorded first (timestamps have one-second resolution).
    reported = [f for f in err.failures.values() if f.exitcode in REPORTED]
    if reported:
        return min(reported, key=lambda f: f.timestamp).exitcode, None
    rank, failure = err.get_first_failure()
    if failure.exitcode < 0:  # torchrun's message then only repeats the signal
        how = f"was killed by {failure.signal_name()}"
    else:
        message = str(failure.message).strip().splitlines()
        useful = message and not message[0].startswith("To enable")
        how = f"exited with code {failure.exitcode}" + (f": {message[0][:300]}" if useful
                                                         else "")
    return EXIT_CRASH, f"error: rank {rank} (pid {failure.pid}) {how}; its output above says more"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # torchrun installs its raising handler only for the signals named here (its option
    # --signals-to-handle); the ones forwarded below are ours.
    args.signals_to_handle = "SIGHUP,SIGQUIT"
    for sig in FORWARDED:
        signal.signal(sig, _forward)
    _quiet_torchrun_logs()
    try:
        run(args)
    except ChildFailedError as err:
        code, line = _failure_line(err)
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
