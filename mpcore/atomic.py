"""Whole-or-absent file writes: every file mpcore hands to a user goes through here.

A writer fills ``.<name>.tmp-<pid>`` in the destination's own folder (a rename is atomic only
within one filesystem), flushes and fsyncs it, renames it over the destination and fsyncs the
folder, so the rename itself survives a power cut. A writer killed at any point leaves the
previous file untouched and at most a temporary file whose name says what it was; an exception
inside the ``with`` block removes the temporary file and leaves the destination as it was.

Cost: one fsync of the file and one of its folder per write (milliseconds on local disks), which
is why hot paths that append (``metrics.jsonl``) do not use it.

A write the storage refuses (read-only, no permission, no space) raises
``mpcore.io_errors.StorageError`` naming the path, the cause and the fix.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from mpcore.io_errors import writing


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new file inside ``folder`` durable (POSIX: sync the directory)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """The temporary sibling a write to ``path`` goes through (hidden, names the writer)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on a clean exit it replaces ``path``.

    ``mode`` is ``"w"`` or ``"wb"`` (with ``open``'s keyword arguments, e.g. ``encoding``).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    tmp = temporary_name(path)
    with writing(path):
        try:
            with open(tmp, mode, **kwargs) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text``, whole or not at all."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data``, whole or not at all."""
    with atomic_open(path, "wb") as f:
        f.write(data)
