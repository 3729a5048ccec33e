"""What a run tells its user: the start-up block, time fields of the step lines, the validation
loss.

- :func:`startup_block`: one block (rank 0 logs it) with the world and its tp x cp x dp layout
  and data-parallel mode, parameters (logical total, and what rank 0 stores), tokens per step,
  the dataset (documents, tokens, samples, epochs at ``training.max_steps``), the held-out split,
  and the run and checkpoint folders.
- :class:`Clock`: step time, elapsed time and ETA for the step lines.
- :func:`validation_loss`: the global mean loss over the valid labels of the first
  ``training.eval_batches`` micro-batches of the held-out loader (the same batches each time, so
  the values form a curve), without gradients; collective over dp x cp like a training step.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from mpcore.batches import local_inputs
from mpcore.build import Run
from mpcore.metrics import num_params
from mpcore.models import describe_kernels
from mpcore.models.common.hybrid.mtp import MTP_KEYS
from mpcore.parallel import global_valid_count
from mpcore.parallel.loss import sum_over_group
from mpcore.pipelined import pipeline_eval


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def local_numel(model: nn.Module) -> int:
    """Parameters this rank stores (its tp shard; its FSDP shard of that under FSDP)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
               for p in model.parameters())


def startup_block(run: Run, tokens_per_step: int, source: str) -> str:
    """The start-up summary (module docstring), several lines."""
    cfg, s = run.cfg, run.state
    d, t = cfg.data, cfg.training
    mode = (f"{cfg.parallel.data_parallel} over dp x cp = {s.dp_cp} ranks" if s.dp_cp > 1
            else "none (one replica)")
    counts = num_params(run.model_cfg)
    lines = [
        f"config: {source}",
        f"world {s.world_size} = tp {s.tp} x cp {s.cp} x dp {s.dp}"
        + (f" x pp {s.pp} ({cfg.parallel.pp_schedule}, {cfg.parallel.virtual_stages} "
           f"stage(s) per rank)" if s.pp > 1 else "") + f"; data parallel: {mode}; "
        f"device {run.device.type}",
        f"parameters: {_count(counts['total'])} total ({counts['total']:,}), "
        f"{_count(local_numel(run.model))} on rank 0",
        f"tokens per step: {tokens_per_step:,} (micro_batch {d.micro_batch} x seq_len "
        f"{d.seq_len} x grad_accum {d.grad_accum} x dp {s.dp})",
    ]
    if run.data is not None:
        epochs = t.max_steps * run.loader.global_batch / run.data.num_samples
        lines.append(f"dataset: {run.data.num_docs:,} documents, {run.data.num_tokens:,} "
                     f"tokens, {run.data.num_samples:,} samples; {t.max_steps} steps = "
                     f"{epochs:.2f} epochs")
        if run.data.valid_docs:
            when = (f"every {t.eval_every} steps, {t.eval_batches} micro-batches" if
                    t.eval_every else "never evaluated (training.eval_every=0)")
            lines.append(f"held out: {run.data.valid_docs:,} documents, "
                         f"{run.data.valid_tokens:,} tokens (data.valid_fraction="
                         f"{d.valid_fraction}); validation loss {when}")
    # the DeltaNet operands' dtype: bf16 under the step's autocast (CUDA, training.dtype)
    compute = (torch.bfloat16 if run.device.type == "cuda" and t.dtype == "bfloat16"
               else torch.float32)
    lines += describe_kernels(run.model, run.device, compute)
    every = cfg.checkpoint.every
    lines += [f"run dir: {cfg.logging.run_dir}",
              f"checkpoints: {cfg.checkpoint_dir} ("
              + (f"every {every} steps" if every else "on a stop signal only")
              + f", keep {cfg.checkpoint.keep_last})"]
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """``H:MM:SS``."""
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Clock:
    """Step time, elapsed time and ETA from the steps run in this process."""

    def __init__(self, step: int, max_steps: int):
        self.start = self.last = time.perf_counter()
        self.start_step = self.last_step = step
        self.max_steps = max_steps

    def fields(self, step: int) -> dict[str, str]:
        """``step_s`` (mean since the last call), ``elapsed`` and ``eta`` as text."""
        now = time.perf_counter()
        step_s = (now - self.last) / max(step - self.last_step, 1)
        mean = (now - self.start) / max(step - self.start_step, 1)
        self.last, self.last_step = now, step
        return {"step_s": f"{step_s:.3f}", "elapsed": duration(now - self.start),
                "eta": duration(mean * (self.max_steps - step))}


@torch.no_grad()
def validation_loss(run: Run) -> float:
    """Global mean validation loss (module docstring); call it on every rank."""
    loader, s = run.valid_loader, run.state
    position = loader.state_dict()
    loader.load_state_dict({**position, "epoch": 0, "consumed": 0})
    num = min(run.cfg.training.eval_batches, loader.steps_per_epoch)  # each sample once
    inputs = [local_inputs(next(loader), s, run.cfg, run.device, run.family, run.model_cfg)
              for _ in range(num)]
    count = global_valid_count([i["labels"] for i in inputs], s.dp_cp_group)
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16,
                              enabled=run.device.type == "cuda"
                              and run.cfg.training.dtype == "bfloat16")
    if run.pipeline is not None:  # pp > 1: forward only through the stages
        inputs = [{k: v for k, v in inp.items() if k not in MTP_KEYS} for inp in inputs]
        return float(pipeline_eval(run.pipeline.evaluator(num), s, inputs, autocast))
    total = torch.zeros((), dtype=torch.float32, device=run.device)
    run.module.eval()
    try:
        for inp in inputs:
            with autocast:  # the main loss: no MTP head (its inputs dropped)
                inp = {k: v for k, v in inp.items() if k not in MTP_KEYS}
                total += run.module(**inp, output="loss_sum").float()
    finally:
        run.module.train()
    total = sum_over_group(total / count.clamp(min=1).to(total.dtype), s.dp_cp_group)
    return float(total)  # CPU-GPU sync point, once per validation
