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

Staging: ``TrainState.collect`` writes this rank's share into pinned host buffers that are kept
from one save to the next (:class:`HostStaging`), by asynchronous device-to-host copies and one
synchronize, and DCP writes those buffers as they are (:class:`_AsIs`: no second copy). The
buffers are reused only after the previous write is committed (``Trainer.save`` waits first).
Cost: one pinned copy of this rank's share of the checkpoint, held from the first save on
(page-locked, so the OS cannot swap it; the first save pays its allocation); the write competes
with training for host memory bandwidth and the disk. The step that starts a save pays the
gather and the device-to-host copy, not the write.
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

STAGING_SHARE_OF_MEMORY = 0.25  # auto: the node's pinned copies may take this much of it


def background_saves(setting: str, device: torch.device, params: int, world: int,
                     local_ranks: int, memory_bytes: int | None) -> tuple[bool, str]:
    """Whether ``checkpoint.async_save=setting`` saves in the background, and why (for the
    log). ``auto``: on a GPU when the pinned copies of this node's ``local_ranks`` ranks (each
    1/world of ``params`` fp32 weights and two AdamW states) fit in ``STAGING_SHARE_OF_MEMORY``
    of ``memory_bytes`` (the node's memory; None: unknown, no)."""
    if setting != "auto":
        return setting == "true", f"checkpoint.async_save={setting}"
    need = params * 12 * local_ranks // max(world, 1)
    if device.type != "cuda":
        return False, "checkpoint.async_save=auto: saves block (not a GPU run)"
    if memory_bytes is None or need > STAGING_SHARE_OF_MEMORY * memory_bytes:
        have = "unknown" if memory_bytes is None else f"{memory_bytes / 2**30:.0f} GiB"
        return False, (f"checkpoint.async_save=auto: saves block (this node's staged copies "
                       f"would take {need / 2**30:.1f} GiB of its {have} memory; set "
                       f"checkpoint.async_save=true to stage anyway)")
    return True, (f"checkpoint.async_save=auto: periodic saves are written in the background "
                  f"({need / 2**30:.1f} GiB of pinned host memory on this node)")


def node_memory_bytes() -> int | None:
    """This machine's memory (MemTotal of /proc/meminfo); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class HostStaging:
    """Host buffers for the checkpoint tensors, one per key, reused by every save: pinned
    when the tensors come from a GPU (asynchronous copies), plain on a CPU run."""

    def __init__(self, device: torch.device):
        self.pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, key: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        t = self._buffers.get(key)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            t = self._buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
        return t

    def ready(self, device: torch.device) -> None:
        """Wait for the copies into the buffers (issued on the current stream)."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


class _AsIs:
    """DCP stager that hands the state dict over as it is: its tensors are host copies that
    nothing changes until the write is committed (:class:`HostStaging`)."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


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
        self.staging = HostStaging(device)

    def start(self, root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict,
              *, keep_last: int, hook=None) -> None:
        """Begin saving ``tensors`` (collected into :attr:`staging` after :meth:`wait`) as
        ``root/step-<step>``; returns once the write has started."""
        if self.pending is not None:
            raise RuntimeError("a background save is in flight: wait() before collecting the "
                               "next one into the staging buffers")
        save = begin_save(root, step, meta, keep_last=keep_last, rank=self.rank, hook=hook)
        self.pending, self._nbytes, self._result = save, _nbytes(tensors), Future()
        if save.failure is not None:
            self._result.set_result(({}, save.failure))
            return
        try:
            with _single_process_quiet():
                # The tensors are already host copies (staging): no second copy by DCP.
                written = dcp.async_save(tensors, checkpoint_id=save.tmp,
                                         process_group=self.group, async_stager=_AsIs(),
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
