"""JSON Lines input, read one line at a time, every problem named by ``path:line``.

Used by every reader of user JSONL files (tokenizer corpora, image-text manifests, score.py's
input): blank lines are skipped (score.py's input, whose line i is output line i, reports them
instead: ``skip_blank=False``), a line that is not UTF-8 or not JSON is reported with where it
is, and the caller decides whether that stops the read or is collected with other problems.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


class Line(NamedTuple):
    number: int  # 1-based line number
    where: str  # "path:number", for messages
    value: object  # the decoded JSON, None when there is a problem
    problem: str | None  # why the line is unusable: not UTF-8, or not JSON


def json_lines(path: str | Path, skip_blank: bool = True) -> Iterator[Line]:
    """A :class:`Line` per non-blank line of ``path`` (per line, blank ones reported as a
    problem, when not ``skip_blank``), streaming."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            if not raw.strip():
                if not skip_blank:
                    yield Line(line_no, where, None, "a blank line")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Line(line_no, where, None, f"not UTF-8 text (byte {e.start})")
                continue
            try:
                yield Line(line_no, where, json.loads(line), None)
            except json.JSONDecodeError as e:
                yield Line(line_no, where, None, f"not JSON ({e.msg} at column {e.colno})")
