"""Pipeline schedules by name: the ones ``torch.distributed.pipelining`` provides, and their
theoretical bubble.

We run no schedule of our own: a name picks one of torch's classes, and the name also fixes how
global stages sit on the pp ranks (``stage_indices``):

    single  one stage per rank, stage s on pp rank s                   (1F1B, GPipe)
    loop    ``virtual`` stages per rank, stage s on pp rank s % pp     (Interleaved1F1B,
            LoopedBFS, InterleavedZeroBubble)
    v       two stages per rank, rank r holds stages r and 2 pp - 1 - r (ZBVZeroBubble,
            DualPipeV), so the first and the last stage share rank 0

Bubble (``theoretical_bubble``): the idle fraction of a rank's step time in the cost model of
the zero-bubble paper (Qi et al. 2023) with equal costs: each of the ``virtual`` chunks of a
rank spends F on a micro-batch's forward, B on its input gradient and W on its weight gradient,
F = B = W; a schedule that does not split the backward runs B + W together. With ``m``
micro-batches, ``p`` ranks and ``v`` chunks per rank, the busy time is ``3 m`` (chunk costs are
1 / v each, v chunks) and the idle time is

    GPipe, 1F1B                    (p - 1) * 3             -> bubble (p-1) / (m + p - 1)
    Interleaved1F1B, LoopedBFS     (p - 1) * 3 / v         -> bubble (p-1) / (v m + p - 1)
    InterleavedZeroBubble (ZB-H1)  (p - 1) * (F + B - W) / v
    ZBVZeroBubble, DualPipeV       0 (their warm-up is hidden once m >= 2 p; below that the
                                   model does not hold and the measured bubble says more)

so ``bubble = idle / (idle + busy)``. A real step departs from it by the head's and the
embedding's extra cost and by communication; ``tests/perf/bench_pp.py`` measures it.
"""

from __future__ import annotations

import torch.distributed.pipelining as pipelining

# name -> (torch class name, placement)
_KNOWN = {
    "1F1B": ("Schedule1F1B", "single"),
    "GPipe": ("ScheduleGPipe", "single"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
    "DualPipeV": ("ScheduleDualPipeV", "v"),
}
# Only those this torch has (DualPipeV is recent).
SCHEDULES: dict[str, tuple[str, str]] = {
    name: spec for name, spec in _KNOWN.items() if hasattr(pipelining, spec[0])}


# Schedules that compute a stage's input gradient and its weight gradient in two separate
# backward passes (the zero-bubble trick): a kernel that saves gradients computed inside its
# forward and hands them out in one backward (the fused loss head's ``loss_sum``) cannot run
# under them, so their last stage takes the per-token path.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def check_schedule(name: str) -> str:
    """``name`` when torch provides that schedule; ``ValueError`` listing the names otherwise."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; this torch provides "
                         f"{list(SCHEDULES)} (names are case-sensitive)")
    return name


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` class of schedule ``name``."""
    return getattr(pipelining, SCHEDULES[check_schedule(name)][0])


def placement(name: str) -> str:
    """``single``, ``loop`` or ``v`` (module docstring)."""
    return SCHEDULES[check_schedule(name)][1]


def check_virtual(name: str, virtual: int) -> int:
    """Stages per rank for schedule ``name``: ``ValueError`` naming the fix when ``virtual``
    does not fit it (a single-stage schedule takes 1, a V schedule exactly 2)."""
    kind = placement(name)
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual stages per rank must be a positive integer, got {virtual!r}")
    if kind == "single" and virtual != 1:
        raise ValueError(f"schedule {name} runs one stage per rank, got virtual={virtual}; "
                         f"set virtual 1, or pick an interleaved schedule "
                         f"({[n for n, s in SCHEDULES.items() if s[1] == 'loop']})")
    if kind == "v" and virtual != 2:
        raise ValueError(f"schedule {name} runs exactly 2 stages per rank (a V), got "
                         f"virtual={virtual}; set virtual 2")
    return virtual


def stage_indices(name: str, pp: int, pp_rank: int, virtual: int) -> list[int]:
    """The global stage indices (of ``pp * virtual``) that pp rank ``pp_rank`` holds, in the
    order torch's schedule takes its local stages."""
    kind = placement(name)
    check_virtual(name, virtual)
    if kind == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + pp * k for k in range(virtual)]


def check_microbatches(name: str, pp: int, num_microbatches: int) -> None:
    """``ValueError`` naming the numbers when torch's schedule ``name`` cannot run
    ``num_microbatches`` micro-batches over ``pp`` ranks (the limits torch enforces, checked
    before any stage is built)."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or (
            num_microbatches < 1):
        raise ValueError(f"num_microbatches must be a positive integer, got "
                         f"{num_microbatches!r}")
    need = {"1F1B": pp, "DualPipeV": 2 * pp}.get(name, 1)  # one per stage
    if num_microbatches < need:
        raise ValueError(f"schedule {name} needs at least {need} micro-batches at pp={pp} (one "
                         f"per stage), got {num_microbatches}; raise the micro-batch count or "
                         f"use GPipe")
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, num_microbatches // pp)
        if num_microbatches % rounds:
            raise ValueError(f"schedule {name} runs micro-batches in rounds of pp={pp}: "
                             f"{num_microbatches} micro-batches make {rounds} rounds, which do "
                             f"not divide them; use a count up to pp or a multiple of pp "
                             f"(e.g. {rounds * pp})")


def theoretical_bubble(name: str, pp: int, num_microbatches: int, virtual: int = 1) -> float:
    """Idle fraction of a rank's step in the equal-cost model of the module docstring."""
    check_virtual(name, virtual)
    p, m, v = pp, num_microbatches, virtual
    if p == 1:
        return 0.0
    busy = 3.0 * m
    if name in ("GPipe", "1F1B"):
        idle = (p - 1) * 3.0
    elif name in ("Interleaved1F1B", "LoopedBFS"):
        idle = (p - 1) * 3.0 / v
    elif name == "InterleavedZeroBubble":
        idle = (p - 1) * (1.0 + 1.0 - 1.0) / v
    else:  # V schedules: no bubble in the model
        idle = 0.0
    return idle / (idle + busy)
