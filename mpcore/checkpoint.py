"""Checkpoint folders: atomic, verified saves with ``torch.distributed.checkpoint``.

Layout of ``ROOT`` (``checkpoint.dir``):

    ROOT/step-N/                one checkpoint: DCP files (``.metadata``, ``__R_0.distcp``)
    ROOT/step-N/meta.json       step, data position, layout, config, data fingerprint
    ROOT/step-N/manifest.json   size and sha256 of every file above (``mpcore.manifest``)
    ROOT/latest                 text file "step-N": the newest checkpoint saved
    ROOT/tmp-step-N/            a save in progress (one killed mid-save: ignored, removed at the
                                next start; one out of space: removed at once)
    ROOT/bad-step-N/            a checkpoint that failed verification, moved aside on resume

Save: everything goes into ``tmp-step-N``; each rank hashes (and fsyncs) the ``.distcp`` files
it wrote itself, so hashing costs each rank one read of its own share, often still in its page
cache, and nothing crosses the network but the hashes. Rank 0 gathers them, adds ``.metadata``
and ``meta.json``, writes the manifest last, fsyncs the folder, renames it to ``step-N`` (atomic
on one filesystem), fsyncs ROOT, replaces ``latest`` (temporary file + ``os.replace`` + fsync
of ROOT), then deletes all but the newest ``keep_last`` checkpoints, never the newest one saved
from a finite state (``consecutive_bad == 0`` in its meta). A process killed, or a machine
losing power, at any point leaves either the old or the new checkpoint whole.

Resume (:func:`resume_newest`): the ``step-N`` folders, newest first; the first whose manifest
verifies (every listed file has its size and hash; the ranks split the files) AND that loads is
used. Each one skipped is reported by path with the reason and moved to ``bad-step-N``. When
step folders exist but none verifies, :class:`CheckpointError` lists them and the fix instead of
starting over. ``latest`` is kept for people and tools; resume does not need it (a crash between
the rename and the pointer update leaves the newer folder complete), and a damaged pointer is
reported by name.

What is in the DCP files is the caller's (``mpcore.train_state``): plain CPU tensors keyed by
name; each rank passes the keys it owns (DCP writes each key from the rank that has it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mpcore import atomic
from mpcore.atomic import fsync_dir
from mpcore.io_errors import (
    StorageError,
    folder_bytes,
    human,
    mount_of,
    no_space_message,
    out_of_space,
    read_error,
    refused_write,
)
from mpcore.manifest import FORMAT as MANIFEST_FORMAT
from mpcore.manifest import MANIFEST, READ_ATTEMPTS, check_files, file_entry, read_manifest
from mpcore.manifest import write_manifest as _write_manifest

log = logging.getLogger(__name__)
META = "meta.json"
LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """Step folders exist but none verifies and loads (the run refuses to start over), or a
    save found no space left; the message says what to change."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj) -> list:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank (a decision taken once, so no rank can diverge)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _single_process_quiet():
    """Silence DCP's warning that a world of one saves/loads in a single process (intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def _complete(folder: Path) -> bool:
    """Cheap test (no hashing): the save got as far as its manifest (or it is a whole
    checkpoint written before manifests existed: :func:`_legacy`)."""
    return (folder / MANIFEST).is_file() or _legacy(folder)


def _legacy(folder: Path) -> bool:
    """A ``step-N`` folder without a manifest but with ``.metadata`` and a ``meta.json`` that
    does not record a manifest: saved by an mpcore from before manifests (it renamed its
    folders into place only once whole, so the name alone says it finished). Saves now write
    the manifest before that rename, and meta.json says so (:func:`_wrote_manifest`), so a
    folder whose manifest is lost is damaged, not legacy."""
    return (not (folder / MANIFEST).exists() and (folder / ".metadata").is_file()
            and (folder / META).is_file() and not _wrote_manifest(folder))


def _wrote_manifest(folder: Path) -> bool:
    """meta.json says its save wrote a manifest: the key ``manifest`` (written by this
    module), or ``data_fingerprint`` (every mpcore that wrote manifests also wrote that, and
    none before it did). An unreadable meta.json counts as yes: nothing vouches for it."""
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return True
    return not isinstance(meta, dict) or "manifest" in meta or "data_fingerprint" in meta


def step_folders(root: str | Path) -> list[Path]:
    """Every ``step-N`` folder of ``root`` (complete or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name))
             and p.is_dir()]
    return [p for _, p in sorted(found)]


