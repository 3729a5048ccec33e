"""Checkpoint folders: atomic saves with ``torch.distributed.checkpoint``, a ``latest`` pointer.

Layout of ``ROOT`` (``checkpoint.dir``):

    ROOT/step-N/            one complete checkpoint: DCP files (``.metadata``, ``__R_0.distcp``)
    ROOT/step-N/meta.json   step, data position, layout, config: written last inside the folder
    ROOT/latest             text file "step-N": the newest complete checkpoint
    ROOT/tmp-step-N/        a save in progress (or one killed mid-save: ignored, then removed)

A save writes everything into ``tmp-step-N``, then renames it to ``step-N`` (atomic on one
filesystem), then replaces ``latest`` (written to a temporary file, then ``os.replace``), then
deletes all but the newest ``keep_last`` checkpoints. A process killed at any point leaves the
previous ``latest`` and its folder untouched, so the previous checkpoint still resumes. On
resume, ``latest`` is trusted when its folder has ``meta.json``; otherwise the newest complete
``step-*`` folder is used.

What is in the DCP files is the caller's (``mpcore.train_state``): plain CPU tensors keyed by
name; each rank passes the keys it owns (DCP writes each key from the rank that has it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

META = "meta.json"
LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    """Silence DCP's warning that a world of one saves/loads in a single process (intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def _complete(folder: Path) -> bool:
    return (folder / META).is_file() and (folder / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete ``step-N`` folders of ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP.match(p.name)) and _complete(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint to resume from (module docstring), or None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        folder = root / pointer.read_text().strip()
        if _complete(folder):
            return folder
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META
    if not path.is_file():
        raise ValueError(f"{folder} is not a complete checkpoint (no {META}); pass a step-N "
                         f"folder written by launch/pretrain.py")
    return json.loads(path.read_text())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str | Path, step: int, tensors: dict[str, torch.Tensor], meta: dict,
                    *, keep_last: int, rank: int,
                    hook: Callable[[str, Path], None] | None = None) -> Path:
    """Save ``tensors`` (this rank's keys) and ``meta`` as ``ROOT/step-<step>``. Collective.

    ``hook(stage, path)`` is called on rank 0 at ``"written"`` (DCP files and meta complete,
    not yet renamed) and ``"renamed"``; tests use it to simulate a crash mid-save.
    """
    root = Path(root)
    tmp, final = root / f"tmp-step-{step}", step_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    # Returns once the coordinator (rank 0) wrote .metadata, i.e. after every rank's data.
    with _single_process_quiet():
        dcp.save(tensors, checkpoint_id=tmp, no_dist=not dist.is_initialized())
    if rank == 0:
        _write_atomic(tmp / META, json.dumps(meta, indent=1))
        if hook:
            hook("written", tmp)
        if final.exists():  # re-saving a step (e.g. after a restart): replace it
            old = root / f"old-step-{step}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        if hook:
            hook("renamed", final)
        _write_atomic(root / LATEST, final.name + "\n")
        _prune(root, keep_last, keep=final)
    _barrier()
    return final


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    """Delete complete checkpoints but the newest ``keep_last``, and leftover temporaries."""
    for folder in complete_checkpoints(root)[:-keep_last]:
        if folder != keep:
            shutil.rmtree(folder, ignore_errors=True)
    for folder in root.iterdir():
        if folder.name.startswith(("tmp-step-", "old-step-")):
            shutil.rmtree(folder, ignore_errors=True)


def stored_tensors(folder: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Key -> (shape, dtype) of every tensor in the DCP checkpoint ``folder``."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    return {k: (v.size, v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
            if hasattr(v, "size")}


def load_tensors(folder: str | Path, keys: list[str],
                 stored: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Read ``keys`` (full CPU tensors) from ``folder``. Collective: every rank calls it, each
    with the keys it needs."""
    missing = [k for k in keys if k not in stored]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}; "
                         f"it was saved by another model or format")
    out = {k: torch.empty(stored[k][0], dtype=stored[k][1]) for k in keys}
    with _single_process_quiet():
        dcp.load(out, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    return out
