"""I/O failures of checkpoints: a save that filled the disk (and what a save needs), a load
that could not read a file (not damage).

A save writes a whole new checkpoint before rotation deletes the oldest, so ``checkpoint.dir``
holds up to ``keep_last + 1`` checkpoints during a save. When the filesystem fills up midway,
the error must say so in those terms (where, how much, what to change), not as the 20-line
``CheckpointException`` DCP raises, whose cause (``OSError(ENOSPC)``) is lost when the ranks
exchange their failures. So a failure counts as "no space" when an ``errno`` in its chain says
so (ENOSPC, EDQUOT; EFBIG for a file-size limit), when its text does, or when the filesystem has
less room left than one checkpoint takes.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "File too large")


def _chain(exc: BaseException):
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]
        for pair in (getattr(e, "failures", None) or {}).values():  # DCP's CheckpointException
            stack.append(pair[0] if isinstance(pair, tuple) else pair)


def out_of_space(exc: BaseException) -> bool:
    """True when ``exc`` (or anything in its chain or DCP failure list) says the disk is full."""
    return any(getattr(e, "errno", None) in FULL_ERRNOS or any(t in str(e) for t in _FULL_TEXT)
               for e in _chain(exc))


READ_ERRNOS = (errno.EIO, errno.EACCES, errno.EPERM, errno.ESTALE, errno.ETIMEDOUT,
               errno.ENXIO, errno.ENOLINK)


def read_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` in ``exc``'s chain that says a file could not be read (EIO, EACCES, a
    stale network handle, ...), or None: such a failure is the storage's, not damage."""
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in READ_ERRNOS),
                None)


def mount_of(path: Path) -> Path:
    """The mount point of the filesystem that holds ``path`` (or would, once created)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def no_space_message(root: Path, step: int, keep_last: int, size: int, basis: str,
                     previous: Path | None) -> str:
    """The user's error for a save that ran out of space (module docstring)."""
    mount = mount_of(root)
    free = shutil.disk_usage(mount).free
    kept = (f"the newest checkpoint, {previous}, is intact" if previous else
            "no earlier checkpoint exists")
    return (f"no space left on {mount} (checkpoint.dir {root}) while saving step {step}: one "
            f"checkpoint takes about {human(size)} ({basis}), and with checkpoint.keep_last="
            f"{keep_last} the folder holds up to {keep_last + 1} of them during a save "
            f"({human((keep_last + 1) * size)}) before rotation deletes the oldest; "
            f"{human(free)} is free there now. The partial save was removed and {kept}. Free "
            f"space on {mount}, lower checkpoint.keep_last, or set checkpoint.dir to a larger "
            f"filesystem, then rerun the same command to resume")
