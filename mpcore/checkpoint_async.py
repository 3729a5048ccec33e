"""Checkpoints written in the background (``checkpoint.async_save``): training goes on while
the files are written, with the same manifest, rotation and crash guarantees.

    step N boundary   begin_save (tmp-step-N); dcp.async_save into it on a gloo group of its
                      own, which stages (copies this rank's tensors to host memory) and
                      returns
    steps N+1 ...     a helper thread waits for the write, then hashes this rank's files;
                      at each step boundary the ranks agree (one all-reduce) whether every
                      rank's write and hashes are done
    when all done     finish_save on the training thread: entries to rank 0, meta.json, the
                      manifest, rename to step-N, ``latest``, rotation (as a blocking save)

Nothing is renamed into place before every rank's files are written and hashed and the manifest
is written, so a process killed during the background write leaves ``tmp-step-N`` without a
manifest: never loaded, removed at the next start. One save is in flight at a time: a save
requested while one is in flight first waits for it. A stop signal, the last step or an error
path use a blocking save (they must not leave a write behind).

Cost: host memory for DCP's staged copy of this rank's share, on top of the CPU tensors that
``TrainState.collect`` gathers (the blocking save needs those too); the write competes with
training for host memory bandwidth and the disk. The step that starts a save pays the gather
and the copy, not the write.
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mpcore.checkpoint import (
    PendingSave,
    _failed,
    _nbytes,
    _single_process_quiet,
    begin_save,
    finish_save,
    own_entries,
)


class AsyncSaver:
    """At most one background save per rank (module docstring). Collective methods are called
    by every rank at the same step boundaries."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        # The write's own collectives (DCP's plan and finish) run on this group, from DCP's
        # thread, while training uses the default group on the training thread.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        if not dist.is_initialized():  # DCP warns from its own thread, out of our reach there
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        self.pending: PendingSave | None = None
        self._result: Future | None = None
        self._nbytes = 0

    def start(self, root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict,
              *, keep_last: int, hook=None) -> None:
        """Begin saving ``tensors`` as ``root/step-<step>``; returns once they are staged."""
        self.wait()
        save = begin_save(root, step, meta, keep_last=keep_last, rank=self.rank, hook=hook)
        self.pending, self._nbytes, self._result = save, _nbytes(tensors), Future()
        if save.failure is not None:
            self._result.set_result(({}, save.failure))
            return
        try:
            with _single_process_quiet():
                # Stages (DCP's DefaultStager: a copy in host memory) before it returns, so
                # the optimizer may change the parameters during the write.
                written = dcp.async_save(tensors, checkpoint_id=save.tmp,
                                         process_group=self.group,
                                         no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:
            self._result.set_result(({}, _failed(e, self.rank)))
            return
        threading.Thread(target=self._hash_when_written, args=(written, save, self._result),
                         name="mpcore-checkpoint-hash", daemon=True).start()

    def _hash_when_written(self, written: Future, save: PendingSave, result: Future) -> None:
        try:
            written.result()
            result.set_result((own_entries(save.tmp, self.rank), None))
        except (Exception, CheckpointException) as e:
            result.set_result(({}, _failed(e, self.rank)))

    def poll(self) -> Path | None:
        """Commit the save in flight if every rank's part is done (one all-reduce); returns
        its folder then, else None. Collective."""
        if self.pending is None:
            return None
        # On the training thread's (default) group: DCP's thread may be using self.group.
        done = torch.tensor(float(self._result.done()), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self._finish() if done.item() else None

    def wait(self) -> Path | None:
        """Wait for the save in flight and commit it; returns its folder (None: none).
        Collective."""
        if self.pending is None:
            return None
        self._result.result()
        return self._finish()

    def _finish(self) -> Path:
        save, (mine, failure) = self.pending, self._result.result()
        self.pending = self._result = None
        return finish_save(save, mine, self._nbytes, failure)
