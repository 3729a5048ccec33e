"""Process groups for tensor (tp), context (cp), data (dp) and pipeline (pp) parallelism.

Rank order (DESIGN.md): tp fastest, then cp, then dp, then pp (slowest):

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so the ranks of one TP group are neighbours and land inside one node, and at pp = 1 the
numbering is the tp x cp x dp one unchanged. Each pipeline stage is a contiguous block of
``tp * cp * dp`` ranks (a node or several), so the only traffic between blocks is the stage
boundary's activations. The grid is ``torch.arange(world).view(pp, dp, cp, tp)``; every group
is read off it.

Groups:
    tp      ranks that shard weights (same cp_rank, dp_rank)
    cp      ranks that shard the sequence (same tp_rank, dp_rank)
    dp      ranks that see different batches (same tp_rank, cp_rank)
    dp_cp   dp x cp: gradient reduction and FSDP sharding (CP ranks hold the same weights)
    tp_cp   tp x cp: ranks that together hold one model replica's sequence and weights
    pp      ranks that hold successive pipeline stages of one replica (same tp_rank, cp_rank,
            dp_rank); created only when pp > 1
    tp_pp   tp x pp (pp > 1 only): the ranks that together hold one replica's weights once
            (same cp_rank, dp_rank): a sum over them counts every weight once (gradient norm)
    pp_ends the first and the last pp rank (pp > 1 only; same tp, cp, dp ranks): a tied head's
            two copies of the embedding sum their gradients over it
    ep      expert parallelism (``ep`` > 1 only): ``ep`` consecutive ranks of one dp x cp group
            (same tp_rank) that split the experts of every MoE layer between them
    edp     expert data parallelism: the dp x cp ranks (same tp_rank) holding the SAME experts;
            expert gradients reduce (and FSDP2 shards expert weights) over it, size dp*cp/ep

Expert parallelism shares the dp x cp ranks (Megatron's expert-data-parallel layout): ``ep``
divides dp * cp and, inside the dp x cp group (index ``j = cp_rank + cp * dp_rank``), ep is
fastest:

    ep_rank = j % ep        edp_rank = j // ep

so an ep group is ep neighbouring dp x cp ranks (cp ranks first), within a node when tp * ep
is at most the node's GPUs. ep = 1 (the default) adds no group: ``ep_group`` is None and the
expert weights reduce over ``dp_cp`` like every other weight.

Every group but ``pp`` lies inside one pipeline stage (one pp_rank): a stage's tp, cp, dp and
ep groups are those of a world of ``tp * cp * dp`` ranks, offset by ``pp_rank`` blocks.

A process without torch.distributed initialised is a valid world of one: every group is
``None`` and every size is 1. The state is passed explicitly; nothing here is global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """World size of ``group``; 1 for ``None`` or when torch.distributed is not initialised."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 for ``None`` or without torch.distributed."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


