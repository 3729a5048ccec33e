"""The training loop: setup -> build -> fit.

One optimizer step, on every rank:

    micro-batches = loader.next_step()            this dp rank's grad_accum packed streams
    inputs        = local_inputs(each)            labels shifted globally, then the cp split
    N             = global_valid_count(labels)    ONE int64 all-reduce over dp x cp
    for each micro-batch:                         (DDP: no_sync but for the last)
        loss [L]  = model(inputs, output="loss")  bf16 autocast on CUDA, fp32 on CPU
        backward(W * sum(loss) / N)               W = dp*cp when FSDP/DDP average, else 1
    loss          = sum of shares over dp x cp    the global mean over valid labels
    norm          = true global gradient norm     (mpcore.optim.GradNorm)
    finite?  clip to grad_clip, set lr(step), optimizer.step()
    else     skip the update, count it; max_bad_steps in a row stop the run (TrainingDiverged)

With PyTorch's fused AdamW (CUDA) that decision is made on the device (``Trainer.launch_step``):
no CPU-GPU sync per step, and :meth:`Trainer.fit` reads a step's loss and norm while the next
step runs, except at steps that need them at once (logging, validation, a checkpoint, the last
step, a stop request), which it settles before going on. Otherwise the host reads both first.

Checkpoints (``mpcore.checkpoint``): every ``checkpoint.every`` steps, at the last step, and at
the first step boundary after SIGTERM, SIGUSR1 (what ``sbatch --signal=USR1@T`` sends before
the time limit) or SIGINT (Ctrl-C; a second Ctrl-C, more than ``SAME_CTRL_C_S`` after the
first, raises KeyboardInterrupt at once, without saving). The handler only sets a flag; the
ranks agree on it with one all-reduce per step (with several ranks and the updates decided on
the device, read a step later: the run stops one step later), save, and :func:`fit` returns
``"preempted"``: launch/pretrain.py then exits with code 75 (``mpcore.processes``; rerunning
the same command resumes from ``latest``). Under a bare torchrun the launcher catches SIGTERM
itself and exits 1; ``python -m mpcore.torchrun`` passes the workers' 75 on.
Resume is automatic (``checkpoint.resume``): the newest checkpoint that verifies and loads
(``mpcore.checkpoint``), if its config is the same run (``mpcore.resume_check``). Inside a
non-finite streak no periodic or final checkpoint is saved (a stop signal still saves), and
reaching ``max_steps`` inside one raises ``TrainingDiverged``: the run did not end well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mpcore.backends import forward_region
from mpcore.batches import local_inputs
from mpcore.build import Run, build, resolve_device, setup
from mpcore.checkpoint import (
    from_rank0,
    latest_checkpoint,
    newest_finite,
    resume_newest,
    save_checkpoint,
)
from mpcore.checkpoint_async import AsyncSaver, background_saves, node_memory_bytes
from mpcore.config import Config, save_config, to_dict
from mpcore.io_errors import StorageError, writing
from mpcore.metrics import MetricsWriter, flops_per_token, max_memory_gib, peak_flops
from mpcore.models.common.hybrid.mtp import MtpOutput
from mpcore.moe_step import MoeStep, moe_record
from mpcore.optim import decides_on_device, lr_at, set_lr
from mpcore.parallel import global_valid_count
from mpcore.parallel.loss import sum_over_group
from mpcore.pipelined import PipelineMoeStep, pipeline_step
from mpcore.report import Clock, startup_block, validation_loss
from mpcore.resume_check import check_resume, data_fingerprint
from mpcore.rundir import RunLock, claim_run_dir, rewrite_metrics
from mpcore.watchdog import StepWatchdog

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 1
# Signals that stop the run at the next step boundary after a save (module docstring).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# One Ctrl-C reaches a worker twice under a launcher (from the terminal, then forwarded by
# torchrun or mpcore.torchrun, milliseconds apart): SIGINTs closer than this are one Ctrl-C.
SAME_CTRL_C_S = 2.0


class RunHalted(ValueError):
    """The run cannot write where it must: its run folder was deleted or replaced under it
    (``mpcore.rundir``), or the storage refused a metrics row (``mpcore.io_errors``). Every
    rank stops at the step boundary, before any save; the message says what is intact."""


class MtpTerm:
    """One step's multi-token-prediction term (``mpcore.models.common.hybrid.mtp``): the model
    returns ``MtpOutput(main_sum, mtp_sum)``; the step adds ``weight * mtp_sum / N_mtp``, N_mtp
    the valid MTP targets of the whole step (all micro-batches, dp x cp: one all-reduce), so
    the loss is ``main + weight * mtp``, each a global mean over its own targets."""

    def __init__(self, weight: float, count: torch.Tensor, device: torch.device):
        self.weight, self.count = weight, count.clamp(min=1)
        self.total = torch.zeros((), dtype=torch.float32, device=device)  # the MTP mean alone

    @staticmethod
    def start(inputs: list[dict], model_cfg, group, device) -> MtpTerm | None:
        """None unless the family's inputs carry ``mtp_labels`` (``mtp_loss_weight > 0``)."""
        if not inputs or "mtp_labels" not in inputs[0]:
            return None
        count = global_valid_count([i["mtp_labels"] for i in inputs], group)
        return MtpTerm(model_cfg.mtp_loss_weight, count, device)

    def split(self, out: MtpOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """``(main_sum, weight * this micro-batch's MTP share)``; the share is also counted."""
        share = out.mtp / self.count.to(out.mtp.dtype)
        self.total += share.detach()
        return out.main, self.weight * share


class TrainingDiverged(RuntimeError):
    """``training.max_bad_steps`` consecutive steps had a non-finite loss or gradient norm, or
    the run reached ``training.max_steps`` during such a streak (nothing saved from it)."""


@dataclass
class FitResult:
    status: str  # "done" | "preempted" | "finished" (resumed at max_steps: nothing to train)
    step: int
    losses: list[float] = field(default_factory=list)  # global loss of each step run here
    grad_norms: list[float] = field(default_factory=list)
    bad_steps: int = 0


@dataclass
class PendingStep:
    """One launched optimizer step (``Trainer.launch_step``): its ``[loss, norm, stop flag]``
    on the host, still being copied from the device until ``event`` has completed."""

    step: int
    values: torch.Tensor  # fp32 [3] on the CPU (pinned, when copied from CUDA)
    event: torch.cuda.Event | None  # recorded after the copy; None: values already there
    on_device: bool  # the update was decided on the device (no sync at launch)

    @staticmethod
    def copied(step: int, values: torch.Tensor) -> PendingStep:
        if values.device.type != "cuda":
            return PendingStep(step, values, None, True)
        host = values.to("cpu", non_blocking=True)  # into pinned memory
        event = torch.cuda.Event()
        event.record()
        return PendingStep(step, host, event, True)

    def numbers(self) -> tuple[float, float, bool]:
        """(loss, norm, stop asked on some rank), waiting for this step's copy only."""
        if self.event is not None:
            self.event.synchronize()
        loss, norm, stop = self.values.tolist()
        return loss, norm, stop > 0


class Trainer:
    """Runs :class:`mpcore.build.Run`'s model to ``training.max_steps`` (module docstring).

    ``checkpoint_hook(stage, path)`` is passed to ``save_checkpoint`` (tests simulate crashes);
    ``step_hook(step)`` is called at the start of each step (tests make a rank hang there).
    ``store``: the rendezvous store, where the step watchdog publishes progress
    (``mpcore.watchdog``; None: it names only this rank). ``lock``: rank 0's hold on the run
    folder (``mpcore.rundir.RunLock``), checked before each write (:meth:`_agree_stop`).
    """

    def __init__(self, run: Run, checkpoint_hook=None, step_hook=None,
                 store: dist.Store | None = None, lock: RunLock | None = None):
        self.run, self.cfg = run, run.cfg
        self.lock = lock
        self.halt: str | None = None  # rank 0: why the run must stop without writing more
        self.checkpoint_hook, self.step_hook = checkpoint_hook, step_hook
        self.watchdog = StepWatchdog(self.cfg.parallel.step_timeout_s, store, run.state.rank,
                                     run.state.world_size)
        self.async_saver = self._async_saver()
        self.step = 0
        self.bad_steps = self.consecutive_bad = 0
        self._fingerprint: dict | None = None
        self.stop_requested = False
        self.stop_seen = False  # a rank's stop request, as read from a settled step
        self.settled_step = 0  # the newest step whose numbers the host has read (settle)
        self.stop_signal: str | None = None  # the first stop signal received here
        # The last step's MoE terms (MoE models); reduced to numbers only when logged.
        self.last_moe: MoeStep | None = None
        # The last step's global MTP loss (models trained with multi-token prediction).
        self.last_mtp: torch.Tensor | None = None
        self._first_sigint: float | None = None  # time.monotonic() of the first SIGINT
        s = run.state
        self.scale = s.dp_cp if s.dp_cp > 1 else 1  # FSDP/DDP average over dp x cp
        self.ddp = (s.dp_cp > 1 and self.cfg.parallel.data_parallel == "ddp"
                    and run.pipeline is None)  # the pipelined ddp path sums after the step
        data = self.cfg.data
        self.tokens_per_step = data.seq_len * data.micro_batch * data.grad_accum * s.dp
        self.flops_per_token = flops_per_token(run.model_cfg, data.seq_len)
        self.peak = peak_flops(run.device, self.cfg.training.dtype)
        # VL runs also report image tokens/s: placeholders counted on the host per step
        # (the loader's tensors are on the CPU: no sync), summed over dp at each log line.
        ids = run.family.placeholder_ids(run.model_cfg)
        self.placeholders = torch.tensor(ids) if ids else None
        self.image_tokens = self.window_steps = 0
        # TransformerEngine layers: one te.autocast region per forward (mpcore.parallel.te).
        self.te_region = forward_region(run.model)

    # ------------------------------------------------------------------ checkpoints
    def _async_saver(self) -> AsyncSaver | None:
        run = self.run
        params = run.family.num_params(run.model_cfg)["total"]
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        on, why = background_saves(self.cfg.checkpoint.async_save, run.device, params,
                                   run.state.world_size, local, node_memory_bytes())
        if run.state.rank == 0 and self.cfg.checkpoint.async_save == "auto":
            log.info("%s", why)
        return AsyncSaver(run.state.rank, run.device) if on else None

    def _meta(self) -> dict:
        s = self.run.state
        return {"format": CHECKPOINT_FORMAT, "step": self.step,
                "loader": self.run.loader.state_dict(),
                "layout": {"tp": s.tp, "cp": s.cp, "dp": s.dp, "ep": s.ep, "pp": s.pp,
                           "data_parallel": self.cfg.parallel.data_parallel},
                "bad_steps": self.bad_steps, "consecutive_bad": self.consecutive_bad,
                "group_steps": [g.get("step") for g in self.run.optimizer.param_groups],
                "model_family": self.run.family.name,
                "model_config": dataclasses.asdict(self.run.model_cfg),
                "config": to_dict(self.cfg), "data_fingerprint": self.fingerprint()}

    def fingerprint(self) -> dict | None:
        """The data's fingerprint (``mpcore.resume_check``), on rank 0 only (it writes meta)."""
        if self._fingerprint is None and self.run.state.rank == 0:
            self._fingerprint = data_fingerprint(self.cfg)
        return self._fingerprint

    def save(self, background: bool = False) -> Path | None:
        """Save this step; with ``background`` (and checkpoint.async_save) start the write and
        return None (:meth:`_poll_background` commits it later). Collective."""
        saver = self.async_saver
        if saver is not None:  # one save at a time; its staging buffers are reused
            self._report_background(saver.wait())
        background = background and saver is not None
        tensors = self.run.train_state.collect(saver.staging if background else None)
        args = (self.cfg.checkpoint_dir, self.step, tensors, self._meta())
        kw = {"keep_last": self.cfg.checkpoint.keep_last, "hook": self.checkpoint_hook}
        if background:
            saver.start(*args, **kw)
            return None
        return save_checkpoint(*args, rank=self.run.state.rank, **kw)

    def _report_background(self, path: Path | None) -> None:
        if path is not None and self.run.state.rank == 0:
            log.info("saved checkpoint %s (written in the background)", path)

    def resume(self, folder: Path | None = None) -> Path | None:
        """Load ``folder``, or the newest checkpoint of the checkpoint dir that verifies and
        fits this config (``mpcore.checkpoint.resume_newest``); returns it, or None when
        there is none. Collective."""
        s = self.run.state
        found = resume_newest(self.cfg.checkpoint_dir, self._load, rank=s.rank,
                              world=s.world_size, only=folder)
        if found is None:
            return None
        return found[0]

    def _load(self, folder: Path, meta: dict) -> None:
        """Check ``meta``'s config against this run (rank 0 decides), then restore."""
        s = self.run.state
        verdict = None
        if s.rank == 0:
            try:
                verdict = check_resume(folder, meta, self.cfg, s.dp, self.fingerprint())
            except ValueError as e:
                verdict = e
        verdict = from_rank0(verdict)
        if isinstance(verdict, ValueError):
            raise ValueError(str(verdict))
        if s.rank == 0:
            for line in verdict:
                log.info("resume: allowed change since %s: %s", folder.name, line)
        saved = meta["layout"]
        same = (saved["tp"], saved["cp"], saved["dp"], saved.get("ep", 1),
                saved.get("pp", 1)) == (s.tp, s.cp, s.dp, s.ep, s.pp)
        self.run.train_state.restore(folder, same_layout=same)
        for group, value in zip(self.run.optimizer.param_groups, meta["group_steps"],
                                strict=False):
            if value is not None:
                group["step"] = value
        self.run.loader.load_state_dict(meta["loader"])
        self.step = self.settled_step = int(meta["step"])
        self.bad_steps = int(meta["bad_steps"])
        self.consecutive_bad = int(meta["consecutive_bad"])
        if s.rank == 0:
            log.info("resumed from %s (step %d, saved at tp=%d cp=%d dp=%d ep=%d pp=%d)",
                     folder, self.step, saved["tp"], saved["cp"], saved["dp"],
                     saved.get("ep", 1), saved.get("pp", 1))
        return folder

    # ------------------------------------------------------------------ one step
    def _forward_backward(self, batches) -> torch.Tensor:
        run, s = self.run, self.run.state
        if self.placeholders is not None:
            self.image_tokens += sum(int(torch.isin(b["input_ids"], self.placeholders).sum())
                                     for b in batches)
            self.window_steps += 1
        inputs = [local_inputs(b, s, self.cfg, run.device, run.family, run.model_cfg)
                  for b in batches]
        autocast = torch.autocast(run.device.type, dtype=torch.bfloat16,
                                  enabled=run.device.type == "cuda"
                                  and self.cfg.training.dtype == "bfloat16")
        if run.pipeline is not None:  # pp > 1: the stages under torch's schedule
            fsdp = s.dp_cp > 1 and self.cfg.parallel.data_parallel == "fsdp"
            with self.te_region():
                loss = pipeline_step(run.pipeline, run.model, s, inputs, autocast, fsdp)
            self.last_moe = PipelineMoeStep(run.pipeline, s) if (
                run.pipeline.last_statistic is not None) else None
            return loss
        count = global_valid_count([i["labels"] for i in inputs], s.dp_cp_group)
        mtp = MtpTerm.start(inputs, run.model_cfg, s.dp_cp_group, run.device)
        total = torch.zeros((), dtype=torch.float32, device=run.device)
        moe = self._moe_step(inputs, autocast)
        for i, inp in enumerate(inputs):
            last = i == len(inputs) - 1
            sync = run.module.no_sync() if self.ddp and not last else contextlib.nullcontext()
            with sync:
                with autocast, self.te_region():
                    local_sum = run.module(**inp, output="loss_sum")  # () fp32, valid tokens
                if mtp is not None:  # (main, MTP) sums: + weight * the MTP head's share
                    local_sum, extra = mtp.split(local_sum)
                # This rank's share of the global mean (mpcore.parallel.loss): sum / global count.
                share = local_sum / count.clamp(min=1).to(local_sum.dtype)
                if mtp is not None:
                    share = share + extra
                if moe is not None:  # + the load-balancing loss's share (a global statistic)
                    share = share + moe.share()
                (share * self.scale).backward()
            total += share.detach()
        self.last_moe = moe  # its metrics() syncs: left to _log
        self.last_mtp = None if mtp is None else sum_over_group(mtp.total, s.dp_cp_group)
        return sum_over_group(total, s.dp_cp_group)

    def _moe_step(self, inputs, autocast):
        """A MoE model's ``mpcore.moe_step.MoeStep`` for this step (None for a dense one)."""

        run = self.run
        model = getattr(run.module, "module", run.module)  # DDP wraps; FSDP2 does not

        def forward(inp):
            with autocast, self.te_region():
                run.module(**inp, output="loss_sum")

        return MoeStep.start(model, inputs, run.state, forward)

    def train_step(self) -> tuple[float, float]:
        """One optimizer step; returns (global loss, global grad norm) as Python floats."""
        return self.settle(self.launch_step())

    def launch_step(self) -> PendingStep:
        """Enqueue one optimizer step; :meth:`settle` gives its numbers.

        With PyTorch's fused AdamW (CUDA) the update is decided on the device: it is skipped
        there when the loss or the norm is not finite (``found_inf``), and clipping is the
        optimizer's own gradient divisor (``grad_scale``, ``GradNorm.clip_divisor``), so the
        host does not wait for the step and can enqueue the next one while it runs. The loss,
        norm and (multi-rank) stop flag reach the host by a non-blocking copy. Otherwise the
        host reads the loss and norm (a CPU-GPU sync) and decides, as ``clip_`` and a skipped
        ``optimizer.step()``; both ways update the same parameters the same way."""
        run, beat = self.run, self.watchdog.beat
        beat(self.step + 1, "data")
        if self.step_hook:
            self.step_hook(self.step + 1)
        batches = run.loader.next_step()
        beat(self.step + 1, "forward/backward")
        loss = self._forward_backward(batches)
        beat(self.step + 1, "optimizer")
        norm = run.grad_norm()
        self.step += 1
        opt, clip = run.optimizer, self.cfg.optimizer.grad_clip
        if decides_on_device(opt):
            finite = torch.isfinite(loss) & torch.isfinite(norm)
            opt.found_inf = (~finite).to(torch.float32)
            opt.grad_scale = run.grad_norm.clip_divisor(norm, clip)
            set_lr(opt, lr_at(self.step, self.cfg))
            try:
                opt.step()
            finally:
                del opt.found_inf, opt.grad_scale
            values = torch.stack([loss.detach().float(), norm.float(), self._stop_flag()])
            pending = PendingStep.copied(self.step, values)
        else:
            loss_f, norm_f = float(loss), float(norm)  # CPU-GPU sync point: decides the update
            if math.isfinite(loss_f) and math.isfinite(norm_f):
                run.grad_norm.clip_(norm_f, clip)
                set_lr(opt, lr_at(self.step, self.cfg))
                opt.step()
            pending = PendingStep(self.step, torch.tensor([loss_f, norm_f, 0.0]), None, False)
        opt.zero_grad(set_to_none=True)
        beat(self.step, "step end")
        return pending

    def _stop_flag(self) -> torch.Tensor:
        """The stop request on the device: MAX over the ranks (an all-reduce the host does not
        wait for), read when the step settles; 0 for one process (fit reads its own flag)."""
        flag = torch.full((), float(self.stop_requested), device=self.run.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def settle(self, pending: PendingStep) -> tuple[float, float]:
        """``pending``'s (global loss, global grad norm) as floats, waiting for that step only
        (not for steps enqueued after it); a non-finite one is counted as a skipped update."""
        loss_f, norm_f, stop = pending.numbers()
        self.settled_step = pending.step
        self.stop_seen = self.stop_seen or stop
        if math.isfinite(loss_f) and math.isfinite(norm_f):
            self.consecutive_bad = 0
        else:
            self.bad_steps += 1
            self.consecutive_bad += 1
            if self.run.state.rank == 0:
                log.warning("step %d: non-finite loss %s or grad norm %s; update skipped "
                            "(%d in a row, %d total)", pending.step, loss_f, norm_f,
                            self.consecutive_bad, self.bad_steps)
        return loss_f, norm_f

    # ------------------------------------------------------------------ the loop
    def _agree_stop(self) -> bool:
        """True on every rank when any rank got SIGTERM (one tiny all-reduce). Raises
        :class:`RunHalted` on every rank, before anything more is written, when rank 0 found
        its run folder deleted or replaced, or could not write a metrics row (``self.halt``)."""
        if self.run.state.rank == 0 and self.halt is None:
            self.halt = self._folder_lost()
        flag = torch.tensor([float(self.stop_requested), float(self.halt is not None)],
                            device=self.run.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop, halt = flag.tolist()  # CPU-GPU sync point (as before: one per settled step)
        if halt:
            raise RunHalted(from_rank0(self.halt))
        return bool(stop)

    def _folder_lost(self) -> str | None:
        """Rank 0: why the run folder is no longer this run's (``RunLock.lost``), or None."""
        why = self.lock.lost() if self.lock is not None else None
        if why is None:
            return None
        return (f"{why}. This run stopped after step {self.step} and wrote nothing more, so "
                f"its steps cannot mix with another run's there; rerunning the same command "
                f"starts from (or resumes) whatever that folder holds now. To keep a run's "
                f"folder, stop the run before deleting it (Ctrl-C saves and exits 75)")

    def _write_row(self, metrics: MetricsWriter, record: dict, printed: dict | None) -> None:
        """Rank 0 writes one metrics row, unless the run folder is lost or the storage refuses
        the write: then ``self.halt`` says why, and :meth:`_agree_stop` stops every rank."""
        if self.run.state.rank != 0 or self.halt is not None:
            return
        self.halt = self._folder_lost()
        if self.halt is not None:
            return
        try:
            metrics.log(record, printed)
        except OSError as e:  # StorageError included
            self.halt = self._folder_lost()  # deleted between the check and the write
            if self.halt is not None:
                return
            if not isinstance(e, StorageError):
                raise
            latest = latest_checkpoint(self.cfg.checkpoint_dir)
            kept = (f"the newest checkpoint, {latest}, is intact" if latest else
                    "no checkpoint was saved before it")
            self.halt = (f"{e}. The run stopped after step {self.step} without saving (its "
                         f"metrics row is lost) and {kept}; fix that and rerun the same "
                         f"command to resume")

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if name == "SIGINT" and self._first_sigint is not None and (
                now - self._first_sigint > SAME_CTRL_C_S):
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        if name == "SIGINT" and self._first_sigint is None:
            self._first_sigint = now
        self.stop_requested = True
        self.stop_signal = self.stop_signal or name

    def _save_and_report(self, background: bool = False) -> None:
        start = time.perf_counter()
        self.watchdog.beat(self.step, "save")
        path = self._saving(lambda: self.save(background))
        self.watchdog.beat(self.step, "step end")
        if path is not None and self.run.state.rank == 0:
            log.info("saved checkpoint %s (%.1f s)", path, time.perf_counter() - start)
        elif self.run.state.rank == 0:
            log.info("checkpoint step-%d staged in %.1f s; writing it in the background",
                     self.step, time.perf_counter() - start)

    def _saving(self, save):
        """``save()``, a collective save or commit whose failure every rank raises; when the
        run folder was deleted during it, :class:`RunHalted` says that instead of naming the
        write that failed there."""
        try:
            return save()
        except (RuntimeError, ValueError):
            lost = from_rank0(self._folder_lost() if self.run.state.rank == 0 else None)
            if lost:
                raise RunHalted(lost) from None
            raise

    def _streak(self, what: str) -> str:
        """What a non-finite streak cost, and which checkpoint is intact."""
        last = self.settled_step
        first = last - self.consecutive_bad + 1
        good = newest_finite(self.cfg.checkpoint_dir)
        intact = (f"the newest checkpoint saved from a finite state is {good}" if good else
                  f"no checkpoint from a finite state was saved in {self.cfg.checkpoint_dir}")
        return (f"{what}: steps {first}-{last} had a non-finite loss or gradient norm "
                f"(updates skipped, nothing saved from them; training.max_bad_steps="
                f"{self.cfg.training.max_bad_steps}); {intact}. Lower optimizer.lr, check the "
                f"data, or raise training.max_bad_steps, then rerun to resume")

    def _save_unless_streak(self, stop: bool, background: bool = False) -> None:
        """Save, but not periodically inside a non-finite streak: rotation would delete the
        good checkpoints for ones that hold nothing new (a stop signal still saves)."""
        if self.consecutive_bad and not stop:
            if self.run.state.rank == 0:
                log.warning("step %d: checkpoint skipped (%d non-finite steps in a row)",
                            self.step, self.consecutive_bad)
            return
        self._save_and_report(background)

    def fit(self) -> FitResult:
        """Train from the current step (after :meth:`resume`) to ``training.max_steps``."""
        cfg, run = self.cfg, self.run
        rank0 = run.state.rank == 0
        if self.step >= cfg.training.max_steps:
            if rank0:
                log.warning(
                    "the run in %s is finished: it resumed at step %d and training.max_steps="
                    "%d, so there is nothing to train. To train further, raise training."
                    "max_steps (the schedule stretches to it unless schedule.total_steps is "
                    "set); to start another run, set logging.run_dir to a new folder",
                    cfg.logging.run_dir, self.step, cfg.training.max_steps)
            return FitResult("finished", self.step, bad_steps=self.bad_steps)
        metrics = MetricsWriter(cfg.logging.run_dir, rank0, cfg.logging.tensorboard)
        result = FitResult("done", self.step)
        main = threading.current_thread() is threading.main_thread()
        stops = STOP_SIGNALS
        previous = [signal.signal(sig, self._on_signal) for sig in stops] if main else None
        every, eval_every = cfg.checkpoint.every, cfg.training.eval_every
        clock = Clock(self.step, cfg.training.max_steps)
        self.watchdog.start(self.step)
        try:
            last_time, last_step = time.perf_counter(), self.step
            earlier = None  # a step decided on the device whose numbers were not read yet
            while self.step < cfg.training.max_steps:
                pending = self.launch_step()
                if earlier is not None:  # the step before this one: done, or nearly
                    self._record(earlier, result)
                    earlier = None
                done = self.step == cfg.training.max_steps
                evaluate = bool(eval_every and run.valid_loader is not None and (
                    self.step % eval_every == 0 or done))
                logs = self.step % cfg.logging.log_every == 0 or done or self.step == 1
                save = bool(every and (self.step % every == 0 or done))
                stop_asked = self.stop_requested if run.state.world_size == 1 else self.stop_seen
                if pending.on_device and not (done or evaluate or logs or save or stop_asked):
                    # Nothing this step needs its numbers now: read them during the next step,
                    # so the host enqueues that one while this one runs (no CPU-GPU sync).
                    earlier = pending
                    if self.async_saver is not None:
                        self._report_background(self._saving(self.async_saver.poll))
                    continue
                loss, norm = self._record(pending, result)
                valid = None
                if evaluate:
                    self.watchdog.beat(self.step, "validation")
                    valid = validation_loss(run)
                    self.watchdog.beat(self.step, "step end")
                if logs or valid is not None:
                    now = time.perf_counter()
                    self._log(metrics, loss, norm, (self.step - last_step) / (now - last_time),
                              valid, clock.fields(self.step))
                    last_time, last_step = time.perf_counter(), self.step
                stop = self._agree_stop()
                if self.async_saver is not None:
                    self._report_background(self._saving(self.async_saver.poll))
                if stop or save:
                    self._save_unless_streak(stop, background=not (stop or done))
                if done and self.consecutive_bad:
                    raise TrainingDiverged(self._streak(
                        f"reached training.max_steps={cfg.training.max_steps} during a "
                        f"non-finite streak"))
                if stop:
                    result.status = "preempted"
                    if rank0:
                        log.warning("%s: stopped after step %d; the last checkpoint is %s; "
                                    "rerun the same command to resume",
                                    self.stop_signal or "a signal on another rank",
                                    self.step, latest_checkpoint(cfg.checkpoint_dir))
                    break
        finally:
            self.watchdog.stop()
            if main:
                for sig, handler in zip(stops, previous, strict=True):
                    signal.signal(sig, handler)
            metrics.close()
        result.step, result.bad_steps = self.step, self.bad_steps
        return result

    def _record(self, pending: PendingStep, result: FitResult) -> tuple[float, float]:
        """Settle ``pending`` into ``result``; raise TrainingDiverged at max_bad_steps."""
        loss, norm = self.settle(pending)
        result.losses.append(loss)
        result.grad_norms.append(norm)
        if self.consecutive_bad >= self.cfg.training.max_bad_steps:
            raise TrainingDiverged(self._streak(
                f"stopped after {self.consecutive_bad} non-finite steps in a row"))
        return loss, norm

    def _log(self, metrics: MetricsWriter, loss: float, norm: float, steps_per_s: float,
             valid: float | None = None, times: dict | None = None) -> None:
        world = self.run.state.world_size
        tokens_per_s = self.tokens_per_step * steps_per_s / world  # per device
        flops = tokens_per_s * self.flops_per_token
        extra = {} if valid is None else {"valid_loss": valid}
        if self.placeholders is not None:  # collective over dp: every rank logs the same steps
            count = torch.tensor(float(self.image_tokens), dtype=torch.float64)
            if self.run.state.dp > 1:
                dist.all_reduce(count, group=self.run.state.dp_group)
            share = float(count) / max(self.tokens_per_step * self.window_steps, 1)
            extra["image_tokens_per_s"] = tokens_per_s * share
            self.image_tokens = self.window_steps = 0
        if self.last_moe is not None:  # the last step's, global: collective over dp x cp
            extra.update(moe_record(self.last_moe.metrics()))
        if self.last_mtp is not None:  # the last step's MTP loss alone (its global mean)
            extra["mtp_loss"] = float(self.last_mtp)
        self._write_row(metrics, {"step": self.step, "loss": loss, "grad_norm": norm,
                                  "lr": lr_at(self.step, self.cfg), "tokens_per_s": tokens_per_s,
                                  "tflops": flops / 1e12,
                                  "mfu": None if self.peak is None else flops / self.peak,
                                  "mem_gib": max_memory_gib(self.run.device)} | extra, times)


def train(cfg: Config, source: str = "the config", loader=None,
          checkpoint_hook=None, step_hook=None, store: dist.Store | None = None) -> FitResult:
    """setup -> build -> resume -> fit; writes ``RUN_DIR/config.yaml`` (the resolved config).

    Rank 0 holds the run folder's lock throughout (``mpcore.rundir``); ``metrics.jsonl`` is cut
    back to the step resumed from, so every step appears in it once."""
    state = setup(cfg, source)
    lock = claim_run_dir(cfg, state.rank)
    try:
        device = resolve_device(cfg)
        run = build(cfg, state, device, loader=loader)
        trainer = Trainer(run, checkpoint_hook=checkpoint_hook, step_hook=step_hook,
                          store=store, lock=lock)
        run_dir = Path(run.cfg.logging.run_dir)
        if state.rank == 0:
            with writing(run_dir, "logging.run_dir"):
                save_config(run.cfg, run_dir / "config.yaml")
            log.info("model %s", json.dumps(dataclasses.asdict(run.model_cfg)))
            log.info("%s", startup_block(run, trainer.tokens_per_step, source))
        if cfg.checkpoint.resume:
            trainer.resume()
        if state.rank == 0:
            with writing(run_dir, "logging.run_dir"):
                dropped = rewrite_metrics(run_dir / "metrics.jsonl", trainer.step)
            if dropped:
                log.info("metrics.jsonl: dropped %d rows after step %d (run again from there)",
                         dropped, trainer.step)
        return trainer.fit()
    finally:
        if lock is not None:
            lock.release()
