"""Where launch/export_hf.py writes, and what it reads: nothing the user owns is replaced.

- :func:`check_output` (before any work): ``--output`` is a folder that does not exist yet, an
  empty one, or, with ``--overwrite``, an earlier export (only files an export writes); never
  an existing file, a run folder (``metrics.jsonl``, ``config.yaml``) or a checkpoint folder
  or anything inside one (``step-N`` folders, ``latest``, ``manifest.json``, ``meta.json``),
  whatever ``--overwrite`` says.
- :func:`check_checkpoint`: the checkpoint's manifest verifies (``mpcore.checkpoint``'s
  ``verify_checkpoint``, what resume runs); a damaged one is refused naming the file.
- :func:`staging_folder` / :func:`swap_in`: the export is written into ``.<name>.tmp-<pid>``
  beside ``--output``, every file fsynced, then renamed into place (an earlier export is moved
  aside first and removed after), so a killed export never leaves a folder that looks whole.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from mpcore.atomic import fsync_dir
from mpcore.checkpoint import complete_checkpoints, step_folders, verify_checkpoint

log = logging.getLogger(__name__)
# What an export (ours or a Hugging Face save) puts in a model folder.
EXPORT_FILES = {"config.json", "generation_config.json", "model.safetensors",
                "model.safetensors.index.json", "tokenizer.model", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "preprocessor_config.json",
                "chat_template.json", "chat_template.jinja", "added_tokens.json"}
_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")
RUN_FILES = ("metrics.jsonl", "config.yaml")
CHECKPOINT_FILES = ("latest", "manifest.json", "meta.json", ".metadata")


def _checkpoint_reason(folder: Path) -> str | None:
    """Why ``folder`` is a checkpoint or a checkpoint root, or None."""
    if step_folders(folder):
        return "holds step-N folders"
    found = [name for name in CHECKPOINT_FILES if (folder / name).exists()]
    return f"holds {', '.join(found)}" if found else None


def check_output(output: Path, overwrite: bool) -> None:
    """``ValueError`` naming the fix when ``output`` may not be written (module docstring)."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is an existing file; an export is a folder "
                         f"(config.json, model.safetensors, the tokenizer): pass a new folder "
                         f"such as {output.with_suffix('')}-hf")
    real = Path(os.path.realpath(output))
    for folder in [real, *real.parents]:
        why = _checkpoint_reason(folder) if folder.is_dir() else None
        if why:
            where = "is" if folder == real else f"is inside {folder}:"
            raise ValueError(f"--output {output} {where} a checkpoint folder (it {why}); an "
                             f"export never writes into one: pass a folder of its own, e.g. "
                             f"RUN/hf")
    if real.is_dir():
        run = [name for name in RUN_FILES if (real / name).exists()]
        if run:
            raise ValueError(f"--output {output} is a run folder (it holds {', '.join(run)}); "
                             f"an export never writes into one: pass a folder of its own, e.g. "
                             f"{output / 'hf'}")
    names = sorted(p.name for p in real.iterdir()) if real.is_dir() else []
    if not names:
        return
    if not overwrite:
        raise ValueError(f"--output {output} already holds files ({', '.join(names[:5])}"
                         f"{' ...' if len(names) > 5 else ''}); pass --overwrite to replace "
                         f"that export, or choose a new or empty folder")
    foreign = [n for n in names if n not in EXPORT_FILES and not _SHARD.match(n)]
    if foreign:
        raise ValueError(f"--output {output} holds files an export does not write "
                         f"({', '.join(foreign[:5])}); --overwrite replaces the folder as a "
                         f"whole, so move them away or choose another folder")


def check_checkpoint(folder: Path) -> None:
    """``ValueError`` naming the damaged file(s) when ``folder`` does not verify."""
    problems = verify_checkpoint(folder)
    if not problems:
        return
    older = [p for p in complete_checkpoints(folder.parent) if p != folder]
    hint = (f"export an older one (--checkpoint {older[-1]}) or " if older else "")
    raise ValueError(f"checkpoint {folder} is damaged, so it is not exported: "
                     f"{'; '.join(problems)}; {hint}export it again from a good copy")


def staging_folder(output: Path) -> Path:
    """A fresh hidden folder beside ``output`` for this process to write the export into."""
    real = Path(os.path.realpath(output))
    real.parent.mkdir(parents=True, exist_ok=True)
    for left in real.parent.glob(f".{real.name}.tmp-*"):
        log.warning("%s is left over from an export of %s that did not finish; delete it "
                    "when no export runs", left, output)
    stage = real.with_name(f".{real.name}.tmp-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    return stage


def swap_in(stage: Path, output: Path) -> None:
    """fsync every file of ``stage``, then rename it to ``output`` (an earlier export there is
    moved aside first and removed after: there is always the old or the new one whole)."""
    for path in stage.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(stage)
    real = Path(os.path.realpath(output))
    old = None
    if real.is_dir() and any(real.iterdir()):
        old = real.with_name(f".{real.name}.old-{os.getpid()}")
        real.rename(old)
    os.replace(stage, real)  # onto a missing or empty folder
    fsync_dir(real.parent)
    if old is not None:
        shutil.rmtree(old)
