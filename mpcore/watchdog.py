"""The step watchdog: a rank that stops making progress stops the whole run, by name.

A rank that hangs (a stalled filesystem read, a GPU fault, a deadlock in a data worker) leaves
every other rank blocked in the next collective until its timeout: 30 minutes for gloo, 10 for
NCCL, and neither says which rank it waited for. Here each rank's training loop marks its
progress (:meth:`StepWatchdog.beat`: the step it is in and the phase: data, forward/backward,
optimizer, validation, save); a thread per rank publishes the newest mark in the rendezvous
store about once a second. When a rank has seen no mark of its own for ``parallel.step_timeout_s``
(three times that for the first step of a process, which compiles and autotunes, and for a
checkpoint save), it reads every rank's mark, and the first rank to get there prints one
message naming the rank(s) furthest behind and where they are; every rank then exits with code
5 (``mpcore.processes.EXIT_STUCK``). The run resumes from its last checkpoint when rerun (or
restarted by ``torchrun --max-restarts``).

The healthy ranks wait in a collective for the stuck one, so they make no progress either:
their watchdogs fire within about a second of each other's, and the stuck rank's own (its
thread runs while its main thread waits) fires too, unless the whole process is frozen.

Cost: a ``time.monotonic()`` and two assignments per mark on the training thread; the store
gets one small ``set`` per second per rank from the watchdog thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from mpcore.processes import EXIT_STUCK

PHASES = ("data", "forward/backward", "optimizer", "validation", "save", "step end")
SLOW_PHASE_FACTOR = 3  # the first step of a process and checkpoint saves
_KEY = "mpcore/progress/"


class StepWatchdog:
    """Per-rank watchdog (module docstring). ``timeout_s <= 0`` disables it.

    ``store``: the rendezvous store every rank reaches (``mpcore.processes.init_distributed``),
    or None (then the message can name only this rank).
    """

    def __init__(self, timeout_s: float, store: dist.Store | None, rank: int, world: int,
                 poll_s: float = 1.0):
        self.timeout_s, self.store, self.rank, self.world = timeout_s, store, rank, world
        self.poll_s = min(poll_s, max(timeout_s / 4, 0.05))
        self.step, self.phase, self.last = 0, "step end", time.monotonic()
        self.first_step: int | None = None
        self._published: tuple | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, step: int) -> None:
        if self.timeout_s <= 0:
            return
        self.first_step = step + 1
        self.beat(step + 1, "data")
        self._thread = threading.Thread(target=self._run, name="mpcore-step-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def beat(self, step: int, phase: str) -> None:
        """This rank is in ``step`` (1-based), ``phase`` (one of PHASES), now."""
        self.step, self.phase, self.last = step, phase, time.monotonic()

    def limit(self) -> float:
        slow = self.phase == "save" or self.step == self.first_step
        return self.timeout_s * (SLOW_PHASE_FACTOR if slow else 1)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._publish()
            idle = time.monotonic() - self.last
            if idle > self.limit():
                self._fire(idle)

    def _publish(self) -> None:
        mark = (self.step, self.phase)
        if self.store is None or mark == self._published:
            return
        try:
            self.store.set(f"{_KEY}{self.rank}", f"{self.step} {PHASES.index(self.phase)}")
            self._published = mark
        except (RuntimeError, TimeoutError):  # the store host is gone: torchrun handles that
            pass

    def marks(self) -> dict[int, tuple[int, str]]:
        """rank -> (step, phase) as published by every rank that published one."""
        out = {}
        if self.store is None:
            return {self.rank: (self.step, self.phase)}
        for rank in range(self.world):
            key = f"{_KEY}{rank}"
            try:
                if self.store.check([key]):
                    step, phase = self.store.get(key).decode().split()
                    out[rank] = (int(step), PHASES[int(phase)])
            except (RuntimeError, TimeoutError, ValueError, IndexError):
                continue
        out[self.rank] = (self.step, self.phase)
        return out

    def _first_to_report(self) -> bool:
        if self.store is None:
            return True
        try:
            return self.store.add("mpcore/stuck", 1) == 1
        except (RuntimeError, TimeoutError):
            return self.rank == 0

    def _fire(self, idle: float) -> None:
        if self.store is not None:
            self.store.set_timeout(timedelta(seconds=5))
        if self._first_to_report():
            message = stuck_message(self.marks(), self.world, idle, self.timeout_s)
            print(f"error (rank {self.rank}): {message}", file=sys.stderr, flush=True)
        else:
            time.sleep(1.0)  # the reporter's line goes out before torchrun stops everyone
        os._exit(EXIT_STUCK)


def stuck_message(marks: dict[int, tuple[int, str]], world: int, idle: float,
                  timeout_s: float) -> str:
    """Which ranks are behind, and where, from every rank's (step, phase)."""
    order = {rank: (step, PHASES.index(phase)) for rank, (step, phase) in marks.items()}
    silent = sorted(set(range(world)) - set(marks))
    low = min(order.values())
    behind = sorted(r for r, v in order.items() if v == low) if not silent else silent
    ahead = sorted(set(marks) - set(behind))
    where = lambda r: f"step {marks[r][0]} ({marks[r][1]})"  # noqa: E731
    furthest = max(ahead, key=order.__getitem__) if ahead else None
    if silent:
        who = f"rank{'s' if len(silent) > 1 else ''} {_ranks(silent)} published no progress"
    elif ahead:
        who = (f"rank{'s' if len(behind) > 1 else ''} {_ranks(behind)} "
               f"{'are' if len(behind) > 1 else 'is'} behind, at {where(behind[0])}; rank"
               f"{'s' if len(ahead) > 1 else ''} {_ranks(ahead)} reached {where(furthest)} and "
               f"wait{'' if len(ahead) > 1 else 's'} for it")
    else:
        who = (f"every rank is at {where(behind[0])}: a collective that no rank completes "
               f"(one rank inside it is stuck, e.g. a GPU fault; see each rank's log)")
    return (f"no progress for {idle:.0f} s (parallel.step_timeout_s={timeout_s:g}): {who}. "
            f"Every rank stops (exit {EXIT_STUCK}) instead of waiting for the collective's "
            f"timeout. Rerun the same command to resume from the last checkpoint; look at the "
            f"stuck rank's host (a stalled filesystem, a GPU error in its log), or raise "
            f"parallel.step_timeout_s if its steps really take this long")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8
                                             else "")
