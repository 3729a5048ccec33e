"""Pretraining entry point: parse the config, init torch.distributed, build, train.

    torchrun --nproc-per-node N launch/pretrain.py [CONFIG.yaml] [dotted.key=value ...]
    python launch/pretrain.py            # no arguments: the tiny model on the shipped corpus, CPU

The first argument is a YAML config when it ends in .yaml/.yml (default: launch/configs/tiny.yaml);
the rest are overrides such as ``optimizer.lr=1e-3 parallel.tp=2``. ``--help`` lists every config
key with its default; ``--print-config`` prints the resolved config (YAML) and trains nothing.
Under torchrun the process group uses NCCL on CUDA and gloo on CPU. Resumes from
``<checkpoint dir>/latest`` by itself, so ``torchrun --max-restarts K`` restarts a failed run
from its last checkpoint.

Ctrl-C (SIGINT), SIGTERM and SIGUSR1 (``sbatch --signal=USR1@120``) stop the run at the next
step boundary after saving a checkpoint (a second Ctrl-C, 2 s or more after the first, stops at
once, without saving). Under
torchrun a worker whose launcher dies gets SIGTERM too (``mpcore.processes``), and errors are
printed once, not once per rank. ``python -m mpcore.torchrun`` (torchrun's arguments) prints
nothing of its own after a worker's message and exits with the worker's code.

Exit codes: 0 done; 1 crash (a traceback); 2 a configuration or input error, storage that
refuses a checkpoint, a metrics row or any other output (full, read-only, no permission), or
the run folder deleted or replaced under the run (the message says what to fix); 3 the run diverged (training.max_bad_steps
non-finite steps in a row, or training.max_steps reached inside such a streak; the message names
the newest checkpoint saved from a finite state, which rotation keeps); 4 the process group did
not form within parallel.init_timeout_s; 5 a rank made no progress for parallel.step_timeout_s
(the message names it and its step); 75 stopped by SIGTERM/SIGINT/SIGUSR1 after saving a
checkpoint (rerun to resume); 130 a second Ctrl-C. Under a bare torchrun the launcher exits 1
whatever its workers' codes were.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from mpcore.build import resolved_section
from mpcore.cli import config_help, parse_args, resolved_yaml
from mpcore.config import load_config
from mpcore.processes import (
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    exit_with_parent,
    init_distributed,
    report_user_error,
)
from mpcore.train import TrainingDiverged, train

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"


@record
def main(argv: list[str]) -> int:
    if "LOCAL_RANK" in os.environ:  # launched by torchrun: do not outlive it
        exit_with_parent()
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(levelname)s %(message)s")
    store = None
    try:
        args = parse_args(argv, DEFAULT_CONFIG)
        if args.help:
            print(__doc__ + "\nConfig keys (section.key = default):\n\n" + config_help())
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            if rank == 0:
                print(resolved_yaml(resolved_section(cfg)), end="")
            return 0
        store = init_distributed(cfg.parallel.init_timeout_s)
        source = f"{args.config}" + (f" + {args.overrides}" if args.overrides else "")
        result = train(cfg, source=source, store=store)
    except ValueError as e:
        report_user_error(str(e), store)
        return EXIT_USER_ERROR
    except TrainingDiverged as e:
        report_user_error(str(e), store)
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        print("interrupted by Ctrl-C: stopped at once, without saving (before training "
              "started, or a second Ctrl-C); the newest checkpoint in the checkpoint folder is "
              "the last one saved", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(f"{result.status} at step {result.step}")
    return EXIT_PREEMPTED if result.status == "preempted" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
