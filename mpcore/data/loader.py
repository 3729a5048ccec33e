"""Deterministic, resumable data-parallel loader over packed samples.

Order: epoch ``e`` visits the samples in ``permutation(num_samples)`` drawn from
``numpy.random.default_rng([seed, e])``. Epoch by epoch the order is consumed in global batches
of ``G = micro_batch * grad_accum * dp`` samples (the tail shorter than ``G`` is skipped).

Rank split, within one global batch ``g`` (G sample indices):
    dp rank ``r`` takes ``g[r::dp]`` (micro_batch * grad_accum samples), and its micro-batch
    ``m`` is ``g[r::dp][m * micro_batch : (m + 1) * micro_batch]``.
So the dp ranks see disjoint samples that together are the global batch, each rank reads
only its own, and the same global batch with another (dp, grad_accum) split holds the same
samples. TP and CP ranks of one dp rank load the same micro-batches (pass the dp coordinates,
``ParallelState.dp_rank`` / ``.dp``).

A micro-batch is ONE packed stream of B = micro_batch samples of S = seq_len tokens:
    input_ids     int64 [B * S]
    cu_seqlens    int32 [segments + 1]   every sample's boundaries, offset by b * S
    position_ids  int64 [B * S]          restart at 0 at every segment
    loss_mask     bool [B * S]           only when a sample has one (chat SFT); a sample
                                         without one counts every token
Labels are not made here (``mpcore.parallel.LabelShifter(input_ids, cu_seqlens)`` in the training
loop).

Position: ``state_dict()`` holds the epoch and the number of global samples consumed in it;
``load_state_dict`` restores it, so a resumed run sees exactly the micro-batches the original
run would have seen next. The state is the same on every rank and does not depend on how a
global batch is split, so a checkpoint saved at a step boundary resumes under another dp size
with the same global batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from mpcore.data.packing import PackedSample


def collate(samples: Sequence[PackedSample]) -> dict[str, torch.Tensor]:
    """Concatenate packed samples into one packed stream (shapes in the module docstring)."""
    ids = np.concatenate([s.input_ids for s in samples])
    pos = np.concatenate([s.position_ids for s in samples])
    cu = [np.zeros(1, np.int64)]
    start = 0
    for s in samples:
        cu.append(np.asarray(s.cu_seqlens[1:], dtype=np.int64) + start)
        start += len(s.input_ids)
    batch = {
        "input_ids": torch.from_numpy(ids.astype(np.int64)),
        "cu_seqlens": torch.from_numpy(np.concatenate(cu).astype(np.int32)),
        "position_ids": torch.from_numpy(pos.astype(np.int64)),
    }
    if any(s.loss_mask is not None for s in samples):
        masks = [np.ones(len(s.input_ids), np.uint8) if s.loss_mask is None else s.loss_mask
                 for s in samples]
        batch["loss_mask"] = torch.from_numpy(np.concatenate(masks).astype(bool))
    return batch


class DataLoader:
    """Endless iterator of this dp rank's micro-batches; see the module docstring.

    ``samples``: a sequence of :class:`PackedSample` (PackedDataset or BlendedDataset).
    ``dp_rank``/``dp``: coordinates in the data-parallel group (not the dp x cp group).
    ``collate_fn``: samples -> micro-batch dict (default :func:`collate`).
    """

    def __init__(
        self,
        samples: Sequence[PackedSample],
        micro_batch: int,
        grad_accum: int,
        dp: int,
        dp_rank: int,
        seed: int,
        collate_fn: Callable[[list], dict[str, torch.Tensor]] | None = None,
    ):
        for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("dp", dp)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp})")
        self.samples = samples
        self.collate_fn = collate if collate_fn is None else collate_fn
        self.micro_batch, self.grad_accum, self.seed = micro_batch, grad_accum, seed
        self.dp, self.dp_rank = dp, dp_rank
        self.global_batch = micro_batch * grad_accum * dp
        self.num_samples = len(samples)
        self.steps_per_epoch = self.num_samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch} (micro_batch {micro_batch} x grad_accum {grad_accum} x "
                f"dp {dp}); use a larger corpus, a smaller batch or a shorter seq_len"
            )
        self.epoch = 0
        self.consumed = 0  # global samples consumed in this epoch
        self._order_epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """int64 [num_samples]: the global sample order of ``epoch`` (cached for the current one)."""
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def micro_batch_indices(self, epoch: int, consumed: int) -> np.ndarray:
        """int64 [micro_batch]: this rank's sample indices for the micro-batch at ``consumed``."""
        step, within = divmod(consumed, self.global_batch)
        m = within // (self.micro_batch * self.dp)
        g = self.order(epoch)[step * self.global_batch : (step + 1) * self.global_batch]
        mine = g[self.dp_rank :: self.dp]
        return mine[m * self.micro_batch : (m + 1) * self.micro_batch]

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.consumed >= self.steps_per_epoch * self.global_batch:
            self.epoch += 1
            self.consumed = 0
        indices = self.micro_batch_indices(self.epoch, self.consumed)
        self.consumed += self.micro_batch * self.dp
        return self.collate_fn([self.samples[int(i)] for i in indices])

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """The ``grad_accum`` micro-batches of one optimizer step."""
        return [next(self) for _ in range(self.grad_accum)]

    def state_dict(self) -> dict[str, int]:
        """The position, identical on every rank (plain ints: fits any checkpoint)."""
        return {
            "seed": self.seed,
            "num_samples": self.num_samples,
            "epoch": self.epoch,
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state``; raises ``ValueError`` when it belongs to other data or seed."""
        for key in ("seed", "num_samples"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data position has {key}={state[key]} but this run has "
                    f"{getattr(self, key)}; resume with the same data and data seed, or start "
                    "a new run"
                )
        consumed = int(state["consumed"])
        if consumed % (self.micro_batch * self.dp):
            raise ValueError(
                f"the checkpoint stopped {consumed} samples into an epoch, not a multiple of "
                f"micro_batch x dp = {self.micro_batch * self.dp}; resume with the layout it "
                "was saved with or from a checkpoint at a step boundary"
            )
        self.epoch, self.consumed = int(state["epoch"]), consumed
