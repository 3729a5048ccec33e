"""What a checkpoint folder holds: ``manifest.json``, a size and a sha256 per file.

    {"format": 1, "algorithm": "sha256",
     "files": {"__0_0.distcp": {"size": 123, "sha256": "9f..."}, ".metadata": {...}, ...}}

A save writes the manifest LAST, after every other file of the folder is written and synced,
and before the folder is renamed into place (``mpcore.checkpoint``); a load first checks each
listed file's size and hash. So a folder with a manifest that verifies holds exactly the bytes
that were saved: a truncated ``.distcp``, a damaged ``.metadata``, a flipped byte anywhere, or a
``meta.json`` edited by hand is found before any of it is read into the model. A file that
cannot be read (EIO, EACCES) is not damage: it is retried, then reported apart
(:func:`check_files`), so a good checkpoint is never set aside for a passing read error.

Cost: one streaming read per file in 4 MiB chunks (sha256 runs at about 1 GB/s per core with
the CPU's SHA instructions); memory stays one chunk. :func:`file_entry` also fsyncs the file it
hashes, so hashing doubles as the flush to stable storage before the rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 4 << 20
READ_ATTEMPTS, RETRY_S = 3, 0.5  # 0.5 s, then 1 s between attempts


def file_entry(path: Path, sync: bool = True) -> dict:
    """``{"size", "sha256"}`` of ``path``, read in chunks; fsyncs it first when ``sync``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
            size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def write_manifest(folder: Path, files: dict[str, dict]) -> None:
    """Write ``folder/manifest.json`` listing ``files`` (name -> entry), synced."""
    body = json.dumps({"format": FORMAT, "algorithm": "sha256", "files": files}, indent=1,
                      sort_keys=True)
    with open(Path(folder) / MANIFEST, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: Path) -> tuple[dict[str, dict] | None, str | None]:
    """``(files, None)`` from ``folder/manifest.json``, or ``(None, why it is unusable)``."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None, (f"no {MANIFEST}: the save did not finish (or the folder was written by an "
                      f"mpcore without manifests)")
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        if body.get("format") != FORMAT or not isinstance(files, dict) or not files:
            raise ValueError("unknown format")
        for entry in files.values():
            int(entry["size"]), str(entry["sha256"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return None, f"{path} is unreadable or damaged ({type(e).__name__}: {e})"
    return files, None


def _entry_with_retries(path: Path) -> dict:
    """:func:`file_entry` (no sync), tried ``READ_ATTEMPTS`` times: a read error (EIO on a
    flaky network filesystem, EACCES while permissions are being fixed) may pass."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return file_entry(path, sync=False)
        except FileNotFoundError:
            raise
        except OSError:
            if attempt == READ_ATTEMPTS - 1:
                raise
            time.sleep(RETRY_S * 2 ** attempt)
    raise AssertionError


def check_files(folder: Path, files: dict[str, dict],
                names: list[str]) -> tuple[list[str], list[str]]:
    """``(problems, unreadable)`` of ``names`` against their manifest entries, one line each
    naming the file. A problem is damage (missing, wrong size, wrong hash); unreadable lists
    files that exist but could not be read (after retries): not damage, the caller stops."""
    problems, unreadable = [], []
    for name in names:
        path, want = Path(folder) / name, files[name]
        try:
            info = os.stat(path)
            if not stat.S_ISREG(info.st_mode):
                problems.append(f"{path} is not a regular file (the save wrote one)")
                continue
            if info.st_size != want["size"]:
                problems.append(f"{path} has {info.st_size} bytes, the save wrote "
                                f"{want['size']} (truncated or overwritten)")
                continue
            got = _entry_with_retries(path)["sha256"]
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        except OSError as e:
            unreadable.append(f"{path}: {type(e).__name__}: {e.strerror or e}")
            continue
        if got != want["sha256"]:
            problems.append(f"{path} does not match its sha256 in {MANIFEST} (damaged in place)")
    return problems, unreadable
