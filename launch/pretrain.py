"""Pretraining entry point: parse the config, init torch.distributed, build, train.

    torchrun --nproc-per-node N launch/pretrain.py [CONFIG.yaml] [dotted.key=value ...]
    python launch/pretrain.py            # no arguments: the tiny model on the shipped corpus, CPU

The first argument is a YAML config when it ends in .yaml/.yml (default: launch/configs/tiny.yaml);
the rest are overrides such as ``optimizer.lr=1e-3 parallel.tp=2``. Under torchrun the process
group uses NCCL on CUDA and gloo on CPU. Resumes from ``<checkpoint dir>/latest`` by itself, so
``torchrun --max-restarts K`` restarts a failed run from its last checkpoint.

Exit codes (of this process): 0 done, or stopped by SIGTERM after saving a checkpoint (rerun to
resume; under torchrun the launcher itself catches SIGTERM and exits 1, so a scheduler sees a
failed job even though the checkpoint is complete); 2 a configuration or input error (the message says what to fix); 3 the run diverged
(training.max_bad_steps non-finite steps in a row; the last good checkpoint is kept).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mpcore.config import load_config
from mpcore.train import TrainingDiverged, train

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"


def parse_args(argv: list[str]) -> tuple[Path, list[str]]:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0)
    if argv and argv[0].endswith((".yaml", ".yml")):
        return Path(argv[0]), argv[1:]
    return DEFAULT_CONFIG, argv


def init_distributed() -> None:
    """Join the torchrun process group (env:// rendezvous), if launched by torchrun."""
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)


def main(argv: list[str]) -> int:
    path, overrides = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(levelname)s %(message)s")
    try:
        cfg = load_config(path, overrides)
        init_distributed()
        result = train(cfg, source=f"{path}" + (f" + {overrides}" if overrides else ""))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(f"{result.status} at step {result.step}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
