"""Communication of the context-parallel attention: metadata all-gather and the ring shift.

Group: the cp group (every rank of it calls each function, in the same order). Tokens per rank
must be equal (the context split pads to make them so). No autograd here: the ring's custom
backward and the Ulysses all-to-alls (``mpcore.parallel.collectives``) own the gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpcore.parallel.collectives import all_gather
from mpcore.parallel.state import ProcessGroup, group_rank, group_size


def gather_metadata(doc_id: torch.Tensor, pos: torch.Tensor, group: ProcessGroup | None,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' ``doc_id``/``pos`` ``[T_local]`` as ``[cp, T_local]`` (row r: rank r), on
    the CPU (a CPU-GPU sync point under NCCL). Raises ``ValueError`` when the ranks hold
    different token counts."""
    cp = group_size(group)
    meta = torch.stack([doc_id.to(device=device, dtype=torch.int64),
                        pos.to(device=device, dtype=torch.int64)])  # (2, T_local)
    sizes = all_gather(torch.tensor([meta.shape[1]], device=device), 0, group).tolist()
    if len(set(sizes)) != 1:
        raise ValueError(f"context-parallel ranks hold different token counts {sizes}; split "
                         "the stream with mpcore.parallel.context so every cp rank has the same "
                         "number of (padded) tokens")
    gathered = all_gather(meta, 1, group).cpu()  # (2, cp * T_local), rank-major
    return gathered[0].view(cp, -1), gathered[1].view(cp, -1)


def ring_shift(x: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, list]:
    """Post the ring transfer of ``x``: send it to rank + 1, receive rank - 1's into a new
    buffer. Returns ``(buffer, works)``; call ``wait(works)`` before reading the buffer, and
    leave ``x`` unchanged until then. A group of one returns ``x`` itself."""
    cp, rank = group_size(group), group_rank(group)
    if cp == 1:
        return x, []
    assert x.is_contiguous(), "ring_shift sends contiguous tensors only"
    buffer = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + 1) % cp), group),
           dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, (rank - 1) % cp), group)]
    return buffer, dist.batch_isend_irecv(ops)


def wait(works: list) -> None:
    """Block (on GPU: make the current stream wait) until the posted transfers are done."""
    for work in works:
        work.wait()