@dataclass
class ParallelState:
    """Degrees, this process's coordinates and the process groups of one parallel layout.

    Build it with :meth:`build`; construct directly only for a world of one.
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    rank: int = 0
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    groups: dict[str, ProcessGroup | None] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def tp_group(self) -> ProcessGroup | None:
        return self.groups.get("tp")

    @property
    def cp_group(self) -> ProcessGroup | None:
        return self.groups.get("cp")

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self.groups.get("dp")

    @property
    def dp_cp_group(self) -> ProcessGroup | None:
        return self.groups.get("dp_cp")

    @property
    def tp_cp_group(self) -> ProcessGroup | None:
        return self.groups.get("tp_cp")

    @property
    def pp_group(self) -> ProcessGroup | None:
        """The pipeline group (module docstring); None when pp = 1."""
        return self.groups.get("pp")

    @property
    def pp_ends_group(self) -> ProcessGroup | None:
        """The first and last pp rank (module docstring); None when pp = 1."""
        return self.groups.get("pp_ends")

    @property
    def tp_pp_group(self) -> ProcessGroup | None:
        """tp x pp (module docstring); the tp group when pp = 1."""
        return self.groups.get("tp_pp", self.tp_group)

    @property
    def ep_group(self) -> ProcessGroup | None:
        return self.groups.get("ep")

    @property
    def edp_group(self) -> ProcessGroup | None:
        """Expert data parallelism (module docstring); ``dp_cp_group`` when ep = 1."""
        return self.groups.get("edp", self.dp_cp_group)

    @property
    def edp_rank(self) -> int:
        """Rank inside the edp group (module docstring)."""
        return self.dp_cp_rank // self.ep

    @property
    def edp(self) -> int:
        return self.dp_cp // self.ep

    @property
    def dp_cp_rank(self) -> int:
        """Rank inside the dp x cp group (cp fastest)."""
        return self.cp_rank + self.cp * self.dp_rank

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @classmethod
    def build(cls, tp: int = 1, cp: int = 1, dp: int | None = None,
              ep: int = 1, pp: int = 1) -> ParallelState:
        """Create the groups for ``pp`` x ``dp`` x ``cp`` x ``tp`` over the current world, the
        ep / edp groups when ``ep`` > 1 (``ep`` must divide dp * cp; module docstring) and the
        pp group when ``pp`` > 1.

        ``dp`` is inferred as ``world // (tp * cp * pp)`` when not given. Every process of the
        world must call this with the same arguments (``new_group`` is collective).
        Raises ``ValueError`` when the degrees do not tile the world.
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        for name, value in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        model = tp * cp * pp  # ranks of one data-parallel replica
        if world % model != 0:
            raise ValueError(
                f"world size {world} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {model}; "
                f"choose tp, cp and pp whose product divides {world}, or launch a multiple of "
                f"{model} processes"
            )
        if dp is None:
            dp = world // model
        if model * dp != world:
            raise ValueError(
                f"tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {model * dp} does not equal the world "
                f"size {world}; set dp={world // model} or leave dp unset to infer it"
            )
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or (dp * cp) % ep:
            raise ValueError(f"ep = {ep!r} must be a positive integer dividing dp*cp = "
                             f"{dp}*{cp} = {dp * cp} (expert parallelism shares the dp x cp "
                             f"ranks); choose an ep that divides {dp * cp}")
        grid = torch.arange(world).view(pp, dp, cp, tp)
        pp_rank, dp_rank, cp_rank, tp_rank = (int(i) for i in (grid == rank).nonzero()[0])
        state = cls(tp=tp, cp=cp, dp=dp, rank=rank, tp_rank=tp_rank, cp_rank=cp_rank,
                    dp_rank=dp_rank, ep=ep, ep_rank=(cp_rank + cp * dp_rank) % ep, pp=pp,
                    pp_rank=pp_rank)
        if not dist.is_initialized():
            return state
        # Each family of groups is a set of rank lists; every process creates all of them
        # (new_group is collective over the world) and keeps the one it belongs to. The
        # leading pp dimension makes each stage's lists those of a tp x cp x dp world.
        families = {
            "tp": grid.reshape(-1, tp),
            "cp": grid.permute(0, 1, 3, 2).reshape(-1, cp),
            "dp": grid.permute(0, 2, 3, 1).reshape(-1, dp),
            "dp_cp": grid.permute(0, 3, 1, 2).reshape(-1, dp * cp),
            "tp_cp": grid.reshape(pp * dp, cp * tp),
        }
        if ep > 1:  # dp_cp index j = cp_rank + cp * dp_rank; ep_rank = j % ep
            by_j = grid.permute(0, 3, 1, 2).reshape(pp, tp, dp * cp // ep, ep)
            families["ep"] = by_j.reshape(-1, ep)
            families["edp"] = by_j.permute(0, 1, 3, 2).reshape(-1, dp * cp // ep)
        if pp > 1:
            families["pp"] = grid.permute(1, 2, 3, 0).reshape(-1, pp)
            families["tp_pp"] = grid.permute(1, 2, 0, 3).reshape(-1, pp * tp)
            families["pp_ends"] = grid[[0, pp - 1]].permute(1, 2, 3, 0).reshape(-1, 2)
        for name, rows in families.items():
            for ranks in rows.tolist():
                group = dist.new_group(ranks)
                if rank in ranks:
                    state.groups[name] = group
        return state

    def __repr__(self) -> str:
        return (f"ParallelState(tp={self.tp}, cp={self.cp}, dp={self.dp}, rank={self.rank}, "
                f"tp_rank={self.tp_rank}, cp_rank={self.cp_rank}, dp_rank={self.dp_rank}"
                + (f", ep={self.ep}, ep_rank={self.ep_rank}" if self.ep > 1 else "")
                + (f", pp={self.pp}, pp_rank={self.pp_rank})" if self.pp > 1 else ")"))
