"""Hugging Face safetensors tensors <-> tensor-parallel shards of ``VisionTower``.

One table, :func:`vision_shard_map`, says for every local parameter of tp rank r which pieces
of which HF tensors (hub layout, as ``save_pretrained`` writes it, under ``prefix``) it holds,
concatenated along the pieces' dim (``mpcore.models.common.hf_io.Piece``):

    patch_embed.weight                  patch_embed.proj.weight  (whole, Conv3d layout)
    layers.i.attention_norm.*           blocks.i.norm1.{weight,bias}  (bias: qwen2_vl only)
    layers.i.ffn_norm.*                 blocks.i.norm2.{weight,bias}
    layers.i.attention.wqkv.{w,b}       blocks.i.attn.qkv rows q_r ; k_r ; v_r (one tensor)
    layers.i.attention.wo.weight        blocks.i.attn.proj.weight columns r; .bias whole
    layers.i.feed_forward.w1.{w,b}      blocks.i.mlp.fc1 rows r                  (qwen2_vl)
    layers.i.feed_forward.w13.{w,b}     blocks.i.mlp.gate_proj rows r ; up_proj rows r (2.5)
    layers.i.feed_forward.w2.weight     blocks.i.mlp.fc2 / down_proj .weight columns r; .bias whole
    merger.norm.*                       merger.ln_q.{weight,bias}  (bias: qwen2_vl only)
    merger.w1.{weight,bias}             merger.mlp.0 rows r
    merger.w2.weight                    merger.mlp.2.weight columns r; .bias whole

Loading reads only this rank's slices (``mpcore.models.common.hf_io.Checkpoint``). Export runs the table
backwards: the tp group all-gathers each sharded tensor and every rank of it gets the full HF
tensors (the VL export merges them with the language model's).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mpcore.models.common.hf_io import (
    Checkpoint,
    Piece,
    column_linear,
    fill_from_table,
    gather_full,
    part_rows,
    row_linear,
    whole,
)
from mpcore.models.qwen2_vl.tower import VisionTower
from mpcore.models.qwen2_vl.vision_config import VisionConfig
from mpcore.parallel.state import ParallelState, ProcessGroup, group_size


def _norm(out: dict, cfg: VisionConfig, ours: str, hf: str) -> None:
    kinds = ("weight", "bias") if cfg.arch == "qwen2_vl" else ("weight",)
    for kind in kinds:
        out[f"{ours}.{kind}"] = whole(f"{hf}.{kind}", (cfg.hidden_size,))


def vision_shard_map(cfg: VisionConfig, tp: int, rank: int,
                     prefix: str = "visual.") -> dict[str, list[Piece]]:
    """Our parameter name -> the HF pieces of tp rank ``rank``'s shard (module docstring)."""
    cfg.check_parallel(tp)
    hid, inter, width = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit
    out = {"patch_embed.weight": whole(
        prefix + "patch_embed.proj.weight",
        (hid, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size))}
    for i in range(cfg.depth):
        ours, hf = f"layers.{i}.", f"{prefix}blocks.{i}."
        _norm(out, cfg, ours + "attention_norm", hf + "norm1")
        _norm(out, cfg, ours + "ffn_norm", hf + "norm2")
        for kind in ("weight", "bias"):
            shape = (3 * hid, hid) if kind == "weight" else (3 * hid,)
            out[f"{ours}attention.wqkv.{kind}"] = [
                part_rows(f"{hf}attn.qkv.{kind}", shape, tp, rank, part, 3) for part in range(3)]
        row_linear(out, ours + "attention.wo", hf + "attn.proj", hid, hid, tp, rank)
        if cfg.arch == "qwen2_vl":
            column_linear(out, ours + "feed_forward.w1", [hf + "mlp.fc1"], hid, inter, tp, rank)
            row_linear(out, ours + "feed_forward.w2", hf + "mlp.fc2", inter, hid, tp, rank)
        else:
            column_linear(out, ours + "feed_forward.w13", [hf + "mlp.gate_proj", hf + "mlp.up_proj"],
                    hid, inter, tp, rank)
            row_linear(out, ours + "feed_forward.w2", hf + "mlp.down_proj", inter, hid, tp, rank)
    _norm(out, cfg, "merger.norm", prefix + "merger.ln_q")
    column_linear(out, "merger.w1", [prefix + "merger.mlp.0"], width, width, tp, rank)
    row_linear(out, "merger.w2", prefix + "merger.mlp.2", width, cfg.out_hidden_size, tp, rank)
    return out


