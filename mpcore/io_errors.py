"""I/O failures of checkpoints: a save that filled the disk (and what a save needs), a load
that could not read a file (not damage).

A save writes a whole new checkpoint before rotation deletes the oldest, so ``checkpoint.dir``
holds up to ``keep_last + 1`` checkpoints during a save. When the filesystem fills up midway,
the error must say so in those terms (where, how much, what to change), not as the 20-line
``CheckpointException`` DCP raises, whose cause (``OSError(ENOSPC)``) is lost when the ranks
exchange their failures. So a failure counts as "no space" when an ``errno`` in its chain says
so (ENOSPC, EDQUOT; EFBIG for a file-size limit), when its text does, or when the filesystem has
less room left than one checkpoint takes.

Every writer (run folder, metrics, checkpoints, the export, score.py's output, the prepare
scripts' outputs, ``data.cache_dir``) turns the operating system's storage errors into one
:class:`StorageError` line that names the path, the cause and what to change: a read-only file
system (EROFS), no permission to write (EACCES, EPERM), a full disk or quota (ENOSPC, EDQUOT,
EFBIG). :func:`writing` does it around a block that writes under a path (``setting`` names the
option or config key that chose the path, so the fix names it); ``mpcore.atomic`` does it for
every whole-file write. An error that names another file (an input read inside the block) is
not the output's and passes unchanged. ``StorageError`` is a ``ValueError``: the entry points
print it as one line and exit 2; the run stops at its next step boundary when a metrics row or
a checkpoint cannot be written, and says which checkpoint is intact (``mpcore.train``).
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import os
import shutil
from collections.abc import Iterator
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


def _mount_points() -> list[Path]:
    """The mount points of this process (``/proc/self/mounts``; [] where there is none). They
    include bind mounts, which ``os.path.ismount`` cannot see (same device as the parent)."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    # Fields are space-separated, with spaces in paths written as \040 (fstab's escaping).
    return [Path(line.split()[1].replace("\\040", " ")) for line in lines if len(line.split()) > 1]


def mount_of(path: Path) -> Path:
    """The mount point of the filesystem that holds ``path`` (or would, once created)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    path = Path(os.path.realpath(path))
    holders = [m for m in _mount_points() if m == path or m in path.parents]
    if holders:
        return max(holders, key=lambda m: len(m.parts))
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


READ_ONLY_ERRNOS = (errno.EROFS,)
DENIED_ERRNOS = (errno.EACCES, errno.EPERM)
WRITE_ERRNOS = READ_ONLY_ERRNOS + DENIED_ERRNOS + FULL_ERRNOS


class StorageError(ValueError, OSError):
    """A write the storage refused (module docstring): ``path``, ``errno``, ``setting``. A
    ``ValueError`` for the entry points (one line, exit 2) and still an ``OSError`` with its
    ``errno`` and ``filename`` for code that catches those (a checkpoint save's clean-up)."""

    def __init__(self, path: Path, code: int, setting: str | None = None):
        self.message = storage_message(Path(path), code, setting)
        super().__init__(self.message)
        self.path, self.setting = Path(path), setting
        self.errno, self.strerror, self.filename = code, os.strerror(code), str(path)

    def __str__(self) -> str:
        return self.message


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def storage_message(path: Path, code: int, setting: str | None = None) -> str:
    """``cannot write PATH: CAUSE; FIX`` for a storage errno (``WRITE_ERRNOS``)."""
    path = Path(os.path.abspath(path))
    mount = mount_of(path)
    folder = path if path.is_dir() else path.parent
    elsewhere = (f"set {setting} to a folder elsewhere" if setting else
                 "write it to a folder elsewhere")
    if code in READ_ONLY_ERRNOS:
        cause = f"the file system at {mount} is read-only"
        fix = f"remount {mount} read-write, or {elsewhere} (on a writable file system)"
    elif code in DENIED_ERRNOS:
        cause = f"permission denied: {_user()} may not write in {folder}"
        fix = f"give {_user()} write permission on {folder}, or {elsewhere}"
    else:
        free = shutil.disk_usage(mount).free
        cause = (f"{'disk quota exceeded' if code == errno.EDQUOT else 'no space left'} on "
                 f"{mount} ({human(free)} free)")
        fix = f"free space on {mount}, or {elsewhere} (on a larger file system)"
    return f"cannot write {path}: {cause} ({errno.errorcode.get(code, code)}); {fix}"


def _related(name: Path, path: Path) -> bool:
    """Whether a failing file ``name`` belongs to a write under ``path``: the path itself, an
    ancestor being created, anything below it, or a sibling (a temporary file)."""
    return (name == path or name in path.parents or path in name.parents
            or name.parent == path.parent)


def storage_error(exc: BaseException, path: str | os.PathLike,
                  setting: str | None = None) -> StorageError | None:
    """``exc`` as a :class:`StorageError` of a write under ``path``, or None when it is not a
    storage error of that write (another errno, or an error naming an unrelated file)."""
    path = Path(os.path.abspath(path))
    if isinstance(exc, StorageError):
        if exc.setting is None and setting is not None:
            return StorageError(exc.path, exc.errno, setting)
        return exc
    if not isinstance(exc, OSError) or exc.errno not in WRITE_ERRNOS:
        return None
    name = Path(os.path.abspath(exc.filename)) if exc.filename else path
    if not _related(name, path):
        return None
    if name.parent == path.parent:  # a temporary sibling (mpcore.atomic): name the output
        name = path
    return StorageError(name, exc.errno, setting)


def refused_write(exc: BaseException) -> OSError | None:
    """The ``OSError`` in ``exc``'s chain (DCP failure lists included) that says the storage
    refuses writes (read-only, no permission), or None."""
    return next((e for e in _chain(exc) if isinstance(e, OSError)
                 and e.errno in READ_ONLY_ERRNOS + DENIED_ERRNOS), None)


@contextlib.contextmanager
def writing(path: str | os.PathLike, setting: str | None = None) -> Iterator[None]:
    """Turn the storage errors of the writes under ``path`` in the block into one
    :class:`StorageError` (module docstring); anything else passes unchanged."""
    try:
        yield
    except (OSError, StorageError) as e:
        converted = storage_error(e, path, setting)
        if converted is None or converted is e:
            raise
        raise converted from None
