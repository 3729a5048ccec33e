"""One run per run directory, and a ``metrics.jsonl`` that matches the checkpoint resumed.

:class:`RunLock`: rank 0 holds ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<run_dir>/.lock`` (and on
``<checkpoint dir>/.lock`` when the checkpoints live elsewhere) for the whole run; the file holds
the holder's pid and host. A second run on the same folder refuses, naming them. The kernel
drops the lock when the holder exits, however it exits (kill -9 included), so a stale lock file
never blocks a rerun. flock works on local filesystems and NFSv4; where the filesystem does not
support it (Lustre without ``-o flock``) the run warns once and goes on unprotected.

:func:`claim_run_dir` also applies the start-over policy: a run that will not resume
(``checkpoint.resume=false``) in a folder that holds checkpoints refuses, unless
``checkpoint.overwrite=true``, which deletes them and ``metrics.jsonl`` first.

:func:`rewrite_metrics`: after a resume at step S, rows with ``step > S`` (steps that will be
run again) and any torn last line are dropped, by writing a new file and renaming it over the
old one, so each step appears once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
from pathlib import Path

from mpcore import atomic
from mpcore.checkpoint import LATEST, from_rank0, step_folders
from mpcore.config import Config

log = logging.getLogger(__name__)
LOCK = ".lock"


class RunLock:
    """Exclusive locks on ``folders`` (module docstring); :meth:`release` drops them."""

    def __init__(self, folders: list[Path]):
        self.files = []
        try:
            for folder in folders:
                self._take(Path(folder))
        except BaseException:
            self.release()
            raise

    def _take(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                f.close()
                log.warning("cannot lock %s (%s): this filesystem lacks flock, so nothing stops "
                            "a second run on this folder", path, e)
                return
            f.seek(0)
            holder = f.read().strip() or "unknown pid"
            f.close()
            raise ValueError(f"{folder} is in use by another run ({holder}, lock {path}); wait "
                             f"for it to finish or stop it, or give this run its own folder "
                             f"(logging.run_dir=... / checkpoint.dir=...)") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        f.flush()
        self.files.append(f)

    def release(self) -> None:
        """Unlock (the file stays: deleting it would race with a run taking it)."""
        for f in self.files:
            f.close()  # closing the last descriptor drops the flock
        self.files = []


def holds_checkpoints(root: Path) -> bool:
    root = Path(root)
    return bool(step_folders(root)) or (root / LATEST).exists()


def _start_over(cfg: Config) -> None:
    """Delete the old checkpoints and metrics of the folder (``checkpoint.overwrite=true``)."""
    root = cfg.checkpoint_dir
    for folder in step_folders(root):
        shutil.rmtree(folder)
    for path in root.iterdir() if root.is_dir() else []:
        if path.name == LATEST:
            path.unlink()
        elif path.name.startswith(("tmp-step-", "old-step-", "bad-step-")):
            shutil.rmtree(path, ignore_errors=True)
    (Path(cfg.logging.run_dir) / "metrics.jsonl").unlink(missing_ok=True)
    log.warning("checkpoint.overwrite=true: deleted the checkpoints in %s and the old "
                "metrics.jsonl; training starts at step 0", root)


def _claim(cfg: Config) -> RunLock:
    run_dir, root = Path(cfg.logging.run_dir).resolve(), cfg.checkpoint_dir.resolve()
    lock = RunLock([run_dir] if root.is_relative_to(run_dir) else [run_dir, root])
    try:
        old = holds_checkpoints(cfg.checkpoint_dir)
        if cfg.checkpoint.overwrite:
            if old:
                _start_over(cfg)
        elif old and not cfg.checkpoint.resume:
            raise ValueError(
                f"checkpoint.resume=false but {cfg.checkpoint_dir} holds checkpoints of an "
                f"earlier run; resume it (checkpoint.resume=true), give this run its own folder "
                f"(logging.run_dir=...), or delete them and start over with "
                f"checkpoint.overwrite=true")
    except BaseException:
        lock.release()
        raise
    return lock


def claim_run_dir(cfg: Config, rank: int) -> RunLock | None:
    """Rank 0 locks the run folder and applies the start-over policy (module docstring);
    every rank raises the same ``ValueError`` when it refuses. Collective."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = _claim(cfg)
        except ValueError as e:
            error = str(e)
    error = from_rank0(error)
    if error:
        raise ValueError(error)
    return lock


def rewrite_metrics(path: Path, step: int) -> int:
    """Keep the rows of ``path`` with ``step <= step`` (atomically); returns how many were
    dropped (later steps and torn lines)."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            keep = int(row["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic.write_text(path, "".join(line + "\n" for line in kept))
    return dropped
