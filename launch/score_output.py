"""The output file of launch/score.py: never the input, one writer at a time, whole or absent.

- :func:`check_paths` (every rank, before the model loads): ``--output`` must not be the input
  file under another name (the same path, a symlink to it, a hard link: same device and inode,
  or the same real path) and must not be a folder.
- :func:`lock_output` (rank 0): an exclusive lock (``mpcore.lockfile``) on ``.<name>.lock``
  beside the output, held from before the input is read until the output is written; a second
  score.py on the same output refuses, naming the holder's pid. Temporary files that a killed
  run left beside the output are removed under the lock (no live writer can own them).
- :func:`write_output`: the rows go to a temporary sibling that replaces the output only once
  complete (``mpcore.atomic``), so a killed run leaves the previous output file as it was.
  A symlink as ``--output`` keeps pointing where it did: its target is replaced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

from mpcore import atomic, lockfile
from mpcore.io_errors import writing


def real_output(output: Path) -> Path:
    """Where the rows land: ``output`` with its symlinks resolved (the link itself stays)."""
    return Path(os.path.realpath(output))


def lock_path(output: Path) -> Path:
    out = real_output(output)
    return out.with_name(f".{out.name}.lock")


def check_paths(input_path: Path, output: Path) -> None:
    """``ValueError`` when ``output`` is ``input_path`` by any name, or a folder."""
    if output.is_dir():
        raise ValueError(f"--output {output} is a folder; pass a file path such as "
                         f"{output / 'scores.jsonl'}")
    same = os.path.realpath(input_path) == os.path.realpath(output)
    if not same and input_path.exists() and output.exists():
        same = os.path.samefile(input_path, output)  # st_dev and st_ino: hard links too
    if same:
        raise ValueError(f"--output {output} is the input file {input_path} (the same file "
                         f"under another name or link); writing it would destroy the input: "
                         f"pass another --output")


def lock_output(output: Path) -> IO | None:
    """Lock ``output`` for this run (module docstring); ``ValueError`` naming the holder."""
    out = real_output(output)
    path = lock_path(output)
    try:
        with writing(out, "--output"):  # a read-only folder: one line, before the model loads
            out.parent.mkdir(parents=True, exist_ok=True)
            held = lockfile.take(path)
    except lockfile.LockBusy as e:
        raise ValueError(f"--output {output} is being written by another score.py ({e.holder}, "
                         f"lock {path}); wait for it to finish, or pass another --output") from None
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        stale.unlink(missing_ok=True)
    return held


def write_output(output: Path, rows: list[dict]) -> None:
    """Replace ``output``'s target with one JSON line per row, whole or not at all."""
    out = real_output(output)
    with writing(out, "--output"), atomic.atomic_open(out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
