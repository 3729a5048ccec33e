"""Export a training checkpoint to a Hugging Face folder (config.json + model.safetensors).

    python -m launch.export_hf --checkpoint RUN/checkpoints/step-N --output HF_DIR

Runs in one process on the CPU, whatever layout the checkpoint was saved at (its tensors are in
logical form): the model is rebuilt from the checkpoint's ``meta.json`` at tp=1, loaded, and
written by ``models.export_hf``. Memory: the full model in fp32 plus one load batch.
``--checkpoint`` may also be a checkpoint root, which exports its ``latest``.

The run's SentencePiece tokenizer (``data.tokenizer``, or the default corpus's) is copied
beside the weights as ``tokenizer.model`` when it can be found, with ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json`` so that transformers'
``AutoTokenizer`` loads the folder and gives the same ids; a progress bar on stderr
follows the weights. Files get mode 0644 and folders 0755 whatever the umask of the run, so
the export can be shared as it is.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from models import (
    ModelConfig,
    build_model,
    build_vl_model,
    export_hf,
    export_hf_vl,
    vl_config_from_dict,
)
from mpcore.checkpoint import latest_checkpoint, read_meta
from mpcore.data.tokenizer import Tokenizer
from mpcore.data.vl_tokenizer import VLTokenizer
from mpcore.logical import LogicalLayout
from mpcore.progress import ProgressBar
from mpcore.train_state import TrainState
from parallel.random import RNGTracker
from parallel.state import ParallelState


def export(checkpoint: str | Path, output: str | Path) -> Path:
    """Write ``output`` from ``checkpoint`` (a step-N folder or a root); returns the folder."""
    folder = Path(checkpoint)
    if not (folder / "meta.json").is_file():
        found = latest_checkpoint(folder)
        if found is None:
            raise ValueError(f"{folder} is neither a checkpoint (step-N with meta.json) nor a "
                             f"folder holding one; pass RUN/checkpoints/step-N")
        folder = found
    meta = read_meta(folder)
    vl = "vision" in meta["model_config"]
    cfg = (vl_config_from_dict if vl else lambda d: ModelConfig(**d))(meta["model_config"])
    state = ParallelState()
    model = (build_vl_model if vl else build_model)(cfg, state, device="cpu")
    cpu = torch.device("cpu")
    TrainState(model, None, LogicalLayout(cfg, 1, 0), state, RNGTracker(cpu), cpu).restore(
        folder, same_layout=False)
    if vl:
        export_hf_vl(model, state, output)
    else:
        bar = ProgressBar(f"exporting to {output}", len(list(model.parameters())), "tensors")
        export_hf(model, cfg, state, output, progress=lambda done, total: bar.update(done))
        bar.close()
    tokenizer = run_tokenizer(meta.get("config", {}))
    if tokenizer is not None and tokenizer.is_file():
        write_tokenizer(tokenizer, vl, Path(output))
    elif tokenizer is not None:
        logging.warning("the run's tokenizer %s is not there (run from the training folder to "
                        "copy it); exported the weights without it", tokenizer)
    normal_modes(Path(output))
    return folder


def run_tokenizer(config: dict) -> Path | None:
    """The SentencePiece model a run trained with (from its saved config), or None."""
    data = config.get("data") or {}
    if (config.get("model") or {}).get("vision") is not None or data.get("vl_paths"):
        return _vl_tokenizer(data)
    if data.get("paths"):
        return Path(data["tokenizer"]) if data.get("tokenizer") else None
    if "cache_dir" in data:
        return Path(data["cache_dir"]) / f"default_v{data['default_vocab_size']}.model"
    return None


def _vl_tokenizer(data: dict) -> Path | None:
    """``tokenizer.json`` of a VL run's first dataset (the shipped set's when none was given)."""
    if data.get("vl_paths"):
        return Path(data["vl_paths"][0]) / "tokenizer.json"
    if "cache_dir" not in data:
        return None
    from mpcore.data.vl_default import default_folder

    return default_folder(data["cache_dir"], data["default_vocab_size"]) / "tokenizer.json"


def write_tokenizer(tokenizer: Path, vl: bool, output: Path) -> None:
    """``tokenizer.model`` and the Hugging Face tokenizer files (AutoTokenizer gives our ids;
    a VL run's four vision ids are added tokens); a model they cannot mirror gets only the
    ``.model`` and a warning."""
    tok = VLTokenizer.load(tokenizer) if vl else Tokenizer(tokenizer)
    try:
        tok.write_hf_tokenizer(output)
    except ValueError as e:
        logging.warning("%s; exported tokenizer.model without the transformers files", e)


def normal_modes(folder: Path) -> None:
    """0755 on ``folder`` and its sub-folders, 0644 on its files."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="RUN/checkpoints/step-N")
    parser.add_argument("--output", required=True, help="Hugging Face folder to write")
    args = parser.parse_args(argv)
    try:
        folder = export(args.checkpoint, args.output)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {folder} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
