"""The ``parallel`` section of the training config (``mpcore.config``): how the world is split.

Kept apart from ``mpcore.config`` (which re-exports it) so the layout's fields and their checks
read in one place: tp, cp, ep, pp and their options, data parallelism, timeouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpcore.parallel.pp_schedule import SCHEDULES, check_virtual, placement


def positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 1:
            raise ValueError(f"{section}.{name} must be >= 1, got {value!r}")


def choice(section: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name} must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class ParallelSection:
    """How the world is split: rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank));
    dp is inferred."""

    tp: int = 1
    """Tensor-parallel degree (ranks sharing each layer's weights)."""
    cp: int = 1
    """Context-parallel degree (ranks sharing each sequence)."""
    ep: int = 1
    """Expert-parallel degree of a MoE model: its experts split over ep of the dp x cp ranks
    (ep divides dp * cp; ep fastest inside dp x cp, mpcore.parallel.state). Needs data_parallel
    fsdp (expert weights sharded over the expert-data-parallel group). Checkpoints hold every
    expert, so a run resumes at any ep (mpcore.logical)."""
    pp: int = 1
    """Pipeline-parallel degree: the decoder's layers cut into pp stages (times pp_virtual) on
    torch.distributed.pipelining (mpcore.parallel.pp); the micro-batches of a step
    (data.grad_accum) flow through them. pp is the slowest rank dimension: each stage is a
    block of tp * cp * dp ranks."""
    pp_schedule: str = "1F1B"
    """torch's pipeline schedule at pp > 1: 1F1B, GPipe, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble or DualPipeV (those the installed torch has)."""
    pp_virtual: int = 0
    """Stages per pp rank: 0 picks the schedule's (1 for 1F1B and GPipe, 2 for the interleaved
    and V schedules); an interleaved schedule takes any number, a V schedule exactly 2."""
    pp_split: list[int] | None = None
    """Decoder layers per stage, in order (pp * virtual numbers adding up to the layers);
    null: as even as possible, the extra layers on the first stages."""
    cp_mode: str = "ring"
    """Context-parallel attention when cp > 1: ring or ulysses."""
    cp_layout: str = "zigzag"
    """Token split over cp ranks: zigzag (load-balanced causal) or contiguous."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside the tp group (needs tp > 1 to matter)."""
    data_parallel: str = "fsdp"
    """Gradient reduction over the dp x cp group: fsdp (FSDP2 fully_shard) or ddp."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward instead of storing its activations."""
    init_timeout_s: float = 300.0
    """Seconds the ranks wait for each other when the process group forms (the rendezvous and
    a first collective); past it every waiting rank exits with a message (exit code 4)
    instead of hanging, and torchrun --max-restarts can restart the run."""
    step_timeout_s: float = 300.0
    """Seconds a rank may go without progress in training (a phase of a step: data,
    forward/backward, optimizer, validation; 3x for a checkpoint save and for the first step
    of a process, which compiles and autotunes) before every rank stops with a message naming
    the rank that is behind (exit code 5; mpcore.watchdog), instead of waiting for the
    collective's own timeout (30 min gloo, 10 min NCCL). 300 s is 4x the longest phase measured
    here (a 70 s save of a 2.2B VL run on an H200, before the 3x). 0 disables it."""

    def __post_init__(self):
        positive("parallel", self, "tp", "cp", "ep", "pp")
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"parallel.pp_schedule must be one of {list(SCHEDULES)} (those "
                             f"this torch provides), got {self.pp_schedule!r}")
        check_virtual(self.pp_schedule, self.virtual_stages)
        if self.step_timeout_s < 0:
            raise ValueError(f"parallel.step_timeout_s must be >= 0 seconds (0 disables the "
                             f"step watchdog), got {self.step_timeout_s!r}")
        if self.ep > 1 and self.data_parallel != "fsdp":
            raise ValueError(f"parallel.ep={self.ep} needs parallel.data_parallel=fsdp (DDP "
                             f"would average different experts over dp x cp)")
        if not self.init_timeout_s > 0:
            raise ValueError(f"parallel.init_timeout_s must be > 0 seconds, got "
                             f"{self.init_timeout_s!r}")
        choice("parallel", "cp_mode", self.cp_mode, ("ring", "ulysses"))
        choice("parallel", "cp_layout", self.cp_layout, ("zigzag", "contiguous"))
        choice("parallel", "data_parallel", self.data_parallel, ("fsdp", "ddp"))



    @property
    def virtual_stages(self) -> int:
        """Stages per pp rank: ``pp_virtual``, or the schedule's when 0 (field docstring)."""
        if self.pp_virtual:
            return self.pp_virtual
        return 1 if placement(self.pp_schedule) == "single" else 2
