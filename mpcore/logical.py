"""Layout-independent (logical) form of the model's tensors, and per-element norm weights.

A parameter of a family's model (its registry entry's ``shard_map``; the decoder's is
``mpcore.models.common.decoder_hf.shard_map``) on tp rank r is a concatenation, along one dim, of
pieces of Hugging Face tensors: ``wqkv`` holds rows of q_proj, k_proj and v_proj,
``w13`` rows of gate_proj and up_proj, ``wo``/``w2`` columns of o_proj/down_proj, the embedding
and untied head rows of a vocab shard padded with zero rows, norms the whole vector. The LOGICAL
form of a parameter (or of an optimizer state shaped like it) is those HF tensors, full-size,
padding stripped: the same at every tp degree, so a checkpoint in this form loads at any layout.

    gather:  tp-local tensor [local shape]  --all-gather over tp-->  {hf_name: full tensor}
    shard:   {hf_name: full tensor}  --pieces of this rank-->  tp-local tensor

Norm weights: a logical element may be held by several tp ranks (norms on every rank; kv heads
replicated when tp > num_kv_heads) and padding rows by none. ``norm_weight`` gives each local
element 1 / (number of tp ranks holding it), 0 for padding, so summing ``weight * g**2`` over the
tp group counts every logical element exactly once (the true global gradient norm).

Expert parallelism: the experts of a MoE layer (``experts``: our names of the tensors split
over ep, ``mpcore.models.common.moe.expert_param_names``) are split on dim 0 over the ep group, ep
rank r holding the global experts ``[r E / ep, (r + 1) E / ep)`` (``mpcore.parallel.experts``). Their
logical form holds all ``E`` experts, the same at every ep: ``gather_experts`` all-gathers the
ep slices back into the ``[E, ...]`` tensor the tp maps describe (expert tensors are whole on
every tp rank; ``gather_experts_to`` onto one ep rank only, what saving uses), ``shard`` keeps
this ep rank's rows.

    gather:  ep-local [E / ep, ...]  --all-gather over ep-->  [E, ...]  --tp, as above-->  HF
    shard:   HF  --tp pieces-->  [E, ...]  --rows of this ep rank-->  [E / ep, ...]
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from mpcore.models import family_of
from mpcore.models.common.hf_io import Piece
from mpcore.parallel.collectives import all_gather
from mpcore.parallel.state import ProcessGroup


def _sizes(pieces: list[Piece]) -> list[int]:
    return [p.stop - p.start for p in pieces]


class LogicalLayout:
    """The logical form of every parameter of a model built from ``cfg`` at ``tp`` (``holds``:
    the names of those a pipeline stage holds, None for the whole model).

    ``maps[r][name]``: pieces of tp rank ``r``; ``hf_shapes``: full shape of each HF tensor;
    ``owners``: our parameter name -> the HF names its pieces come from (in piece order).
    """

    def __init__(self, cfg, tp: int, tp_rank: int, *, ep: int = 1, ep_rank: int = 0,
                 experts: Iterable[str] = (), holds: Iterable[str] | None = None):
        self.cfg, self.tp, self.tp_rank = cfg, tp, tp_rank
        # A pipeline stage holds some of the parameters: ``names`` lists those (None: all).
        self.holds = None if holds is None else frozenset(holds)
        self.ep, self.ep_rank = ep, ep_rank
        table = family_of(cfg).shard_map  # the family's HF pieces per tp rank
        self.maps = [table(cfg, tp, r) for r in range(tp)]
        self.hf_shapes: dict[str, tuple[int, ...]] = {}
        self.owners: dict[str, list[str]] = {}
        for name, pieces in self.maps[0].items():
            self.owners[name] = list(dict.fromkeys(p.name for p in pieces))
            for p in pieces:
                self.hf_shapes[p.name] = p.shape
        self.experts = frozenset(experts)
        for name in self.experts:  # internal invariants of the ep split (module docstring)
            pieces = self.maps[0].get(name)
            assert pieces is not None and len(pieces) == 1, (name, pieces)
            assert pieces[0].dim == 0 and pieces[0].shape[0] % ep == 0, (name, pieces, ep)
        self._count = self._multiplicity()

    @property
    def names(self) -> list[str]:
        """Our parameter names (those this rank holds: ``holds``), in a fixed order."""
        return [n for n in self.maps[0] if self.holds is None or n in self.holds]

    def dim(self, name: str) -> int:
        return self.maps[0][name][0].dim

    def _ep_rows(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This ep rank's experts (dim-0 rows) of an expert tensor holding all of them; any
        other tensor (and every tensor at ep 1) as it is."""
        if name not in self.experts or self.ep == 1:
            return t
        local = t.shape[0] // self.ep
        return t.narrow(0, self.ep_rank * local, local)

    @torch.no_grad()
    def gather_experts(self, name: str, local: torch.Tensor,
                       ep_group: ProcessGroup | None) -> torch.Tensor:
        """The tp-local tensor of parameter ``name`` with every expert: ``[E, ...]`` from this
        ep rank's ``[E / ep, ...]`` (ep ranks in order hold consecutive experts). Collective
        over ``ep_group`` for an expert tensor at ep > 1 (every rank of it calls this for the
        same names, in the same order); any other tensor is returned as it is."""
        if name not in self.experts or self.ep == 1:
            return local
        return all_gather(local.detach(), 0, ep_group)

    @torch.no_grad()
    def gather_experts_to(self, name: str, local: torch.Tensor, ep_group: ProcessGroup | None,
                          dst: int) -> torch.Tensor | None:
        """``gather_experts`` onto ep rank ``dst`` only (the rank that writes the tensor):
        ``[E, ...]`` there, None on the other ep ranks, which never hold every expert. Same
        collective contract as ``gather_experts``; any other tensor is returned as it is."""
        if name not in self.experts or self.ep == 1:
            return local
        local = local.detach().contiguous()
        out = parts = None
        if dist.get_rank(ep_group) == dst:
            out = local.new_empty((self.ep * local.shape[0], *local.shape[1:]))
            parts = list(out.chunk(self.ep))  # contiguous dim-0 views: received in place
        dist.gather(local, parts, dst=dist.get_global_rank(ep_group, dst), group=ep_group)
        return out

    def _multiplicity(self) -> dict[str, torch.Tensor]:
        """HF name -> int64 [shape[dim]]: how many tp ranks hold each index along the dim."""
        out: dict[str, torch.Tensor] = {}
        for pieces_of in self.maps:
            for pieces in pieces_of.values():
                for p in pieces:
                    t = out.setdefault(p.name, torch.zeros(p.shape[p.dim], dtype=torch.int64))
                    stop = min(p.stop, p.shape[p.dim])
                    if stop > p.start:
                        t[p.start:stop] += 1
        return out

    def norm_weight(self, name: str) -> torch.Tensor:
        """fp32 [local size along ``dim(name)``]: 1 / holders per element, 0 for padding."""
        parts = []
        for p in self.maps[self.tp_rank][name]:
            w = torch.zeros(p.stop - p.start)
            stop = min(p.stop, p.shape[p.dim])
            if stop > p.start:
                w[: stop - p.start] = 1.0 / self._count[p.name][p.start:stop].float()
            parts.append(w)
        return self._ep_rows(name, torch.cat(parts))

    @torch.no_grad()
    def gather(self, name: str, local: torch.Tensor, group: ProcessGroup | None,
               out_dtype: torch.dtype | None = None, alloc=None) -> dict[str, torch.Tensor]:
        """Full HF tensors (on the CPU) of our parameter ``name`` from every rank's ``local``
        (an expert tensor with all its experts: ``gather_experts`` first).

        ``alloc(hf_name, shape, dtype)``: where each full tensor is written (default: a new
        CPU tensor). A pinned target (``mpcore.checkpoint_async.HostStaging``) is filled by
        asynchronous device-to-host copies: the caller synchronizes before reading it.
        Collective over the tp ``group``: every rank of it calls this with its own shard.
        """
        dim = self.dim(name)
        local = local.detach()
        shards = all_gather(local, dim, group).chunk(self.tp, dim=dim)
        full: dict[str, torch.Tensor] = {}
        dtype = out_dtype or local.dtype
        for rank, shard in enumerate(shards):
            pieces = self.maps[rank][name]
            for p, part in zip(pieces, shard.split(_sizes(pieces), dim=dim), strict=True):
                target = full.get(p.name)
                if target is None:
                    target = full[p.name] = (torch.empty(p.shape, dtype=dtype) if alloc is None
                                             else alloc(p.name, tuple(p.shape), dtype))
                keep = min(p.stop, p.shape[dim]) - p.start
                if keep > 0:
                    target.narrow(dim, p.start, keep).copy_(part.narrow(dim, 0, keep),
                                                            non_blocking=target.is_pinned())
        return full

    def shard(self, name: str, full: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's local tensor of our parameter ``name`` from the full HF tensors: its tp
        pieces, and of an expert tensor its ep rank's experts."""
        pieces = self.maps[self.tp_rank][name]
        dim = pieces[0].dim
        parts = []
        for p in pieces:
            tensor = full[p.name]
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(f"checkpoint tensor {p.name} has shape {tuple(tensor.shape)} "
                                 f"but the model's config needs {p.shape}; load it with the "
                                 f"model config it was saved with")
            stop = min(p.stop, p.shape[dim])
            part = tensor.narrow(dim, p.start, max(stop - p.start, 0))
            pad = (p.stop - p.start) - part.shape[dim]
            if pad:
                shape = list(part.shape)
                shape[dim] = pad
                part = torch.cat([part, part.new_zeros(shape)], dim=dim)
            parts.append(part)
        return self._ep_rows(name, torch.cat(parts, dim=dim))
