"""Hugging Face ``Qwen3_5ForConditionalGeneration`` checkpoints <-> shards of ``Qwen35VLModel``.

Key layout (the released checkpoints' and transformers' ``save_pretrained``):
``model.language_model.*`` (the Qwen3.5 decoder, ``mpcore.models.common.hybrid.hf.shard_map`` under that
prefix: ``linear_attn.*``, ``self_attn.q_proj`` with query and gate rows per head),
``lm_head.weight`` (untied only) and ``model.visual.*`` (Qwen3-VL's tower keys,
``mpcore.models.common.qwen3_vl.hf.vision_shard_map``, without ``deepstack_merger_list``). Tensors the model
does not use (multi-token prediction ``mtp.*`` of the released checkpoints, unless the model
trains it: ``load_hf_model(..., mtp_loss_weight > 0)``) are skipped with one log line. Each rank reads only its slices (``mpcore.models.common.hf_io.Checkpoint``); export gathers
every parameter over the tp group of global rank 0, which writes ``config.json`` (5.x form) and
``model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.hf_io import Checkpoint, Piece, export_by_table, fill_from_table
from mpcore.models.common.hybrid.hf import full_map, log_unused, with_mtp_weight
from mpcore.models.common.hybrid.vl_config import Qwen35VLConfig, config_from_hf, hf_config_dict
from mpcore.models.common.hybrid.vl_model import Qwen35VLModel, make_model
from mpcore.models.common.qwen3_vl.hf import TEXT_PREFIX, vision_shard_map
from mpcore.parallel.state import ParallelState


def shard_map(cfg: Qwen35VLConfig, tp: int, rank: int, text_map=full_map
              ) -> dict[str, list[Piece]]:
    """Our ``Qwen35VLModel`` parameter name -> the HF pieces of tp rank ``rank``'s shard;
    ``text_map``: the text family's shard map with its ``mtp.*`` block when trained (the MoE
    family passes its own). The MTP block is ours ``text.mtp.*``, the release's top-level
    ``mtp.*``."""
    out = {f"text.{k}": v for k, v in text_map(cfg.text, tp, rank, TEXT_PREFIX).items()}
    out.update({f"visual.{k}": v for k, v in vision_shard_map(cfg.vision, tp, rank).items()})
    return out


def load_hf_model(folder: str | Path, state: ParallelState, *, mtp_loss_weight: float = 0.0,
                  **options) -> tuple[Qwen35VLModel, Qwen35VLConfig]:
    """Build the ``Qwen35VLModel`` of a checkpoint folder for ``state`` and load this rank's
    shards (``build_model``'s keyword arguments, no seed). ``mtp_loss_weight > 0`` builds and
    reads the ``mtp.*`` block. Returns ``(model, cfg)``; another family's checkpoint, a
    missing tensor or a shape that disagrees with the config raise ``ValueError``."""
    cfg = with_mtp_weight(config_from_hf(folder), mtp_loss_weight, folder)
    device = options.pop("device", "cpu")
    model = make_model(cfg, state, device=device, **options)
    model.to_empty(device=device)
    init_weights(model, 0)  # buffers (rotary tables); every parameter is overwritten below
    ckpt = Checkpoint(Path(folder))
    table = shard_map(cfg, state.tp, state.tp_rank)
    with torch.no_grad():
        fill_from_table(model, ckpt, table)
    log_unused(ckpt, table, "vision-language model")
    return model, cfg


@torch.no_grad()
def export_hf(model: Qwen35VLModel, state: ParallelState, out_dir: str | Path,
              progress=None) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` to ``out_dir`` (the layout
    transformers loads as ``Qwen3_5ForConditionalGeneration``). Collective over the world: call
    it on every rank. ``progress(done, total)`` is called after each parameter is gathered."""
    export_by_table(model, state, out_dir, hf_config_dict, shard_map, progress)
