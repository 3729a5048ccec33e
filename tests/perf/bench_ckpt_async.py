"""Benchmark: the step-time hiccup of a checkpoint save, blocking vs ``checkpoint.async_save``.

    torchrun --nproc-per-node N -m tests.perf.bench_ckpt_async [CONFIG.yaml] [key=value ...]
        [--steps 40] [--every 10] [--out tests/perf/results/ckpt_async.json]

Trains the same run twice from the same seed (``checkpoint.async_save=false``, then ``true``),
each in a fresh run folder under ``--work`` (default: a temporary folder), saving every
``--every`` steps, and times every step on the host with a device synchronize at its end (so a
step's time includes a save started in it and, with async, the staging copy). Reports per
mode: the median step without a save, the mean and max of the steps that saved, the hiccup
(save step minus median), ``save_call_s`` (each ``Trainer.save`` call: the whole save when
blocking; the device-to-host staging when async), for async ``waited_for_previous_write_s``
(a save requested while the previous write is in flight first waits for it: saves closer
together than one write take that long) and the staging buffers' size, and at which step each
checkpoint was committed. Each mode's checkpoints are deleted when it ends (disk space).
Rank 0 writes the JSON. The losses of both modes must be equal (the saves do not change
training); the script says so and exits 1 when they are not. ``--control`` runs blocking twice
first: on a GPU whose kernels are not bitwise deterministic the two blocking runs differ too,
and then a difference with async says nothing about it (reported, exit 0). GPU-sized: run it
on the device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mpcore.build import build, resolve_device, setup
from mpcore.config import load_config
from mpcore.processes import init_distributed
from mpcore.train import Trainer

REPO = Path(__file__).resolve().parents[2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(config: str | None, overrides: list[str], work: Path, async_save: bool,
             steps: int, every: int) -> dict:
    cfg = load_config(config, [*overrides, f"logging.run_dir={work}/{'async' if async_save else 'blocking'}",
                               f"checkpoint.async_save={str(async_save).lower()}",
                               f"checkpoint.every={every}", f"training.max_steps={steps}",
                               "checkpoint.resume=false"])
    state = setup(cfg)
    device = resolve_device(cfg)
    trainer = Trainer(build(cfg, state, device))
    times, saves, losses, committed, waited, staged = [], [], [], [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss, _ = trainer.train_step()
        if trainer.async_saver is not None and trainer.async_saver.poll() is not None:
            committed.append(trainer.step)
        saved = trainer.step % every == 0
        if saved:
            if trainer.async_saver is not None:  # what Trainer.save does first, timed apart
                t0 = time.perf_counter()
                if trainer.async_saver.wait() is not None:
                    committed.append(trainer.step)
                waited.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            trainer.save(background=async_save)
            _sync(device)
            staged.append(time.perf_counter() - t0)
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if saved:
            saves.append(trainer.step)
    if trainer.async_saver is not None and trainer.async_saver.wait() is not None:
        committed.append(trainer.step)
    staging = trainer.async_saver.staging.nbytes if trainer.async_saver is not None else None
    shutil.rmtree(cfg.checkpoint_dir, ignore_errors=True)  # disk: one mode's files at a time
    plain = [t for i, t in enumerate(times, 1) if i not in saves and i > 2]  # warm steps
    saving = [times[i - 1] for i in saves]
    median = statistics.median(plain)
    return {"async_save": async_save, "median_step_s": median,
            "save_step_mean_s": statistics.mean(saving), "save_step_max_s": max(saving),
            "hiccup_s": statistics.mean(saving) - median, "saved_at": saves,
            "save_call_s": staged, "waited_for_previous_write_s": waited or None,
            "staging_gib": None if staging is None else staging / 2**30,
            "committed_at": committed, "step_times_s": times, "losses": losses,
            "rank": state.rank}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=None)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--control", action="store_true",
                        help="a second blocking run first: whether two blocking runs already "
                             "differ (GPU kernels that are not bitwise deterministic)")
    parser.add_argument("--out", type=Path,
                        default=REPO / "tests" / "perf" / "results" / "ckpt_async.json")
    args = parser.parse_args(argv)
    if args.config and "=" in args.config:
        args.overrides, args.config = [args.config, *args.overrides], None
    init_distributed(300)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_ckpt_async_"))
    modes = (False, False, True) if args.control else (False, True)
    results = [run_mode(args.config, args.overrides, work / f"run{i}", mode, args.steps,
                        args.every) for i, mode in enumerate(modes)]
    same = results[0]["losses"] == results[-1]["losses"]
    control = results[0]["losses"] == results[1]["losses"] if args.control else None
    if results[0]["rank"] == 0:
        report = {"config": args.config, "overrides": args.overrides, "steps": args.steps,
                  "every": args.every, "same_losses": same,
                  "blocking_runs_equal": control,
                  "modes": [{k: v for k, v in r.items() if k not in ("losses", "rank")}
                            for r in results]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        for r in report["modes"]:
            print(f"async_save={r['async_save']}: median step {r['median_step_s']:.3f} s, save "
                  f"step {r['save_step_mean_s']:.3f} s (max {r['save_step_max_s']:.3f}), "
                  f"hiccup {r['hiccup_s']:.3f} s; save calls {r['save_call_s']}, waited "
                  f"{r['waited_for_previous_write_s']}; committed at {r['committed_at']}")
        print("losses equal" if same else "LOSSES DIFFER between the modes")
        if args.control:
            print("the two blocking runs: " + ("equal" if control else
                                               "differ too (nondeterministic kernels)"))
    return 0 if same or control is False else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
