"""What every vision tower does before building its blocks.

A tower takes a ``ParallelState`` (its tp group is used), a tp ``ProcessGroup`` or None (one
process); its heads and MLP widths are sharded over that group (the family's config says which
widths, ``check_parallel``), everything else is replicated over it. ``attention_kernel`` names
the segment attention's CUDA kernel (``mpcore.models.common.vision_attention.KERNELS``).
"""

from __future__ import annotations

from torch import nn

from mpcore.models.common.vision_attention import KERNELS
from mpcore.parallel.state import ParallelState, ProcessGroup, group_rank, group_size


class TowerBase(nn.Module):
    """Sets ``cfg``, ``tp_group``, ``tp``, ``tp_rank`` and ``activation_checkpointing`` after
    checking the kernel name and the config against the tp degree (module docstring)."""

    def __init__(self, cfg, state_or_tp_group: ParallelState | ProcessGroup | None,
                 activation_checkpointing: bool, attention_kernel: str):
        super().__init__()
        if attention_kernel not in KERNELS:
            raise ValueError(f"attention_kernel must be one of {KERNELS}, got "
                             f"{attention_kernel!r}")
        group = (state_or_tp_group.tp_group if isinstance(state_or_tp_group, ParallelState)
                 else state_or_tp_group)
        self.cfg, self.tp_group = cfg, group
        self.tp, self.tp_rank = group_size(group), group_rank(group)
        cfg.check_parallel(self.tp)
        self.activation_checkpointing = activation_checkpointing
