"""Run a function in N processes joined by gloo, for CPU distributed tests.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, joins them with a
gloo process group over a FileStore in a temporary folder, calls ``fn(rank, world_size, *args)``
in each and returns the list of return values by rank. An exception on any rank fails the call
with that rank's traceback; a rank that does not finish within ``timeout`` seconds (a hung
collective) kills every process and fails the call instead of hanging CI.

``fn`` must be a module-level function (it is pickled by name for the started processes).

Ranks are forked from multiprocessing's fork server, started once per test session, that has
imported torch, transformers and this project (``PRELOAD``): a fresh interpreter per rank (the
"spawn" start) spent 3-8 s importing them on CI's 2 cores before any test code ran, for every
call. The server is a fresh interpreter that only imported (no OpenMP pool, no process group),
so a fork of it starts as clean as a spawn. One difference: ranks see the environment of the
process at the session's first call, so pass anything a rank must know through ``args``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback

# Imported once by the fork server; every rank starts with them loaded.
PRELOAD = ["torch", "torch.distributed", "transformers", "mpcore.parallel", "mpcore.models", "mpcore.train",
           "mpcore.launch.score"]


def _worker(fn, rank, world_size, store_path, results, payload):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # world_size processes share CI's 2 cores
    ok = False
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        # Plain pickle bytes, like the payload: tensors put on the queue as they are travel as
        # shared-memory handles that the parent must fetch from this process, and a rank that
        # had already exited failed the read (FileNotFoundError / connection reset, seen).
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *pickle.loads(payload)))))
        ok = True
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    try:
        if ok:
            # Leave together: a rank that tore its process group down while a peer was still
            # connecting a group (new_group is collective) made that peer fail with
            # "Connection closed by peer" (seen on CI). If a peer failed, this barrier fails
            # too, and that peer's own traceback is what the parent reports.
            dist.barrier()
    except Exception:  # noqa: BLE001
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, on the first call
    results = ctx.Queue()
    # Plain pickle copies tensors into the bytes; multiprocessing's own pickler would pass each
    # tensor's storage as a file descriptor, and the fork server takes at most 256 of them.
    payload = pickle.dumps(args)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, store_path, results, payload),
                        daemon=True)
            for r in range(world_size)
        ]
        out, errors = {}, []
        try:
            for p in procs:
                p.start()  # inside the try: ranks started before a failing start get killed
            deadline = time.monotonic() + timeout
            while len(out) + len(errors) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{fn.__name__}: ranks {sorted(set(range(world_size)) - set(out))} did "
                        f"not finish within {timeout:.0f}s (hung collective?)"
                        + "".join(errors))
                try:
                    rank, ok, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead and not errors:
                        # A rank died without reporting (segfault, os._exit): fail fast.
                        time.sleep(1.0)
                        if results.empty():
                            raise RuntimeError(
                                f"{fn.__name__}: ranks {dead} exited with codes "
                                f"{[procs[r].exitcode for r in dead]} without a result") from None
                    continue
                if ok:
                    out[rank] = pickle.loads(value)
                else:
                    errors.append(f"\n--- rank {rank} ---\n{value}")
                    # The other ranks may now block in a collective: give them a moment, then stop.
                    deadline = min(deadline, time.monotonic() + 10.0)
            if errors:
                raise RuntimeError(f"{fn.__name__} failed on {len(errors)} rank(s):"
                                   + "".join(errors))
        finally:
            # Ranks that all returned are leaving on their own; after a failure or a timeout
            # the rest have had their time (a hung one would hold the test 5 s more per rank).
            grace = 5.0 if len(out) == world_size else 0.0
            for p in procs:
                if p.pid is None:
                    continue  # never started
                p.join(timeout=grace)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]
