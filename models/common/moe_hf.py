"""Expert (MoE) layers in Hugging Face checkpoints: shard-map entries, loading by ep rank, export.

Shared by every MoE family (Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE, Qwen3.5-VL-MoE). Names
(``mlp`` = the HF prefix of one sparse layer's MLP, e.g. ``model.layers.i.mlp.``; ``ours`` =
our ``layers.i.feed_forward.``):

    {ours}gate.weight     [E, hidden]        {mlp}gate.weight (the router, whole)
    {ours}experts.w13     [E/ep, 2I, hidden] released: {mlp}experts.{e}.gate_proj ; up_proj
                                             fused: {mlp}experts.gate_up_proj [E, 2I, H]
    {ours}experts.w2      [E/ep, hidden, I]  released: {mlp}experts.{e}.down_proj
                                             fused: {mlp}experts.down_proj [E, H, I]

Released checkpoints (Qwen/Qwen3-30B-A3B) store one tensor per expert, transformers 5.x holds
them fused; loading takes either (found per layer by name) and ep rank r reads only its
experts ``[r E / ep, (r + 1) E / ep)``. A shard map (the logical form every tool reads) gives
the fused names at ep = 1 (:func:`expert_pieces`). Export goes through the common writer
(``hf_io.write_hf``): the tp group of rank 0 gathers the dense tensors, the ep group of rank 0
the experts, written by the family's layout (:func:`released_experts` or
:func:`fused_experts`); rank 0 writes. ``cfg`` below is a MoE decoder config (``hidden_size``,
``moe_intermediate_size``, ``num_experts``, ``moe_layers``). ``extra``: MoE layers outside the
decoder's stack, as ``(our feed_forward prefix, HF mlp prefix)`` pairs (Qwen3.5-MoE's
multi-token-prediction layer: ``("mtp.layers.0.feed_forward.", "mtp.layers.0.mlp.")``), read
and written like the decoder's, in either layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from mpcore.models.common.hf_io import Checkpoint, Piece, whole, write_hf
from mpcore.parallel.collectives import all_gather
from mpcore.parallel.state import ParallelState


def is_expert_param(name: str) -> bool:
    """Parameters split over ep (their gradients reduce over the edp group, not dp x cp)."""
    return ".feed_forward.experts." in f".{name}"


def expert_pieces(out: dict[str, list[Piece]], cfg, ours: str, mlp: str) -> None:
    """Replace the dense MLP entries ``{ours}w13.weight`` / ``w2.weight`` of shard map ``out``
    with one sparse layer's router and experts (fused names, all E; module docstring)."""
    h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    del out[ours + "w13.weight"], out[ours + "w2.weight"]
    out[ours + "gate.weight"] = whole(mlp + "gate.weight", (e, h))
    out[ours + "experts.w13"] = whole(mlp + "experts.gate_up_proj", (e, 2 * inter, h))
    out[ours + "experts.w2"] = whole(mlp + "experts.down_proj", (e, h, inter))