def shard_from_full(full: dict[str, torch.Tensor], pieces: list[Piece]) -> torch.Tensor:
    """This rank's shard of full HF tensors ``full`` (by HF name): the pieces concatenated."""
    return torch.cat([full[p.name].narrow(p.dim, p.start, p.stop - p.start) for p in pieces],
                     dim=pieces[0].dim)


def _check_state(tower: VisionTower, state: ParallelState | ProcessGroup | None) -> None:
    tp = state.tp if isinstance(state, ParallelState) else group_size(state)
    if state is not None and tp != tower.tp:
        raise ValueError(f"the tower was built for tp = {tower.tp} but state has tp = {tp}; "
                         f"pass the state (or tp group) the tower was built with")


@torch.no_grad()
def load_vision_weights(tower: VisionTower, source: str | Path | Checkpoint,
                        state: ParallelState | ProcessGroup | None = None, *,
                        prefix: str = "visual.") -> None:
    """Fill every parameter of ``tower`` with this tp rank's shard of the checkpoint's tensors.

    ``source``: a checkpoint folder (``model.safetensors`` or a sharded index) or an open
    ``mpcore.models.common.hf_io.Checkpoint`` shared with the language model's loader. The tp group and rank
    are the tower's own; ``state``, when given, must agree with them. Reads only this rank's
    slices. Raises ``ValueError`` naming a missing tensor or a tensor whose shape disagrees with
    the config, before copying it.
    """
    _check_state(tower, state)
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(Path(source))
    fill_from_table(tower, ckpt, vision_shard_map(tower.cfg, tower.tp, tower.tp_rank, prefix))


def load_vision_tower(source: str | Path | Checkpoint, cfg: VisionConfig,
                      state: ParallelState | ProcessGroup | None = None, *,
                      prefix: str = "visual.", device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32,
                      activation_checkpointing: bool = False) -> VisionTower:
    """Build the tower of ``cfg`` for ``state`` on the meta device, materialise it on
    ``device`` in ``dtype`` and load this rank's shards from ``source`` (nothing is drawn)."""
    with torch.device("meta"):
        tower = VisionTower(cfg, state, activation_checkpointing=activation_checkpointing,
                            dtype=dtype)
    tower.to_empty(device=device)
    load_vision_weights(tower, source, state, prefix=prefix)
    return tower


@torch.no_grad()
def vision_hf_tensors(local: dict[str, torch.Tensor], cfg: VisionConfig,
                      tp_group: ProcessGroup | None,
                      prefix: str = "visual.") -> dict[str, torch.Tensor]:
    """Full HF tensors (CPU, by HF name) from this rank's local tensors by our parameter name
    (the parameters, or their gradients).

    Collective over ``tp_group``: every rank of it calls this with its own shards and gets the
    full tensors. Replicated tensors are not gathered.
    """
    tp = group_size(tp_group)
    maps = [vision_shard_map(cfg, tp, rank, prefix) for rank in range(tp)]
    return gather_full({name: local[name] for name in maps[0]}, maps, tp_group)


def export_vision_weights(tower: VisionTower,
                          prefix: str = "visual.") -> dict[str, torch.Tensor]:
    """``{hf_name: full tensor}`` (CPU) of the tower's weights, for ``save_file`` next to the
    language model's. Collective over the tower's tp group: call it on every rank of it."""
    return vision_hf_tensors(dict(tower.named_parameters()), tower.cfg, tower.tp_group, prefix)