def complete_checkpoints(root: Path) -> list[Path]:
    """``step-N`` folders of ``root`` that have a manifest, oldest first."""
    return [p for p in step_folders(root) if _complete(p)]


def _pointer(root: Path) -> Path | None:
    """The folder ``root/latest`` names, or None; a damaged pointer is reported by name."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        name = f"<unreadable: {e}>"
    if not _STEP.match(name):
        log.warning("checkpoint pointer %s is damaged (holds %r, not step-N); ignored: the "
                    "newest step folder that verifies is used", pointer, name[:80])
        return None
    if not (root / name).is_dir():
        log.warning("checkpoint pointer %s names %s, which does not exist; ignored", pointer,
                    name)
        return None
    return root / name


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint (pointer first, else the newest with a manifest), or
    None. Does not hash: :func:`verify_checkpoint` does."""
    root = Path(root)
    folder = _pointer(root)
    if folder is not None and _complete(folder):
        return folder
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META
    if not path.is_file():
        raise ValueError(f"{folder} is not a complete checkpoint (no {META}); pass a step-N "
                         f"folder written by launch/pretrain.py")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is damaged ({e}); resume from another step-N folder") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise ValueError(f"{path} is not a checkpoint's meta.json (no step); resume from another "
                         f"step-N folder")
    return meta


def verify_checkpoint(folder: str | Path, rank: int = 0, world: int = 1) -> list[str]:
    """Problems of checkpoint ``folder``, one line each (empty: every byte is as saved).

    Collective when ``world > 1``: every rank reads the manifest and hashes the files
    ``sorted(files)[rank::world]``, so the world reads the checkpoint once in total.
    """
    folder = Path(folder)
    if _legacy(folder):
        if rank == 0:
            log.warning("%s has no %s (saved before checkpoints recorded their files): its "
                        "bytes cannot be verified; loading it as it is", folder, MANIFEST)
        return []
    files, why = read_manifest(folder)
    if files is None:
        if not (folder / MANIFEST).exists() and (folder / META).is_file():
            why = (f"no {MANIFEST}, although {META} records that its save wrote one: the "
                   f"manifest was lost, so nothing vouches for the other files")
        return [why]
    names = sorted(files)
    parts = _all_gather(check_files(folder, files, names[rank::world]))
    unreadable = [u for _, part in parts for u in part]
    if unreadable:
        raise CheckpointError(
            f"cannot read checkpoint {folder} (after {READ_ATTEMPTS} attempts): "
            f"{'; '.join(unreadable[:4])}. A read error is not damage: the checkpoint is left "
            f"as it is. Check the filesystem (dmesg, the mount) and the files' permissions, "
            f"then rerun; to use an older checkpoint instead, move this folder away")
    problems = [p for part, _ in parts for p in part]
    return problems or _unlisted(folder, files)


def _unlisted(folder: Path, files: dict[str, dict]) -> list[str]:
    """Files that loading reads but the manifest does not vouch for: any file of the folder,
    every file ``.metadata`` names (call only once the listed files verified)."""
    problems = [f"{folder / n} is not listed in {MANIFEST}" for n in (".metadata", META)
                if n not in files]
    on_disk = {p.name for p in folder.iterdir() if p.is_file()} - {MANIFEST}
    problems += [f"{folder / n} is in the folder but not in {MANIFEST} (the save did not "
                 f"write it)" for n in sorted(on_disk - set(files))]
    if problems:
        return problems
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
        read = {info.relative_path for info in (metadata.storage_data or {}).values()}
    except Exception as e:  # a .metadata that verified but does not parse: damaged when saved
        return [f"{folder / '.metadata'} cannot be parsed ({type(e).__name__}: {e})"]
    return [f"{folder / n} is read by .metadata but not listed in {MANIFEST}"
            for n in sorted(read - set(files))]


