"""Before a resume: is this config the same run as the checkpoint's, or another run?

The checkpoint's ``meta.json`` holds the config it was saved with and a fingerprint of its data
(:func:`data_fingerprint`). :func:`check_resume` compares them with the current run.

Refused (they change the data order or what a step means), listed as ``key: saved -> now``:
    data.paths, data.tokenizer   by CONTENT (fingerprints), so moved or copied files still resume
    data.global_batch            micro_batch x grad_accum x dp; the split may change (resharding)
    data.seq_len, data.seed, data.weights, data.valid_fraction, training.seed
    data.vl_paths, data.vl_drop_long   the image-text datasets (by path) and which samples stay
    schedule.total_steps         the schedule's length (``Config.total_steps``), warmup_steps,
                                 decay, min_lr_ratio
    model.*                      the model (the vision tower and freeze_vision included), but
                                 for choices of kernels or layout that compute the same model:
                                 init_from, family (auto or the name it resolves to: the
                                 fields say what the model is), max_position_embeddings,
                                 attention_backend, fp8, linear_backend, vision_cp
A key named in ``checkpoint.accept_changes`` is accepted instead (logged).

Allowed and logged: everything else (logging.*, checkpoint.every / keep_last, the parallel
layout, optimizer.*, training.max_steps, ...), including keys added later outside ``model``
unless they are listed here. One exception is kept deliberately lenient:
when ``schedule.total_steps`` is null in both configs the schedule follows ``max_steps``, so
raising ``max_steps`` stretches it; that is allowed with a warning saying how to keep it.

Fingerprint of a file: its size and the sha256 of its bytes, all of them below 8 MiB, else 64
blocks of 64 KiB spread evenly from the first to the last byte (cost: 4 MiB read per file). A
re-tokenised or different corpus differs everywhere, so sampling finds it; an edit confined
between sampled blocks is not found.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mpcore.config import Config, to_dict

_WHOLE_BELOW = 8 << 20
_BLOCKS, _BLOCK = 64, 64 << 10
_EXEMPT_MODEL = ("init_from", "family", "max_position_embeddings", "attention_backend", "fp8",
                 "linear_backend", "vision_cp")
REFUSED = ("data.seq_len", "data.seed", "data.weights", "data.valid_fraction", "data.vl_paths",
           "data.vl_drop_long", "training.seed", "schedule.warmup_steps", "schedule.decay",
           "schedule.min_lr_ratio")


def file_fingerprint(path: str | Path) -> str:
    """``"<size> bytes, sha256 <hex>"`` of ``path`` (sampled when large; module docstring)."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size < _WHOLE_BELOW:
            digest.update(f.read())
        else:
            for i in range(_BLOCKS):
                f.seek((size - _BLOCK) * i // (_BLOCKS - 1))
                digest.update(f.read(_BLOCK))
    return f"{size} bytes, sha256 {digest.hexdigest()[:16]}"


def data_fingerprint(cfg: Config) -> dict:
    """``{"tokenizer": fp, "datasets": [fp of PREFIX.bin + fp of PREFIX.idx, ...]}`` of the
    data ``cfg`` trains on (the default corpus included)."""
    from mpcore.batches import dataset_sources  # the data layer: only when fingerprinting

    tokenizer, prefixes = dataset_sources(cfg)
    return {"tokenizer": file_fingerprint(tokenizer),
            "datasets": [f"{file_fingerprint(f'{p}.bin')}; idx {file_fingerprint(f'{p}.idx')}"
                         for p in prefixes]}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "rope_scaling":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _refused(key: str) -> bool:
    if key.startswith("model."):
        return key.split(".", 1)[1] not in _EXEMPT_MODEL
    return key in REFUSED


def compare(meta: dict, cfg: Config, dp: int, fingerprint: dict | None) -> tuple[list, list]:
    """``(refused, allowed)``: lists of ``(key, saved, now)`` between ``meta`` (a checkpoint's
    meta.json) and the current ``cfg`` at data-parallel degree ``dp``."""
    saved, now = _flat(meta["config"]), _flat(to_dict(cfg))
    refused, allowed = [], []
    for key in sorted(saved.keys() & now.keys()):  # a key one version lacks is not compared
        if key in ("data.paths", "data.tokenizer", "schedule.total_steps"):
            continue  # compared by content or effective value below
        if saved[key] != now[key]:
            (refused if _refused(key) else allowed).append((key, saved[key], now[key]))
    old_fp = meta.get("data_fingerprint")
    if fingerprint is not None and old_fp is not None:
        for key, part in (("data.paths", "datasets"), ("data.tokenizer", "tokenizer")):
            if old_fp[part] != fingerprint[part]:
                refused.append((key, old_fp[part], fingerprint[part]))
    for key in ("data.paths", "data.tokenizer"):
        if saved.get(key) != now.get(key) and not any(r[0] == key for r in refused):
            allowed.append((key + " (same content)", saved.get(key), now.get(key)))
    old_batch = saved["data.micro_batch"] * saved["data.grad_accum"] * meta["layout"]["dp"]
    new_batch = cfg.data.micro_batch * cfg.data.grad_accum * dp
    if old_batch != new_batch:
        refused.append(("data.global_batch", old_batch, new_batch))
    old_total = saved["schedule.total_steps"] or saved["training.max_steps"]
    if old_total != cfg.total_steps:
        follows = saved["schedule.total_steps"] is None and cfg.schedule.total_steps is None
        (allowed if follows else refused).append(
            ("schedule.total_steps" + (" (follows training.max_steps)" if follows else ""),
             old_total, cfg.total_steps))
    return refused, allowed


def check_resume(folder: Path, meta: dict, cfg: Config, dp: int,
                 fingerprint: dict | None) -> list[str]:
    """Raise ``ValueError`` listing what may not change (and how to proceed); else return the
    allowed changes as ``key: saved -> now`` lines to log."""
    refused, allowed = compare(meta, cfg, dp, fingerprint)
    accepted = set(cfg.checkpoint.accept_changes)
    allowed += [(f"{k} (checkpoint.accept_changes)", a, b) for k, a, b in refused
                if k in accepted]
    refused = [r for r in refused if r[0] not in accepted]
    if refused:
        lines = "\n".join(f"  {k}: {a} -> {b}" for k, a, b in refused)
        keys = ",".join(k for k, _, _ in refused)
        raise ValueError(
            f"cannot resume {folder}: this config changes what the checkpoint's run trains on "
            f"or what a step means:\n{lines}\nTo proceed: set the saved values again (see "
            f"{folder}/meta.json, key config), or start a new run in another folder "
            f"(logging.run_dir=...), or accept the change explicitly with "
            f"checkpoint.accept_changes=[{keys}]")
    out = [f"{k}: {a} -> {b}" for k, a, b in allowed]
    if any(k.startswith("schedule.total_steps (follows") for k, _, _ in allowed):
        out.append("the learning-rate schedule now ends at the new training.max_steps; set "
                   "schedule.total_steps to the old length to keep it instead")
    return out
