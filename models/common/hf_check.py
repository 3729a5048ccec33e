"""A Hugging Face checkpoint's tensor names against what its family reads, before any load.

A family's loader reads the tensors its shard map names and nothing else. A checkpoint that
holds more (a tensor the model has no place for, or layer 5 of a config.json that says 4
layers) or less is a checkpoint of another shape: loading it would silently drop weights, or
fail late on the first missing one. :func:`check_tensor_names` compares, by name and before a
single tensor is read, the checkpoint's names with the family's shard map at tp = 1 (the
logical tensors), and refuses any difference by name. Tensors a family knowingly does not use
(``Family.hf_skipped``, glob patterns such as ``mtp.*``; and everywhere the rotary buffers old
checkpoints stored, and a tied model's ``lm_head.weight``) are listed once in the log.

Experts: the shard map names transformers 5.x's fused expert tensors
(``{mlp}experts.gate_up_proj`` / ``down_proj``); a released checkpoint may hold the same
experts one tensor each (``{mlp}experts.{j}.gate_proj.weight`` ...), which
``moe_hf.read_experts`` also reads. Either form satisfies the name.
"""

from __future__ import annotations

import fnmatch
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from mpcore.models.common.hf_io import Checkpoint

log = logging.getLogger(__name__)

_REPORTED: ContextVar[Path | None] = ContextVar("hf_check_reported", default=None)
"""The folder whose skipped tensors were just logged (``reported_while``)."""

ALWAYS_SKIPPED = ("*.rotary_emb.inv_freq",)
"""Buffers some older checkpoints saved; every family recomputes them."""
_SHOWN = 8


def _released_experts(name: str, shape: tuple[int, ...]) -> set[str] | None:
    """The per-expert names that hold the fused expert tensor ``name`` (None: not an expert)."""
    for fused, parts in (("experts.gate_up_proj", ("gate_proj", "up_proj")),
                         ("experts.down_proj", ("down_proj",))):
        if name.endswith(fused):
            mlp = name[: -len(fused)]
            return {f"{mlp}experts.{j}.{p}.weight" for j in range(shape[0]) for p in parts}
    return None


def _expected(table: dict, have: set[str]) -> set[str]:
    names = {}
    for pieces in table.values():
        for piece in pieces:
            names[piece.name] = piece.shape
    expected = set()
    for name, shape in names.items():
        released = _released_experts(name, shape)
        expected |= released if released and name not in have and released & have else {name}
    return expected


def _listing(names: set[str]) -> str:
    shown = sorted(names)[:_SHOWN]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return ", ".join(shown) + more


def check_tensor_names(folder: str | Path, family, cfg) -> None:
    """``ValueError`` naming the tensors of checkpoint ``folder`` that ``family`` (a
    ``Family``) has no place for under ``cfg`` (the config read from the folder's config.json),
    and those it needs but the folder lacks; logs the knowingly skipped ones once."""
    folder = Path(folder)
    have = set(Checkpoint(folder).files)
    expected = _expected(family.shard_map(cfg, 1, 0), have)
    patterns = (*ALWAYS_SKIPPED, *family.hf_skipped)
    if getattr(cfg, "tie_embeddings", False):
        patterns = (*patterns, "lm_head.weight")
    skipped = {n for n in have - expected if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    unexpected, missing = have - expected - skipped, expected - have
    if unexpected or missing:
        parts = []
        if unexpected:
            parts.append(f"{len(unexpected)} tensors the {family.name} model has no place for "
                         f"({_listing(unexpected)})")
        if missing:
            parts.append(f"{len(missing)} tensors it needs are missing ({_listing(missing)})")
        raise ValueError(f"{folder}: {'; '.join(parts)}. The weights do not match config.json "
                         f"(num_hidden_layers, num_experts, layer types, ...): fix config.json "
                         f"to describe these weights, or use the checkpoint they came with")
    if skipped:
        kinds = Counter(n.split(".")[0] + ".*" if n.startswith("mtp.") else n for n in skipped)
        log.info("%s: the %s model does not use %d of its tensors, skipped: %s", folder,
                 family.name, len(skipped),
                 ", ".join(f"{k} ({c})" if c > 1 else k for k, c in sorted(kinds.items())))


@contextmanager
def reported_while(folder: str | Path) -> Iterator[None]:
    """Inside: ``folder``'s skipped tensors were logged (by :func:`check_tensor_names`), so a
    loader that would list them again stays quiet (:func:`already_reported`): one log line
    per load, not one per checker."""
    token = _REPORTED.set(Path(folder).resolve())
    try:
        yield
    finally:
        _REPORTED.reset(token)


def already_reported(folder: str | Path) -> bool:
    """True inside ``reported_while(folder)``."""
    return _REPORTED.get() == Path(folder).resolve()