def read_experts(ckpt: Checkpoint, cfg, mlp: str, first: int, count: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [count, 2I, H], w2 [count, H, I])`` of experts ``first ..`` in either layout.
    Fused tensors come in both orientations: transformers 5.x's ``[E, 2I, H]`` / ``[E, H, I]``
    and the released Qwen3-VL-MoE checkpoints' ``[E, H, 2I]`` / ``[E, I, H]`` (transformers
    transposes those on load); the stored shapes say which (the pair is never ambiguous:
    that would need both 2I = H and I = H)."""
    h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    names = (mlp + "experts.gate_up_proj", mlp + "experts.down_proj")
    if names[0] in ckpt.files:
        ours, flipped = ((e, 2 * inter, h), (e, h, inter)), ((e, h, 2 * inter), (e, inter, h))
        stored = tuple(ckpt.shape(n) for n in names)
        if stored not in (ours, flipped):
            raise ValueError(f"{ckpt.folder}: {names[0]} / down_proj have shapes {stored} but "
                             f"the config implies {ours} (or transposed, {flipped}); check "
                             f"config.json against the weights")
        w13, w2 = (ckpt.read(Piece(n, shape, 0, first, first + count))
                   for n, shape in zip(names, stored, strict=True))
        return (w13.transpose(1, 2), w2.transpose(1, 2)) if stored == flipped else (w13, w2)
    if mlp + f"experts.{first}.gate_proj.weight" not in ckpt.files:
        raise ValueError(f"{ckpt.folder} has neither {mlp}experts.gate_up_proj (transformers "
                         f"5.x) nor {mlp}experts.{first}.gate_proj.weight (released layout): "
                         f"not a MoE checkpoint of this config")
    w13, w2 = [], []
    for j in range(first, first + count):
        name = f"{mlp}experts.{j}."
        w13.append(torch.cat([ckpt.read(whole(name + f"{p}.weight", (inter, h))[0])
                              for p in ("gate_proj", "up_proj")]))
        w2.append(ckpt.read(whole(name + "down_proj.weight", (h, inter))[0]))
    return torch.stack(w13), torch.stack(w2)


def read_expert_piece(ckpt: Checkpoint, piece: Piece, ep: int, ep_rank: int,
                      pending: dict) -> torch.Tensor:
    """Ep rank ``ep_rank``'s experts of a shard map's fused expert ``piece``
    (``{mlp}experts.gate_up_proj [E, 2I, H]`` or ``{mlp}experts.down_proj [E, H, I]``, as
    :func:`expert_pieces` names them) in whichever layout the checkpoint has
    (:func:`read_experts`). A layer's two tensors are read together; ``pending`` (a dict the
    caller keeps over one load) holds the other until it is asked for."""
    mlp, kind = piece.name.rsplit("experts.", 1)
    if mlp not in pending:
        e, rows, cols = piece.shape
        h, inter = (cols, rows // 2) if kind == "gate_up_proj" else (rows, cols)
        sizes = SimpleNamespace(hidden_size=h, moe_intermediate_size=inter, num_experts=e)
        pair = read_experts(ckpt, sizes, mlp, ep_rank * (e // ep), e // ep)
        pending[mlp] = dict(zip(("gate_up_proj", "down_proj"), pair, strict=True))
    out = pending[mlp].pop(kind)
    if not pending[mlp]:
        del pending[mlp]
    return out


def expert_layers(cfg, ours: str = "", hf: str = "model.",
                  extra: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """``(our feed_forward prefix, HF mlp prefix)`` of every MoE layer: decoder ``cfg``'s
    sparse layers, then ``extra`` (module docstring)."""
    return [(f"{ours}layers.{i}.feed_forward.", f"{hf}layers.{i}.mlp.")
            for i in cfg.moe_layers] + list(extra)


@torch.no_grad()
def load_moe_weights(model: nn.Module, folder: str | Path, state: ParallelState,
                     cfg, table: dict[str, list[Piece]], ours: str = "",
                     hf: str = "model.", extra: Sequence[tuple[str, str]] = ()) -> None:
    """Fill this rank's shards of ``model``: the experts of decoder ``cfg``'s sparse layers
    (our ``{ours}layers.i.feed_forward.experts.*``, HF ``{hf}layers.i.mlp.experts*``) and of
    ``extra`` with this ep rank's experts, every other parameter with its tp pieces of
    ``table``."""
    ckpt = Checkpoint(Path(folder))
    params = dict(model.named_parameters())
    assert set(params) == set(table), sorted(set(params) ^ set(table))
    local = cfg.num_experts // state.ep
    for ff, mlp in expert_layers(cfg, ours, hf, extra):
        name = ff + "experts."
        w13, w2 = read_experts(ckpt, cfg, mlp, state.ep_rank * local, local)
        params[name + "w13"].copy_(w13.to(params[name + "w13"].dtype))
        params[name + "w2"].copy_(w2.to(params[name + "w2"].dtype))
    for name, pieces in table.items():
        if not is_expert_param(name):
            part = torch.cat([ckpt.read(p) for p in pieces], dim=pieces[0].dim)
            assert part.shape == params[name].shape, (name, part.shape)
            params[name].copy_(part.to(params[name].dtype))


def released_experts(w13: torch.Tensor, w2: torch.Tensor, mlp: str) -> dict[str, torch.Tensor]:
    """One layer's experts (all of them) in the released per-expert layout."""
    out = {}
    for j in range(w13.shape[0]):
        gate, up = w13[j].chunk(2)
        out[f"{mlp}experts.{j}.gate_proj.weight"] = gate
        out[f"{mlp}experts.{j}.up_proj.weight"] = up
        out[f"{mlp}experts.{j}.down_proj.weight"] = w2[j]
    return out


def fused_experts(w13: torch.Tensor, w2: torch.Tensor, mlp: str) -> dict[str, torch.Tensor]:
    """One layer's experts in transformers 5.x's fused layout (what ``save_pretrained`` writes
    for Qwen3-VL-MoE)."""
    return {f"{mlp}experts.gate_up_proj": w13, f"{mlp}experts.down_proj": w2}


@torch.no_grad()
def export_moe(model: nn.Module, state: ParallelState, out_dir: str | Path, hf_dict: dict,
               cfg, maps: list[dict[str, list[Piece]]],
               experts: Callable[[torch.Tensor, torch.Tensor, str], dict], ours: str = "",
               hf: str = "model.", progress: Callable[[int, int], None] | None = None,
               extra: Sequence[tuple[str, str]] = ()) -> None:
    """``config.json`` (``hf_dict``) + ``model.safetensors`` in ``out_dir`` through
    ``hf_io.write_hf``: the tp group of rank 0 gathers every parameter but the experts
    (``maps[r]``: tp rank r's shard map), the ep group of rank 0 the experts of decoder
    ``cfg`` and of ``extra`` (names as in ``load_moe_weights``), written by ``experts(w13 [E, 2I, H],
    w2 [E, H, I], mlp prefix)``. Collective over the world; a barrier at the end."""
    params = dict(model.named_parameters())

    def gathered_experts() -> dict[str, torch.Tensor]:
        full = {}
        if state.tp_rank == 0 and state.edp_rank == 0:
            for ff, mlp in expert_layers(cfg, ours, hf, extra):
                w13, w2 = (all_gather(params[ff + "experts." + w].detach(), 0,
                                      state.ep_group).cpu() for w in ("w13", "w2"))
                full.update(experts(w13, w2, mlp))
        return full

    write_hf(model, state, out_dir, hf_dict, maps, progress,
             local={n: p for n, p in params.items() if not is_expert_param(n)},
             extra=gathered_experts)