def save_checkpoint(root: str | Path, step: int, tensors: dict[str, torch.Tensor], meta: dict,
                    *, keep_last: int, rank: int,
                    hook: Callable[[str, Path], None] | None = None) -> Path:
    """Save ``tensors`` (this rank's keys) and ``meta`` as ``ROOT/step-<step>``. Collective.

    ``hook(stage, path)`` is called on rank 0 at ``"begin"`` (empty temporary folder),
    ``"meta"`` (DCP files and meta.json written), ``"written"`` (manifest written, not yet
    renamed), ``"renamed"`` and ``"latest"`` (pointer replaced, nothing pruned yet); tests use
    it to kill the process at each point.

    A failure on any rank fails the save on every rank (no rank waits for another forever);
    the temporary folder is removed at once. Out of space (``mpcore.io_errors``) raises
    :class:`CheckpointError` saying where, how much a save needs and what to change; any other
    failure raises ``RuntimeError`` naming the rank and the error.
    """
    save = begin_save(root, step, meta, keep_last=keep_last, rank=rank, hook=hook)
    mine, failure = {}, save.failure
    if failure is None:
        try:
            with _single_process_quiet():
                dcp.save(tensors, checkpoint_id=save.tmp, no_dist=not dist.is_initialized())
            mine = own_entries(save.tmp, rank)
        except (Exception, CheckpointException) as e:  # CheckpointException: BaseException
            failure = _failed(e, rank)
    return finish_save(save, mine, _nbytes(tensors), failure)


@dataclasses.dataclass
class PendingSave:
    """A save between :func:`begin_save` and :func:`finish_save` (its DCP files may be being
    written in the background: ``mpcore.checkpoint_async``)."""

    root: Path
    step: int
    tmp: Path
    final: Path
    meta: dict
    keep_last: int
    rank: int
    hook: Callable[[str, Path], None] | None
    previous: Path | None  # the newest complete checkpoint before this save (rank 0)
    failure: tuple | None  # _failed(...) of the temporary folder's creation


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def begin_save(root: str | Path, step: int, meta: dict, *, keep_last: int, rank: int,
               hook=None) -> PendingSave:
    """Rank 0 makes the empty ``tmp-step-N``; every rank then may write into it. Collective."""
    root = Path(root)
    tmp, final = root / f"tmp-step-{step}", step_dir(root, step)
    previous = latest_checkpoint(root) if rank == 0 else None
    failure = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            failure = _failed(e, 0)
        if hook and failure is None:
            hook("begin", tmp)
    failure = from_rank0(failure)  # also the barrier before every rank writes
    return PendingSave(root, step, tmp, final, meta, keep_last, rank, hook, previous, failure)


def own_entries(tmp: Path, rank: int) -> dict[str, dict]:
    """Manifest entries of the ``.distcp`` files this rank wrote (hashed and synced): each
    rank reads only its own share (module docstring)."""
    return {p.name: file_entry(p) for p in sorted(tmp.glob(f"__{rank}_*.distcp"))}


def finish_save(save: PendingSave, mine: dict[str, dict], nbytes: int,
                failure: tuple | None) -> Path:
    """Every rank's entries to rank 0, which commits (meta, manifest, rename, pointer,
    rotation); or, when any rank failed, the partial save is removed and every rank raises
    (:func:`save_checkpoint`). Collective."""
    gathered = _all_gather((mine, nbytes, failure))
    failure = next((f for _, _, f in gathered if f), None)
    if save.rank == 0 and failure is None:
        try:
            _commit(save.root, save.tmp, save.final, save.meta, [m for m, _, _ in gathered],
                    save.keep_last, save.hook)
        except OSError as e:
            failure = _failed(e, 0)
    failure = from_rank0(failure)  # the barrier after rank 0 committed
    if failure is not None:
        _give_up(save.root, save.tmp, save.step, save.keep_last, failure,
                 sum(n for _, n, _ in gathered), save.previous, save.rank)
    return save.final


