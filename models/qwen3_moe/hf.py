"""Qwen3-MoE Hugging Face checkpoints <-> the model's shards, in both expert layouts.

Names (``prefix`` = ``model.layers.i.mlp.``), beside the decoder's (``decoder_hf.shard_map``):

    feed_forward.gate.weight     [E, hidden]        {prefix}gate.weight (the router, whole)
    feed_forward.experts.w13     [E/ep, 2I, hidden] released: experts.{e}.gate_proj ; up_proj
                                                    5.x fused: experts.gate_up_proj [E, 2I, H]
    feed_forward.experts.w2      [E/ep, hidden, I]  released: experts.{e}.down_proj
                                                    5.x fused: experts.down_proj [E, H, I]

Released checkpoints (Qwen/Qwen3-30B-A3B) store one tensor per expert, transformers 5.x holds
them fused; loading takes either (found per layer by name) and ep rank r reads only its
experts ``[r E / ep, (r + 1) E / ep)``. ``shard_map`` (the logical form every tool reads) gives
the fused names at ep = 1. Export writes the released layout (transformers 5.x loads it and
fuses on load): the tp group of rank 0 gathers the dense tensors, the ep group of rank 0 the
experts; rank 0 writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save
from torch import nn

from mpcore import atomic
from mpcore.models.common.decoder_hf import shard_map as decoder_shard_map
from mpcore.models.common.hf_io import Checkpoint, Piece, gather_full, whole
from mpcore.models.qwen3_moe.config import Qwen3MoeConfig, config_from_hf, hf_config_dict
from mpcore.models.qwen3_moe.model import Qwen3MoeTransformer, is_expert_param
from mpcore.parallel.collectives import all_gather
from mpcore.parallel.state import ParallelState


def shard_map(cfg: Qwen3MoeConfig, tp: int, rank: int, prefix: str = "model."
              ) -> dict[str, list[Piece]]:
    """Our name -> the HF pieces of tp rank ``rank`` (experts: fused names, all E)."""
    out = decoder_shard_map(cfg, tp, rank, prefix)
    h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    for i in cfg.moe_layers:
        ours, mlp = f"layers.{i}.feed_forward.", f"{prefix}layers.{i}.mlp."
        del out[ours + "w13.weight"], out[ours + "w2.weight"]
        out[ours + "gate.weight"] = whole(mlp + "gate.weight", (e, h))
        out[ours + "experts.w13"] = whole(mlp + "experts.gate_up_proj", (e, 2 * inter, h))
        out[ours + "experts.w2"] = whole(mlp + "experts.down_proj", (e, h, inter))
    return out


def _read_experts(ckpt: Checkpoint, cfg: Qwen3MoeConfig, mlp: str, first: int, count: int
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


@torch.no_grad()
def load_moe_weights(model: nn.Module, folder: str | Path, state: ParallelState,
                     cfg: Qwen3MoeConfig, table: dict[str, list[Piece]], ours: str = "",
                     hf: str = "model.") -> None:
    """Fill this rank's shards of ``model``: the experts of decoder ``cfg``'s sparse layers
    (our ``{ours}layers.i.feed_forward.experts.*``, HF ``{hf}layers.i.mlp.experts*``) with
    this ep rank's experts, every other parameter with its tp pieces of ``table``."""
    ckpt = Checkpoint(Path(folder))
    params = dict(model.named_parameters())
    assert set(params) == set(table), sorted(set(params) ^ set(table))
    local = cfg.num_experts // state.ep
    for i in cfg.moe_layers:
        name = f"{ours}layers.{i}.feed_forward.experts."
        w13, w2 = _read_experts(ckpt, cfg, f"{hf}layers.{i}.mlp.", state.ep_rank * local,
                                local)
        params[name + "w13"].copy_(w13.to(params[name + "w13"].dtype))
        params[name + "w2"].copy_(w2.to(params[name + "w2"].dtype))
    for name, pieces in table.items():
        if not is_expert_param(name):
            part = torch.cat([ckpt.read(p) for p in pieces], dim=pieces[0].dim)
            assert part.shape == params[name].shape, (name, part.shape)
            params[name].copy_(part.to(params[name].dtype))


