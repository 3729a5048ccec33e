"""RNG for model parallelism: per-TP-rank streams for dropout, and TP-invariant weight init.

Two needs (Megatron's RNG tracker):
- Dropout on activations that are *sharded* across TP ranks (attention probabilities of local
  heads, the column-parallel MLP's hidden) must differ per TP rank, or every shard drops the
  same pattern. Dropout on *replicated* activations (the residual stream outside SP) must be
  the same on every TP rank, or the replicas diverge. ``RNGTracker.fork("tp")`` switches the
  default generator to a per-TP-rank stream for the first case; outside it, the default
  generator is seeded identically on all TP ranks.
- Weights must be the same function at any TP degree: ``init_shard_`` draws the LOGICAL full
  tensor from a generator seeded by (seed, parameter name) and copies this rank's slice.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator

import torch

# Offset between the default stream and the per-rank TP streams (any constant works; it only
# has to keep the two families of seeds apart).
_TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named RNG states for one device; ``fork(name)`` runs a block on that stream.

    The default generator of ``device`` is untouched by a fork: its state is saved before and
    restored after, and the named stream advances across forks.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; use another name")
        saved = _get_state(self.device)
        torch.manual_seed(seed) if self.device.type == "cpu" else torch.cuda.manual_seed(seed)
        self._states[name] = _get_state(self.device)
        _set_state(self.device, saved)

    @contextlib.contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        if name not in self._states:
            raise ValueError(f"unknown RNG stream {name!r}; known: {sorted(self._states)}")
        saved = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}


def model_parallel_seed(seed: int, tp_rank: int, device: torch.device | str = "cpu") -> RNGTracker:
    """Seed the default generator with ``seed`` (same on every TP rank) and return a tracker
    whose ``"tp"`` stream is seeded per TP rank (``seed + 2718 + tp_rank``)."""
    device = torch.device(device)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    tracker = RNGTracker(device)
    tracker.add("tp", seed + _TP_SEED_OFFSET + tp_rank)
    return tracker


def param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed (crc32 of the name; Python's ``hash`` is salted per process)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def normal_init(std: float) -> Callable[[torch.Tensor, torch.Generator], None]:
    """An init function ``fn(full_tensor, generator)`` drawing N(0, std^2)."""

    def fn(t: torch.Tensor, gen: torch.Generator) -> None:
        t.normal_(0.0, std, generator=gen)

    return fn


@torch.no_grad()
def init_shard_(shard: torch.Tensor, full_shape: tuple[int, ...],
                take_shard: Callable[[torch.Tensor], torch.Tensor],
                init_fn: Callable[[torch.Tensor, torch.Generator], None], seed: int) -> None:
    """Fill ``shard`` with this rank's slice of the logical full tensor.

    The full tensor (``full_shape``, fp32, on the CPU) is drawn by ``init_fn`` from a generator
    seeded with ``seed``, so every TP degree sees the same values; ``take_shard(full)`` returns
    this rank's slice. Cost: one full fp32 tensor in host memory at a time.
    """
    gen = torch.Generator().manual_seed(seed)
    full = torch.empty(full_shape, dtype=torch.float32)
    init_fn(full, gen)
    part = take_shard(full)
    if part.shape != shard.shape:
        raise AssertionError(f"shard shape {tuple(part.shape)} != parameter {tuple(shard.shape)}")
    shard.copy_(part)