def _failed(exc: BaseException, rank: int) -> tuple[bool, str, tuple[str, int] | None]:
    """(out of space?, one line naming the rank and the error, (file, errno) of a write the
    storage refused: read-only or no permission) of a save's failure."""
    text = str(exc).strip().splitlines()
    refused = refused_write(exc)
    where = (str(refused.filename or ""), refused.errno) if refused is not None else None
    return (out_of_space(exc), f"rank {rank}: {type(exc).__name__}: {text[-1] if text else ''}",
            where)


def _commit(root: Path, tmp: Path, final: Path, meta: dict, entries: list[dict],
            keep_last: int, hook) -> None:
    """Rank 0: meta.json, the manifest, rename into place, the pointer, rotation."""
    # "manifest": this folder had one, so without it the folder is damaged (_legacy).
    atomic.write_text(tmp / META, json.dumps({**meta, "manifest": MANIFEST_FORMAT}, indent=1))
    if hook:
        hook("meta", tmp)
    files = {name: entry for part in entries for name, entry in part.items()}
    for path in sorted(tmp.iterdir()):  # .metadata, meta.json, anything no rank claimed
        if path.is_file() and path.name not in files:
            files[path.name] = file_entry(path)
    _write_manifest(tmp, files)
    fsync_dir(tmp)
    if hook:
        hook("written", tmp)
    _rename_into_place(root, tmp, final)
    if hook:
        hook("renamed", final)
    atomic.write_text(root / LATEST, final.name + "\n")
    fsync_dir(root)
    if hook:
        hook("latest", final)
    _prune(root, keep_last, keep=final)


def _give_up(root: Path, tmp: Path, step: int, keep_last: int, failure: tuple,
             total_bytes: int, previous: Path | None, rank: int) -> None:
    """Remove the partial save (rank 0) and raise the save's error on every rank."""
    full, line, refused = failure
    message = None
    if refused is not None and not full:  # read-only or no permission: say so, by path
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            kept = (f"the newest checkpoint, {previous}, is intact" if previous else
                    "no earlier checkpoint exists")
            message = (f"{StorageError(refused[0] or root, refused[1], 'checkpoint.dir')}; "
                       f"saving step {step} in {root} failed, the partial save was removed "
                       f"and {kept}; fix that and rerun the same command to resume")
        raise CheckpointError(from_rank0(message))
    if rank == 0:
        if previous is not None and previous.is_dir():
            size, basis = folder_bytes(previous), f"the size of {previous.name}"
        else:
            size, basis = total_bytes, "the tensors this save wrote"
        full = full or shutil.disk_usage(mount_of(root)).free < size
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            message = no_space_message(root, step, keep_last, size, basis, previous)
    message = from_rank0(message)
    if message:
        raise CheckpointError(message)
    raise RuntimeError(f"saving checkpoint step {step} in {root} failed ({line}); the partial "
                       f"save was removed, the newest checkpoint is intact")


def _rename_into_place(root: Path, tmp: Path, final: Path) -> None:
    if final.exists():  # re-saving a step (e.g. after a restart): replace it
        old = root / f"old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        fsync_dir(root)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(root)


def _finite(folder: Path) -> bool:
    """Saved from a finite state: no non-finite streak was running (cheap: meta.json only)."""
    try:
        return int(json.loads((folder / META).read_text()).get("consecutive_bad", 0)) == 0
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError):
        return False


def newest_finite(root: str | Path) -> Path | None:
    """The newest complete checkpoint saved from a finite state (what rotation keeps)."""
    finite = [p for p in complete_checkpoints(Path(root)) if _finite(p)]
    return finite[-1] if finite else None


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    """Delete complete checkpoints but the newest ``keep_last`` (never ``keep`` nor the newest
    one saved from a finite state), and leftover temporaries."""
    complete = complete_checkpoints(root)
    protected = {keep, newest_finite(root)}
    for folder in complete[:-keep_last]:
        if folder not in protected:
            # Renamed first: a process killed during the delete leaves pruned-step-N, never
            # a step-N that lost part of its files (removed at the next save or start).
            doomed = root / f"pruned-{folder.name}"
            shutil.rmtree(doomed, ignore_errors=True)
            folder.rename(doomed)
            fsync_dir(root)
            shutil.rmtree(doomed, ignore_errors=True)
    for folder in root.iterdir():
        if folder.name.startswith(("tmp-step-", "old-step-", "pruned-step-")):
            shutil.rmtree(folder, ignore_errors=True)


