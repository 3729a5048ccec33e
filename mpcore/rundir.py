"""One run per run directory, and a ``metrics.jsonl`` that matches the checkpoint resumed.

:class:`RunLock`: rank 0 holds an exclusive lock (``mpcore.lockfile``) on ``<run_dir>/.lock``
(and on ``<checkpoint dir>/.lock`` when the checkpoints live elsewhere) for the whole run; the
file holds the holder's pid and host. A second run on the same folder refuses, naming them.

The deleted run folder: a lock that lives in the folder it protects stops protecting it when
the folder is deleted (``rm -rf run`` while the run trains): the holder keeps its lock on the
unlinked file, and the same command started again creates the folder, a new lock file, and
takes it. If the first run then wrote on (a checkpoint save creates its folder again), the
second would resume the first's checkpoints while both append to one ``metrics.jsonl``. So the
holder checks (:meth:`RunLock.lost`: two ``stat`` calls) that each lock file at its path is
still the inode it holds, before each write of a metrics row and at every step boundary, which
comes before each checkpoint save; when a folder was deleted or replaced, every rank stops
there, writing nothing more, and the run exits 2 with a message saying so
(``mpcore.train.Trainer``; the ranks agree with the stop flag's all-reduce). A deletion
during a save (a background one included) or a metrics write makes that write fail; the run
then checks again and reports the deleted folder, not the failed write. What this cannot
close: a deletion in the microseconds between a check and the ``mkdir`` that starts a save
(which would create the folder again for that one save).

:func:`claim_run_dir` also applies the start-over policy: a run that will not resume
(``checkpoint.resume=false``) in a folder that holds checkpoints refuses, unless
``checkpoint.overwrite=true``, which deletes them and ``metrics.jsonl`` first. So does a run
whose checkpoint dir holds no checkpoint while the run folder shows an earlier run that saved
some (:func:`_earlier_run`: its ``config.yaml`` names another checkpoint dir that holds them,
``<run_dir>/checkpoints`` holds them, or ``metrics.jsonl`` has rows past a save point): starting
at step 0 there would cut that run's ``metrics.jsonl`` back, so it is refused, not done.

:func:`rewrite_metrics`: after a resume at step S, rows with ``step > S`` (steps that will be
run again) are dropped, by writing a new file and renaming it over the old one, so each step
appears once. A line that is not a row (a torn last line after a crash, or a line damaged in
the middle) is never dropped unseen: it moves, byte for byte, to ``metrics.jsonl.corrupt-N``
and a warning names its line number and that file; the rows after it stay.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import yaml

from mpcore import atomic, lockfile
from mpcore.checkpoint import LATEST, from_rank0, step_folders
from mpcore.config import Config
from mpcore.io_errors import writing

log = logging.getLogger(__name__)
LOCK = ".lock"
METRICS = "metrics.jsonl"


class RunLock:
    """Exclusive locks on ``folders`` (module docstring); :meth:`release` drops them.
    ``settings``: the config key that chose each folder (named by a storage error's fix)."""

    def __init__(self, folders: list[Path], settings: list[str] | None = None):
        self.files, self.paths = [], []
        settings = settings or ["logging.run_dir / checkpoint.dir"] * len(folders)
        try:
            for folder, setting in zip(folders, settings, strict=True):
                with writing(folder, setting):
                    self._take(Path(folder))
        except BaseException:
            self.release()
            raise

    def _take(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK
        try:
            f = lockfile.take(path)
        except lockfile.LockBusy as e:
            raise ValueError(f"{folder} is in use by another run ({e.holder}, lock {path}); wait "
                             f"for it to finish or stop it, or give this run its own folder "
                             f"(logging.run_dir=... / checkpoint.dir=...)") from None
        if f is not None:
            self.files.append(f)
            self.paths.append(path)

    def lost(self) -> str | None:
        """Why a locked folder is no longer this run's (deleted, or replaced by another
        folder, perhaps another run's), or None while every lock file is still the one held.
        Costs two stat calls per folder (module docstring: the deleted run folder)."""
        for f, path in zip(self.files, self.paths, strict=True):
            if lockfile.still_at(f, path):
                continue
            holder = lockfile.holder_of(path)
            now = (f"{path} is another file now, held by {holder}" if holder else
                   f"{path} is gone" if not path.parent.exists() else
                   f"{path} is another file now")
            return (f"{path.parent} was deleted or replaced while this run was using it "
                    f"({now})")
        return None

    def release(self) -> None:
        """Unlock (the file stays: deleting it would race with a run taking it)."""
        for f in self.files:
            f.close()  # closing the last descriptor drops the flock
        self.files, self.paths = [], []


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


def _saved_config(run_dir: Path) -> dict:
    """The earlier run's ``config.yaml`` as a dict ({} when absent or unreadable)."""
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _proven_save(rows: list[dict], every: int) -> int | None:
    """A step whose checkpoint must have been saved, going by the metrics rows: saves run every
    ``every`` steps, synchronously, so a row past step k proves the save at k finished unless a
    non-finite streak skipped it (row k has a null loss or grad norm)."""
    if every <= 0 or not rows:
        return None
    by_step = {row["step"]: row for row in rows}
    for k in range(every, max(by_step), every):
        row = by_step.get(k)
        if row is None or (row.get("loss") is not None and row.get("grad_norm") is not None):
            return k
    return None


def _earlier_run(cfg: Config) -> str | None:
    """Why ``cfg``'s run folder holds an earlier run whose checkpoints are not in the checkpoint
    dir (None when the checkpoint dir has step folders, or there is no such evidence)."""
    run_dir, root = Path(cfg.logging.run_dir), cfg.checkpoint_dir
    if step_folders(root):
        return None
    if (root / LATEST).exists():
        return f"{root / LATEST} names a checkpoint that is gone"
    saved = _saved_config(run_dir)
    section = saved.get("checkpoint") if isinstance(saved.get("checkpoint"), dict) else {}
    places = [run_dir / "checkpoints"] + ([Path(section["dir"])] if section.get("dir") else [])
    for place in places:
        if place.resolve() != root.resolve() and step_folders(place):
            return (f"its checkpoints are in {place} (resume them with "
                    f"checkpoint.dir={place})")
    rows = [row for _, row in _parse_metrics(run_dir / METRICS)[0]]
    every = section.get("every", cfg.checkpoint.every)
    step = _proven_save(rows, every if isinstance(every, int) else 0)
    if step is not None:
        return (f"{run_dir / METRICS} has rows up to step {max(r['step'] for r in rows)}, so "
                f"a checkpoint was saved at step {step} or later, and {root} holds none")
    return None


def _claim(cfg: Config) -> RunLock:
    run_dir, root = Path(cfg.logging.run_dir).resolve(), cfg.checkpoint_dir.resolve()
    lock = (RunLock([run_dir], ["logging.run_dir"]) if root.is_relative_to(run_dir) else
            RunLock([run_dir, root], ["logging.run_dir", "checkpoint.dir"]))
    try:
        old = holds_checkpoints(cfg.checkpoint_dir)
        earlier = _earlier_run(cfg)
        if cfg.checkpoint.overwrite:
            if old or earlier:
                _start_over(cfg)
        elif old and not cfg.checkpoint.resume:
            raise ValueError(
                f"checkpoint.resume=false but {cfg.checkpoint_dir} holds checkpoints of an "
                f"earlier run; resume it (checkpoint.resume=true), give this run its own folder "
                f"(logging.run_dir=...), or delete them and start over with "
                f"checkpoint.overwrite=true")
        elif earlier:
            raise ValueError(
                f"{cfg.checkpoint_dir} holds no checkpoint, but {cfg.logging.run_dir} holds an "
                f"earlier run: {earlier}. This run would start at step 0 and cut that run's "
                f"{METRICS} back; point checkpoint.dir at its checkpoints, give this run its own "
                f"folder (logging.run_dir=...), or start over in this folder with "
                f"checkpoint.resume=false checkpoint.overwrite=true")
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


def _parse_metrics(path: Path) -> tuple[list[tuple[bytes, dict]], list[tuple[int, bytes]], bool]:
    """``(rows, bad, unterminated)`` of the metrics file at ``path``: each good line (its bytes
    and its row, an object with an int ``step``), each line that is not one (1-based number,
    bytes), and whether the last line lacks its newline (a write cut short)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return [], [], False
    lines = data.split(b"\n")
    unterminated = lines[-1] != b""
    if not unterminated:
        lines.pop()  # the file ends with a newline, as every whole row does
    rows, bad = [], []
    for number, raw in enumerate(lines, 1):
        try:
            row = json.loads(raw.decode("utf-8"))
            ok = isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(
                row["step"], bool)
        except (UnicodeDecodeError, ValueError):
            ok = False
        if ok:
            rows.append((raw, row))
        elif raw.strip():
            bad.append((number, raw))
    return rows, bad, unterminated and bool(bad) and bad[-1][0] == len(lines)


def _keep_aside(path: Path, bad: list[tuple[int, bytes]], torn: bool) -> Path:
    """Write the ``bad`` lines to ``path.corrupt-N`` (the first N free) and warn, naming it."""
    n = 1
    while path.with_name(f"{path.name}.corrupt-{n}").exists():
        n += 1
    aside = path.with_name(f"{path.name}.corrupt-{n}")
    atomic.write_bytes(aside, b"".join(raw + b"\n" for _, raw in bad))
    numbers = ", ".join(str(number) for number, _ in bad)
    middle = bad[:-1] if torn else bad
    if middle:
        log.warning("%s: line(s) %s are not whole JSON rows (damaged in place); the rows around "
                    "them are kept, and these lines were moved, byte for byte, to %s", path,
                    numbers, aside)
    else:
        log.warning("%s: the last line (%d) was cut short, as when the process dies while "
                    "writing it; removed from %s and kept in %s", path, bad[-1][0], path.name,
                    aside)
    return aside


def rewrite_metrics(path: Path, step: int) -> int:
    """Keep the rows of ``path`` with ``step <= step`` (atomically); returns how many later
    rows were dropped. Lines that are not rows (a torn last line, a line damaged in place) are
    moved to ``path.corrupt-N`` with a warning that names them, never dropped unseen."""
    path = Path(path)
    rows, bad, torn = _parse_metrics(path)
    kept = [raw for raw, row in rows if row["step"] <= step]
    dropped = len(rows) - len(kept)
    if bad:
        _keep_aside(path, bad, torn)
    if dropped or bad or (path.is_file() and not path.read_bytes().endswith(b"\n")):
        atomic.write_bytes(path, b"".join(raw + b"\n" for raw in kept))
    return dropped