def load_hf_weights(model: Qwen3MoeTransformer, folder: str | Path,
                    state: ParallelState) -> None:
    """Fill this rank's shards (tp for the decoder, ep for the experts) from the checkpoint."""
    load_moe_weights(model, folder, state, model.cfg,
                     shard_map(model.cfg, state.tp, state.tp_rank))


def load_hf_model(folder: str | Path, state: ParallelState, *, device="cpu",
                  dtype: torch.dtype = torch.float32, fp8: str = "none", **kwargs
                  ) -> tuple[Qwen3MoeTransformer, Qwen3MoeConfig]:
    """The model of a checkpoint folder for ``state`` with its shards loaded: ``(model, cfg)``;
    ``kwargs``: ``Transformer``'s (cp_mode, attention_backend, ...)."""
    cfg = config_from_hf(folder)
    with torch.device("meta"):
        model = Qwen3MoeTransformer(cfg, state, fp8=fp8, dtype=dtype, **kwargs)
    model.to_empty(device=device)
    model.rope.reset_parameters()
    load_hf_weights(model, folder, state)
    return model, cfg


def released_experts(w13: torch.Tensor, w2: torch.Tensor, mlp: str) -> dict[str, torch.Tensor]:
    """One layer's experts (all of them) in the released per-expert layout."""
    out = {}
    for j in range(w13.shape[0]):
        gate, up = w13[j].chunk(2)
        out[f"{mlp}experts.{j}.gate_proj.weight"] = gate
        out[f"{mlp}experts.{j}.up_proj.weight"] = up
        out[f"{mlp}experts.{j}.down_proj.weight"] = w2[j]
    return out


@torch.no_grad()
def export_moe(model: nn.Module, state: ParallelState, out_dir: str | Path, hf_dict: dict,
               cfg: Qwen3MoeConfig, maps: list[dict[str, list[Piece]]],
               experts: Callable[[torch.Tensor, torch.Tensor, str], dict], ours: str = "",
               hf: str = "model.", progress: Callable[[int, int], None] | None = None) -> None:
    """``config.json`` (``hf_dict``) + ``model.safetensors`` in ``out_dir``: the tp group of
    rank 0 gathers every parameter but the experts (``maps[r]``: tp rank r's shard map), the
    ep group of rank 0 the experts of decoder ``cfg`` (names as in ``load_moe_weights``),
    written by ``experts(w13 [E, 2I, H], w2 [E, H, I], mlp prefix)``; rank 0 writes.
    Collective over the world; a barrier at the end."""
    params = dict(model.named_parameters())
    dense = {n: p for n, p in params.items() if not is_expert_param(n)}
    full = {}
    if state.cp_rank == 0 and state.dp_rank == 0:
        full = gather_full(dense, maps, state.tp_group, progress)
    if state.tp_rank == 0 and state.edp_rank == 0:
        for i in cfg.moe_layers:
            name = f"{ours}layers.{i}.feed_forward.experts."
            w13, w2 = (all_gather(params[name + w].detach(), 0, state.ep_group).cpu()
                       for w in ("w13", "w2"))
            full.update(experts(w13, w2, f"{hf}layers.{i}.mlp."))
    if state.rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic.write_text(out / "config.json", json.dumps(hf_dict, indent=2) + "\n")
        atomic.write_bytes(out / "model.safetensors", save(
            {k: v.contiguous() for k, v in full.items()}, metadata={"format": "pt"}))
    if dist.is_initialized():
        dist.barrier()


def export_hf(model: Qwen3MoeTransformer, state: ParallelState, out_dir: str | Path,
              progress: Callable[[int, int], None] | None = None) -> None:
    """``config.json`` + ``model.safetensors`` (released expert layout) in ``out_dir``.
    Collective over the world (module docstring); a barrier at the end."""
    cfg = model.cfg
    export_moe(model, state, out_dir, hf_config_dict(cfg), cfg,
               [shard_map(cfg, state.tp, r) for r in range(state.tp)], released_experts,
               progress=progress)
