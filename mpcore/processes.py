"""Process lifecycle of a training run: joining the process group, the launcher's death, errors.

- :func:`exit_with_parent`: a worker gets SIGTERM when its launcher (torchrun) dies, even by
  SIGKILL (Linux ``prctl(PR_SET_PDEATHSIG)``), so no orphaned rank trains on; the SIGTERM
  handler of the training loop then saves a checkpoint at the next step boundary.
- :func:`init_distributed`: the ``env://`` rendezvous, ``init_process_group`` and one barrier
  (where NCCL really connects) under ``parallel.init_timeout_s``, in a store namespace of
  their own per torchrun restart attempt (the static rendezvous reuses one store). A watchdog thread ends the
  process with a message (exit code 4) when they do not complete in time: a rank that never
  came, a stale store or a port in use then fails fast and ``torchrun --max-restarts``
  restarts, instead of a 30-minute hang. Collectives after that keep torch's default timeout.
- :func:`report_user_error`: a user error (``ValueError``: config, data, inputs) is printed
  once, without a traceback: by the first rank that reports it (elected through the
  rendezvous store), or by rank 0 when it happens before the process group exists (then every
  rank has the same config and the same error). That rank also writes torchelastic's error
  file, so torchrun's failure summary names the error instead of "To enable traceback ...".

Exit codes of ``launch/pretrain.py`` (each worker's; ``mpcore.torchrun`` passes the first
failing worker's code on as its own, torchrun itself exits 1 for any failure):

    0    done (or already finished)
    1    crash: an unexpected exception (its traceback is printed)
    2    user error: config, data or inputs (``ValueError``; the message names the fix), a
         checkpoint or metrics row that cannot be written (no space left, a read-only file
         system, no permission: ``mpcore.io_errors``), or the run folder deleted or replaced
         while the run trained (``mpcore.rundir``): the run stopped without writing more
    3    diverged: training.max_bad_steps non-finite steps in a row, or max_steps inside a streak
    4    the process group did not form within parallel.init_timeout_s
    5    a rank stopped making progress for parallel.step_timeout_s (the step watchdog)
    75   stopped by SIGTERM, SIGINT (Ctrl-C) or SIGUSR1 after saving a checkpoint: rerun the
         same command to resume (75 is EX_TEMPFAIL of sysexits.h: "try again later")
    130  a second Ctrl-C: stopped at once, without saving
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

PR_SET_PDEATHSIG = 1
EXIT_CRASH = 1
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_RENDEZVOUS = 4
EXIT_STUCK = 5
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130
REPORT_GRACE_S = 2.0
# Codes whose message the worker printed itself: a launcher adds nothing to them.
REPORTED = (EXIT_USER_ERROR, EXIT_DIVERGED, EXIT_RENDEZVOUS, EXIT_STUCK, EXIT_PREEMPTED,
            EXIT_INTERRUPTED)


def exit_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def _timed_out(timeout_s: float, world: int) -> None:
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    print(f"error: rank {_rank()} of {world}: the process group did not form within "
          f"parallel.init_timeout_s={timeout_s:g} s (rendezvous at {where}); some rank did not "
          f"start or cannot reach it. Check that every node was launched with the same "
          f"--nnodes/--nproc-per-node and rendezvous endpoint, that the port is free, or raise "
          f"parallel.init_timeout_s", file=sys.stderr, flush=True)
    os._exit(EXIT_RENDEZVOUS)


def init_distributed(timeout_s: float) -> dist.Store | None:
    """Join the torchrun process group (env:// rendezvous) within ``timeout_s`` seconds.

    Backend: NCCL on CUDA (device ``LOCAL_RANK``), gloo on CPU. Returns the rendezvous store
    (None without torchrun: a world of one). Exits the process (code 4) with a message when
    the group does not form in time (module docstring).
    """
    if "RANK" not in os.environ or dist.is_initialized():
        return None
    world = int(os.environ.get("WORLD_SIZE", 1))
    watchdog = threading.Timer(timeout_s, _timed_out, (timeout_s, world))
    watchdog.daemon = True
    watchdog.start()
    try:
        timeout = timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun's static rendezvous keeps ONE store across --max-restarts attempts; without
        # a prefix per attempt a restarted rank can read its peer's address of the failed
        # attempt and fail ("Connection refused") or hang connecting to it.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"mpcore/attempt_{attempt}", store)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store),
                                rank=rank, world_size=world)
        dist.barrier()
    except (RuntimeError, TimeoutError) as e:  # a store that refused or timed out
        print(f"error: rank {_rank()}: {type(e).__name__}: {e}", file=sys.stderr)
        _timed_out(timeout_s, world)
    finally:
        watchdog.cancel()
    return store


def _first_to_report(store: dist.Store | None) -> bool:
    if store is None:
        return _rank() == 0
    try:
        store.set_timeout(timedelta(seconds=5))  # the store may be gone with a dead peer
        return store.add("mpcore/user_error", 1) == 1
    except (RuntimeError, TimeoutError):
        return _rank() == 0


def report_user_error(message: str, store: dist.Store | None) -> None:
    """Print ``error: message`` once over the world (module docstring), no traceback."""
    if not _first_to_report(store):
        if store is None and "RANK" in os.environ:
            # Rank 0 prints; torchrun stops the other workers as soon as one exits, so leaving
            # first could cut rank 0 off before its message is out.
            time.sleep(REPORT_GRACE_S)
        return
    prefix = f"error (rank {_rank()}): " if "RANK" in os.environ and _rank() else "error: "
    print(prefix + message, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:  # torchelastic's error-file format, so its failure summary quotes the message
        record = {"message": {"message": message, "extraInfo": {
            "py_callstack": message, "timestamp": str(int(time.time()))}}}
        with open(path, "w") as f:
            json.dump(record, f)
