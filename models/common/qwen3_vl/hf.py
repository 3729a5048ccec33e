"""Hugging Face Qwen3-VL checkpoints <-> tensor-parallel shards of ``Qwen3VLModel``.

Key layout (what transformers' ``save_pretrained`` writes and the hub holds):
``model.language_model.*`` (the decoder's keys of ``mpcore.models.common.decoder_hf.shard_map`` under
that prefix), ``lm_head.weight`` (untied only), and ``model.visual.*``:

    patch_embed.{weight,bias}          patch_embed.proj.{weight,bias}  (Conv3d layout)
    pos_embed.weight                   pos_embed.weight
    layers.i.attention_norm / ffn_norm blocks.i.norm1 / norm2  (LayerNorm weight, bias)
    layers.i.attention.wqkv            blocks.i.attn.qkv: rows of q_r ; k_r ; v_r
    layers.i.attention.wo              blocks.i.attn.proj: columns r; bias whole
    layers.i.feed_forward.w1 / w2      blocks.i.mlp.linear_fc1 rows r / linear_fc2 columns r
    merger.norm, .w1, .w2              merger.norm, .linear_fc1, .linear_fc2
    deepstack_mergers.k.*              deepstack_merger_list.k.*

Each rank reads only its slices (``mpcore.models.common.hf_io.Checkpoint``); export gathers every
parameter over the tp group of global rank 0, which writes ``config.json`` (5.x form) and
``model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.decoder_hf import shard_map as text_shard_map
from mpcore.models.common.hf_io import (
    Checkpoint,
    Piece,
    column_linear,
    export_by_table,
    fill_from_table,
    part_rows,
    row_linear,
    whole,
)
from mpcore.models.common.qwen3_vl.config import (
    Qwen3VisionConfig,
    Qwen3VLConfig,
    config_from_hf,
    hf_config_dict,
)
from mpcore.models.common.qwen3_vl.model import Qwen3VLModel
from mpcore.parallel.state import ParallelState

TEXT_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."


def _layer_norm(out: dict, ours: str, hf: str, width: int) -> None:
    for kind in ("weight", "bias"):
        out[f"{ours}.{kind}"] = whole(f"{hf}.{kind}", (width,))


def _merger(out: dict, cfg: Qwen3VisionConfig, ours: str, hf: str, post_shuffle: bool,
            tp: int, rank: int) -> None:
    width = cfg.hidden_size * cfg.merge_unit
    _layer_norm(out, ours + "norm", hf + "norm", width if post_shuffle else cfg.hidden_size)
    column_linear(out, ours + "w1", [hf + "linear_fc1"], width, width, tp, rank)
    row_linear(out, ours + "w2", hf + "linear_fc2", width, cfg.out_hidden_size, tp, rank)


def vision_shard_map(cfg: Qwen3VisionConfig, tp: int, rank: int,
                     prefix: str = VISION_PREFIX) -> dict[str, list[Piece]]:
    """Our tower parameter name -> the HF pieces of tp rank ``rank``'s shard."""
    cfg.check_parallel(tp)
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    conv = (hid, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
    out = {"patch_embed.weight": whole(prefix + "patch_embed.proj.weight", conv),
           "patch_embed.bias": whole(prefix + "patch_embed.proj.bias", (hid,)),
           "pos_embed.weight": whole(prefix + "pos_embed.weight",
                                      (cfg.num_position_embeddings, hid))}
    for i in range(cfg.depth):
        ours, hf = f"layers.{i}.", f"{prefix}blocks.{i}."
        _layer_norm(out, ours + "attention_norm", hf + "norm1", hid)
        _layer_norm(out, ours + "ffn_norm", hf + "norm2", hid)
        for kind in ("weight", "bias"):
            shape = (3 * hid, hid) if kind == "weight" else (3 * hid,)
            out[f"{ours}attention.wqkv.{kind}"] = [
                part_rows(f"{hf}attn.qkv.{kind}", shape, tp, rank, part, 3) for part in range(3)]
        row_linear(out, ours + "attention.wo", hf + "attn.proj", hid, hid, tp, rank)
        column_linear(out, ours + "feed_forward.w1", [hf + "mlp.linear_fc1"], hid, inter, tp, rank)
        row_linear(out, ours + "feed_forward.w2", hf + "mlp.linear_fc2", inter, hid, tp, rank)
    _merger(out, cfg, "merger.", prefix + "merger.", False, tp, rank)
    for k in range(len(cfg.deepstack_visual_indexes)):
        _merger(out, cfg, f"deepstack_mergers.{k}.", f"{prefix}deepstack_merger_list.{k}.",
                True, tp, rank)
    return out


def shard_map(cfg: Qwen3VLConfig, tp: int, rank: int) -> dict[str, list[Piece]]:
    """Our ``Qwen3VLModel`` parameter name -> the HF pieces of tp rank ``rank``'s shard."""
    out = {f"text.{k}": v for k, v in text_shard_map(cfg.text, tp, rank, TEXT_PREFIX).items()}
    out.update({f"visual.{k}": v for k, v in vision_shard_map(cfg.vision, tp, rank).items()})
    return out


@torch.no_grad()
def load_hf_weights(model: Qwen3VLModel, folder: str | Path, state: ParallelState) -> None:
    """Fill every parameter of ``model`` with this tp rank's shard of the checkpoint's tensors
    (``ValueError`` naming a missing tensor or a shape that disagrees with the config)."""
    fill_from_table(model, Checkpoint(Path(folder)),
                    shard_map(model.cfg, state.tp, state.tp_rank))


def load_hf_model(folder: str | Path, state: ParallelState, *,
                  sequence_parallel: bool = False, cp_mode: str = "none",
                  activation_checkpointing: bool = False, vision_cp: str = "split",
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  **decoder_options) -> tuple[Qwen3VLModel, Qwen3VLConfig]:
    """Build the ``Qwen3VLModel`` of a checkpoint folder for ``state`` and load this rank's
    shards. Returns ``(model, cfg)``; another family's checkpoint raises ``ValueError``."""
    cfg = config_from_hf(folder)
    with torch.device("meta"):
        model = Qwen3VLModel(cfg, state, sequence_parallel=sequence_parallel, cp_mode=cp_mode,
                             activation_checkpointing=activation_checkpointing,
                             vision_cp=vision_cp, dtype=dtype, **decoder_options)
    model.to_empty(device=device)
    init_weights(model, 0)  # buffers (rotary tables); every parameter is overwritten below
    load_hf_weights(model, folder, state)
    return model, cfg


@torch.no_grad()
def export_hf(model: Qwen3VLModel, state: ParallelState, out_dir: str | Path,
              progress=None) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` to ``out_dir`` (the layout
    transformers loads). Collective over the world: call it on every rank.
    ``progress(done, total)`` is called after each parameter is gathered."""
    export_by_table(model, state, out_dir, hf_config_dict, shard_map, progress)
