"""Exclusive advisory locks on a small file that names its holder (``fcntl.flock``).

:func:`take` locks ``path`` with ``LOCK_EX | LOCK_NB`` and writes ``pid N on host H`` into it;
a second taker gets :class:`LockBusy` with that text, so its message can name the holder. The
kernel drops the lock when the holder exits, however it exits (kill -9 included), so a stale
lock file never blocks a rerun; the file itself stays (deleting it would race with a process
taking it). Where the filesystem has no flock (Lustre without ``-o flock``) :func:`take` warns
once and returns None: the caller goes on unprotected.

:func:`still_at`: a lock protects a path only while the file at that path is the one locked.
Deleting the folder (``rm -rf run``) or replacing the file lets a second process create and lock
a new file there while the holder keeps its lock on the deleted one; the holder asks
:func:`still_at` before it writes (``mpcore.rundir``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


class LockBusy(Exception):
    """Another process holds the lock; ``holder`` is what it wrote (``pid N on host H``)."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


def take(path: str | os.PathLike) -> IO | None:
    """Lock ``path`` (created if needed); the returned file holds the lock until closed."""
    path = Path(path)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            f.close()
            log.warning("cannot lock %s (%s): this filesystem lacks flock, so nothing stops a "
                        "second process on it", path, e)
            return None
        f.seek(0)
        holder = f.read().strip() or "unknown pid"
        f.close()
        raise LockBusy(path, holder) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    f.flush()
    return f


def still_at(f: IO, path: str | os.PathLike) -> bool:
    """Whether the locked file ``f`` is still the file at ``path``: same device and inode, not
    unlinked. False when the path is gone or names another file (its folder was deleted or
    replaced); True when that cannot be told (the path cannot be examined for another reason)."""
    held = os.fstat(f.fileno())
    try:
        now = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        return e.errno != errno.ESTALE  # NFS: the file handle's file is gone
    return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def holder_of(path: str | os.PathLike) -> str | None:
    """What the lock file at ``path`` says of its holder (``pid N on host H``), or None."""
    try:
        return Path(path).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None
