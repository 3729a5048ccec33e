"""Before a resume: is this config the same run as the checkpoint's, or another run?

The checkpoint's ``meta.json`` holds the config it was saved with and a fingerprint of its data
(:func:`data_fingerprint`). :func:`check_resume` compares them with the current run.

Refused (they change the data order or what a step means), listed as ``key: saved -> now``:
    data.paths, data.tokenizer   by CONTENT (fingerprints), so moved or copied files still resume
    data.global_batch            micro_batch x grad_accum x dp; the split may change (resharding)
    data.seq_len, data.seed, data.weights, data.valid_fraction, training.seed
    data.vl_paths                by CONTENT too: each folder's prepared fingerprint (every
                                 image's bytes) and its files (checkpoints from before VL
                                 fingerprints: by path)
    data.vl_drop_long            which image-text samples stay
    schedule.total_steps         the schedule's length (``Config.total_steps``), warmup_steps,
                                 decay, min_lr_ratio
    model.*                      the model (the vision tower and freeze_vision included), but
                                 for choices of kernels or layout that compute the same model:
                                 init_from, family (auto or the name it resolves to: the
                                 fields say what the model is), max_position_embeddings,
                                 attention_backend, fp8, linear_backend, residual_dtype,
                                 vision_cp
A key named in ``checkpoint.accept_changes`` is accepted instead (logged). A checkpoint of
another model family (meta.json ``model_family``: a MoE model's for a dense config, or the
reverse) is refused outright: its tensors belong to another model.

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

from mpcore.batches import dataset_sources
from mpcore.build import run_family
from mpcore.config import Config, to_dict
from mpcore.data.hf_folder import folder_of
from mpcore.data.vl_dataset import folder_fingerprint
from mpcore.vl_data import vl_sources

_WHOLE_BELOW = 8 << 20
_BLOCKS, _BLOCK = 64, 64 << 10
_EXEMPT_MODEL = ("init_from", "family", "max_position_embeddings", "attention_backend", "fp8",
                 "linear_backend", "residual_dtype", "vision_cp")
REFUSED = ("data.seq_len", "data.seed", "data.weights", "data.valid_fraction",
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
    data ``cfg`` trains on (the default corpus included); a vision-language run adds
    ``"vl_datasets"``, one content fingerprint per image-text folder (the default included;
    ``mpcore.data.vl_dataset.folder_fingerprint``) and its tokenizer is the first folder's."""
    def text(prefixes):  # chat data adds its loss mask
        return [f"{file_fingerprint(f'{p}.bin')}; idx {file_fingerprint(f'{p}.idx')}"
                + (f"; mask {file_fingerprint(f'{p}.mask')}" if Path(f"{p}.mask").is_file()
                   else "") for p in prefixes]

    family = run_family(cfg)
    if family.modality == "image-text":
        folders, prefixes, _ = vl_sources(cfg, family)
        return {"tokenizer": file_fingerprint(folders[0] / "tokenizer.json"),
                "datasets": text(prefixes),
                "vl_datasets": [folder_fingerprint(f, file_fingerprint) for f in folders]}
    tokenizer, prefixes = dataset_sources(cfg)
    if tokenizer.suffix != ".model":  # a released tokenizer folder: its tokenizer.json
        tokenizer = folder_of(tokenizer) / "tokenizer.json"
    return {"tokenizer": file_fingerprint(tokenizer), "datasets": text(prefixes)}


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


def _content_changes(old_fp: dict | None, fingerprint: dict | None, saved: dict,
                     now: dict) -> list[tuple]:
    """Refused ``(key, saved, now)`` of the data by content. A VL checkpoint saved before VL
    fingerprints recorded the text tokenizer (not the VL one) and no image data: its text
    datasets are compared by content, its image-text folders by path."""
    parts = [("data.paths", "datasets"), ("data.tokenizer", "tokenizer"),
             ("data.vl_paths", "vl_datasets")]
    by_path = old_fp is None or fingerprint is None or (
        "vl_datasets" in fingerprint and "vl_datasets" not in old_fp)
    out = []
    if old_fp is not None and fingerprint is not None:
        for key, part in parts[:1] if by_path else parts:
            if old_fp.get(part) != fingerprint.get(part):
                out.append((key, old_fp.get(part), fingerprint.get(part)))
    if by_path and saved.get("data.vl_paths") != now.get("data.vl_paths"):
        out.append(("data.vl_paths", saved.get("data.vl_paths"), now.get("data.vl_paths")))
    return out


def compare(meta: dict, cfg: Config, dp: int, fingerprint: dict | None) -> tuple[list, list]:
    """``(refused, allowed)``: lists of ``(key, saved, now)`` between ``meta`` (a checkpoint's
    meta.json) and the current ``cfg`` at data-parallel degree ``dp``."""
    saved, now = _flat(meta["config"]), _flat(to_dict(cfg))
    refused, allowed = [], []
    for key in sorted(saved.keys() & now.keys()):  # a key one version lacks is not compared
        if key in ("data.paths", "data.tokenizer", "data.vl_paths", "schedule.total_steps"):
            continue  # compared by content or effective value below
        if saved[key] != now[key]:
            (refused if _refused(key) else allowed).append((key, saved[key], now[key]))
    refused += _content_changes(meta.get("data_fingerprint"), fingerprint, saved, now)
    for key in ("data.paths", "data.tokenizer", "data.vl_paths"):
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


def _check_family(folder: Path, meta: dict, cfg: Config) -> None:
    """``ValueError`` when the checkpoint was saved from another model family (a MoE model's
    checkpoint resumed by a dense config, or the reverse): its tensors are another model's,
    so no ``accept_changes`` can make it load. Checkpoints that predate ``model_family`` in
    meta.json are left to the config comparison."""
    saved, now = meta.get("model_family"), run_family(cfg).name
    if saved is not None and saved != now:
        raise ValueError(
            f"cannot resume {folder}: it holds a {saved} model (meta.json model_family) and "
            f"this config builds a {now} model; a checkpoint loads only into the family it was "
            f"saved from. Set model.family={saved} and the model section it was saved with "
            f"(see {folder}/meta.json, key config), or start a new run in another folder "
            f"(logging.run_dir=...)")


def check_resume(folder: Path, meta: dict, cfg: Config, dp: int,
                 fingerprint: dict | None) -> list[str]:
    """Raise ``ValueError`` listing what may not change (and how to proceed); else return the
    allowed changes as ``key: saved -> now`` lines to log."""
    _check_family(folder, meta, cfg)
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
