"""A progress bar on stderr for the command-line tools (data preparation, export).

    [##########..........]  50%  tokenizing data/corpus  12.0/24.0 MB  0:00:07 left

On a terminal the bar redraws in place at most every ``interval`` seconds; elsewhere (a log
file, CI) it writes one line per 10 % so the log stays short. ``close()`` draws 100 %.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
WIDTH = 20


class ProgressBar:
    """Progress of ``total`` units (``unit``: ``"MB"`` scales bytes; anything else counts)."""

    def __init__(self, label: str, total: float, unit: str = "", stream=None,
                 interval: float = 0.5):
        self.label, self.total, self.unit = label, max(float(total), 1e-9), unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = interval
        self.start = self.last = time.monotonic()
        self.done = 0.0
        self.shown_tenth = -1

    def _amount(self, value: float) -> str:
        if self.unit == "MB":
            return f"{value / 1e6:.1f}"
        return f"{value:.0f}"

    def _draw(self, final: bool) -> None:
        frac = min(self.done / self.total, 1.0)
        elapsed = time.monotonic() - self.start
        left = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        filled = int(frac * WIDTH)
        tail = "done" if final else f"{int(left) // 60}:{int(left) % 60:02d} left"
        text = (f"[{'#' * filled}{'.' * (WIDTH - filled)}] {frac:4.0%}  {self.label}  "
                f"{self._amount(self.done)}/{self._amount(self.total)} {self.unit}  {tail}")
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + text + end)
        self.stream.flush()

    def update(self, done: float) -> None:
        """Set the amount done so far (units since the start)."""
        self.done = min(float(done), self.total)
        now = time.monotonic()
        if self.tty:
            if now - self.last >= self.interval:
                self.last = now
                self._draw(final=False)
            return
        tenth = int(10 * self.done / self.total)
        if tenth > self.shown_tenth and tenth < 10:
            self.shown_tenth = tenth
            self._draw(final=False)

    def advance(self, amount: float) -> None:
        self.update(self.done + amount)

    def close(self) -> None:
        self.done = self.total
        self._draw(final=True)

    def wrap(self, items: Iterable[T], size: Callable[[T], float]) -> Iterator[T]:
        """Yield ``items``, advancing by ``size(item)`` after each; closes at the end."""
        for item in items:
            yield item
            self.advance(size(item))
        self.close()
