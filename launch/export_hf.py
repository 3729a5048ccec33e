"""Export a training checkpoint to a Hugging Face folder (config.json + model.safetensors).

    python -m mpcore.launch.export_hf --checkpoint RUN/checkpoints/step-N --output HF_DIR

Runs in one process on the CPU, whatever layout the checkpoint was saved at (its tensors are in
logical form): the model is rebuilt from the checkpoint's ``meta.json`` at tp=1, loaded, and
written by its family's export (``mpcore.models.registry``). Memory: the full model in fp32 plus one load batch.
``--checkpoint`` may also be a checkpoint root, which exports its ``latest``.

A run on data prepared with a released tokenizer folder (``data.tokenizer``, or
``model.init_from``'s) gets that folder's files byte for byte, with the release's
``generation_config.json`` and special ids (``mpcore.launch.export_release``). Otherwise the
run's SentencePiece tokenizer (``data.tokenizer``, or the default corpus's) is copied
beside the weights as ``tokenizer.model`` when it can be found, with ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json`` so that transformers'
``AutoTokenizer`` loads the folder and gives the same ids; a progress bar on stderr
follows the weights. Files get mode 0644 and folders 0755 whatever the umask of the run, so
the export can be shared as it is.

Safety (``mpcore.launch.export_target``): the checkpoint's manifest is verified first, as resume
does, and a damaged checkpoint is refused naming the file. ``--output`` must be a new or empty
folder, or, with ``--overwrite``, an earlier export; never a file, a run folder or a
checkpoint. The export is written into a hidden sibling folder and renamed into place when
complete, so a killed export leaves no half-written folder and an overwritten one stays whole
until the new one replaces it.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import torch

from mpcore import atomic
from mpcore.checkpoint import latest_checkpoint, read_meta
from mpcore.data.tokenizer import Tokenizer
from mpcore.data.vl_tokenizer import VLTokenizer
from mpcore.launch.export_release import copy_release, release_tokenizer
from mpcore.launch.export_target import check_checkpoint, check_output, staging_folder, swap_in
from mpcore.logical import LogicalLayout
from mpcore.models import Family, family_named
from mpcore.parallel.random import RNGTracker
from mpcore.parallel.state import ParallelState
from mpcore.progress import ProgressBar
from mpcore.train_state import TrainState


def export(checkpoint: str | Path, output: str | Path, overwrite: bool = False) -> Path:
    """Write the folder ``output`` from ``checkpoint`` (a step-N folder or a root), whole or not
    at all (``mpcore.launch.export_target``); returns the checkpoint folder exported."""
    final = Path(output)
    check_output(final, overwrite)  # before any work
    stage = staging_folder(final)
    try:
        folder = _export_into(checkpoint, stage)
        swap_in(stage, final)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return folder


def _export_into(checkpoint: str | Path, output: Path) -> Path:
    """Write ``output`` from ``checkpoint`` (a step-N folder or a root); returns the folder."""
    folder = Path(checkpoint)
    if not (folder / "meta.json").is_file():
        found = latest_checkpoint(folder)
        if found is None:
            raise ValueError(f"{folder} is neither a checkpoint (step-N with meta.json) nor a "
                             f"folder holding one; pass RUN/checkpoints/step-N")
        folder = found
    check_checkpoint(folder)
    meta = read_meta(folder)
    family = meta_family(meta)
    cfg = family.config_from_dict(meta["model_config"])
    state = ParallelState()
    model = family.build(cfg, state, device="cpu")
    cpu = torch.device("cpu")
    TrainState(model, None, LogicalLayout(cfg, 1, 0), state, RNGTracker(cpu), cpu).restore(
        folder, same_layout=False)
    bar = ProgressBar(f"exporting to {output}", len(list(model.parameters())), "tensors")
    family.export_hf(model, state, output, progress=lambda done, total: bar.update(done))
    bar.close()
    vl = family.modality == "image-text"
    run_config = meta.get("config", {})
    release = release_tokenizer(run_config)
    tokenizer = None if release else run_tokenizer(run_config, vl, family)
    if release is not None:  # a released tokenizer folder: its files, unchanged
        copy_release(release, (run_config.get("model") or {}).get("init_from"), Path(output))
        if vl and family.hf_image_processor and not (
                Path(output) / "preprocessor_config.json").is_file():  # from scratch
            write_preprocessor_config(release, family.hf_image_processor, Path(output))
    elif tokenizer is not None and tokenizer.is_file():
        write_tokenizer(tokenizer, vl, Path(output))
        if vl and family.hf_image_processor:  # the data's image settings, for AutoProcessor
            write_preprocessor_config(tokenizer.parent, family.hf_image_processor, Path(output))
    elif tokenizer is not None:
        logging.warning("the run's tokenizer %s is not there (run from the training folder to "
                        "copy it); exported the weights without it", tokenizer)
    normal_modes(Path(output))
    return folder


def meta_family(meta: dict) -> Family:
    """The model family a checkpoint was saved from (``meta.json``'s ``model_family``; saved
    before families were named: a ``vision`` field means qwen2_vl, else llama)."""
    name = meta.get("model_family") or ("qwen2_vl" if "vision" in meta["model_config"]
                                         else "llama")
    return family_named(name)


def run_tokenizer(config: dict, vl: bool, family: Family | None = None) -> Path | None:
    """The SentencePiece model a run trained with (from its saved config; ``vl``: the model
    takes images, so the VL tokenizer, in the shipped set's folder for ``family`` when the run
    used that set), or None."""
    data = config.get("data") or {}
    if vl or data.get("vl_paths"):
        return _vl_tokenizer(data, family)
    if data.get("paths"):
        return Path(data["tokenizer"]) if data.get("tokenizer") else None
    if "cache_dir" in data:
        return Path(data["cache_dir"]) / f"default_v{data['default_vocab_size']}.model"
    return None


def _vl_tokenizer(data: dict, family: Family | None) -> Path | None:
    """``tokenizer.json`` of a VL run's first dataset (the shipped set's, as prepared for
    ``family``, when none was given)."""
    if data.get("vl_paths"):
        return Path(data["vl_paths"][0]) / "tokenizer.json"
    if "cache_dir" not in data:
        return None
    from mpcore.data.vl_default import default_folder, default_settings

    return default_folder(data["cache_dir"], data["default_vocab_size"],
                          default_settings(family)) / "tokenizer.json"


def write_tokenizer(tokenizer: Path, vl: bool, output: Path) -> None:
    """``tokenizer.model`` and the Hugging Face tokenizer files (AutoTokenizer gives our ids;
    a VL run's four vision ids are added tokens); a model they cannot mirror gets only the
    ``.model`` and a warning."""
    tok = VLTokenizer.load(tokenizer) if vl else Tokenizer(tokenizer)
    try:
        tok.write_hf_tokenizer(output)
    except ValueError as e:
        logging.warning("%s; exported tokenizer.model without the transformers files", e)
    special_ids_into_config(output / "config.json", tok.bos_id, tok.eos_id)


def write_preprocessor_config(dataset: Path, processor: str, output: Path) -> None:
    """``preprocessor_config.json`` of the image settings the run's first VL dataset was
    prepared with (its ``meta.json``), as transformers' ``processor`` class reads them, so
    ``AutoImageProcessor`` (and score.py) process images as training did."""
    settings = json.loads((dataset / "meta.json").read_text())["image_settings"]
    config = {"image_processor_type": processor, "do_convert_rgb": True,
              "do_resize": settings["resize"], "resample": 3,  # bicubic, as mpcore.data.images
              "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              "image_mean": settings["mean"], "image_std": settings["std"],
              "size": {"shortest_edge": settings["min_pixels"],
                       "longest_edge": settings["max_pixels"]},
              "patch_size": settings["patch_size"],
              "temporal_patch_size": settings["temporal_patch_size"],
              "merge_size": settings["merge_size"]}
    atomic.write_text(output / "preprocessor_config.json", json.dumps(config, indent=2) + "\n")


def special_ids_into_config(path: Path, bos_id: int, eos_id: int) -> None:
    """The tokenizer's bos / eos ids (eos also the pad, as our packing pads) into config.json,
    at the top and in ``text_config``: without them transformers fills in its defaults for the
    architecture (Qwen's 151643 / 151645), ids outside a model trained on our vocabulary, and
    generation never stops."""
    config = json.loads(path.read_text())
    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    config.update(ids)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].update(ids)
    atomic.write_text(path, json.dumps(config, indent=2) + "\n")


def normal_modes(folder: Path) -> None:
    """0755 on ``folder`` and its sub-folders, 0644 on its files."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="RUN/checkpoints/step-N")
    parser.add_argument("--output", required=True,
                        help="Hugging Face folder to write: new or empty (see --overwrite); "
                             "never a run folder or a checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in --output (a folder holding only "
                             "files an export writes), whole")
    args = parser.parse_args(argv)
    try:
        folder = export(args.checkpoint, args.output, args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {folder} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