def remove_partial_saves(root: Path) -> None:
    """Delete ``tmp-step-N`` folders: saves that never finished (killed, or out of space), which
    are never loaded and may hold most of a checkpoint's bytes."""
    if not root.is_dir():
        return
    for folder in sorted(root.glob("pruned-step-*")):  # rotation killed while deleting it
        shutil.rmtree(folder, ignore_errors=True)
    for folder in sorted(root.glob("tmp-step-*")):
        size = folder_bytes(folder) if folder.is_dir() else 0
        shutil.rmtree(folder, ignore_errors=True)
        log.info("removed %s: a save that did not finish (%s)", folder, human(size))


def _move_aside(folder: Path) -> Path:
    """Rename a checkpoint that failed to ``bad-step-N`` (kept for inspection, never loaded)."""
    target = folder.with_name(f"bad-{folder.name}")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"bad-{folder.name}.{n}")
    folder.rename(target)
    fsync_dir(folder.parent)
    return target


def _agreed_failure(problem: str | None) -> str | None:
    """The first rank's problem when any rank had one, on every rank."""
    return next((p for p in _all_gather(problem) if p), None)


def resume_newest(root: str | Path, load: Callable[[Path, dict], None], *, rank: int = 0,
                  world: int = 1, only: Path | None = None) -> tuple[Path, dict] | None:
    """Load the newest checkpoint of ``root`` that verifies and loads (module docstring).

    ``load(folder, meta)`` restores it on every rank (collective); a ``ValueError`` it raises
    (a config that does not match, another model) stops the run; any other failure counts as a
    damaged checkpoint and the next older one is tried. ``only``: try that folder alone.
    Returns ``(folder, meta)``, or None when ``root`` holds no step folders. Raises
    :class:`CheckpointError` when folders exist and none can be used. Collective.
    """
    root = Path(root)
    if rank == 0 and only is None:
        _pointer(root)  # reports a damaged pointer
        remove_partial_saves(root)
    candidates = from_rank0([only] if only else step_folders(root)[::-1])
    failed: list[tuple[Path, list[str]]] = []
    for folder in candidates:
        problems = verify_checkpoint(folder, rank, world)
        meta = None
        if not problems:
            try:
                meta = read_meta(folder)
            except ValueError as e:
                problems = [str(e)]
        if not problems:
            problem = None
            unreadable = None
            try:
                load(folder, meta)
            except ValueError:
                raise
            except (Exception, CheckpointException) as e:  # CheckpointException: BaseException
                problem = f"loading failed: {type(e).__name__}: {str(e).strip()[:400]}"
                cause = read_error(e)
                unreadable = f"{cause.filename or folder}: {cause.strerror}" if cause else None
            unreadable = _agreed_failure(unreadable)
            if unreadable:  # the storage failed, not the checkpoint: never set it aside
                raise CheckpointError(
                    f"cannot read checkpoint {folder} while loading it ({unreadable}). A read "
                    f"error is not damage: the checkpoint is left as it is. Check the "
                    f"filesystem and permissions, then rerun")
            problem = _agreed_failure(problem)
            problems = [problem] if problem else []
        if not problems:
            _report_skipped(failed, folder, rank)
            return folder, meta
        failed.append((folder, problems))
    if failed:
        listing = "\n".join(f"  {f}: " + "; ".join(p) for f, p in failed)
        raise CheckpointError(
            f"no checkpoint in {root} can be resumed; every step folder failed:\n{listing}\n"
            f"Fix: move these folders away (e.g. mv {root} {root}.damaged) and rerun to start "
            f"over, or start over in place with checkpoint.resume=false "
            f"checkpoint.overwrite=true (which deletes them)")
    return None


def _report_skipped(failed: list[tuple[Path, list[str]]], used: Path, rank: int) -> None:
    _barrier()  # every rank is done reading before anything is renamed
    if rank != 0:
        return
    for folder, problems in failed:
        aside = _move_aside(folder)
        log.warning("checkpoint %s cannot be used: %s; moved to %s; resuming from the older %s",
                    folder, "; ".join(problems), aside, used)


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
