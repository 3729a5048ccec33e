"""Qwen3-MoE Hugging Face checkpoints <-> the model's shards, in both expert layouts (the
qwen3_moe family's, and the text half of qwen3_vl_moe's).

The decoder's names (``decoder_hf.shard_map``) with each sparse layer's MLP the router and
experts of ``mpcore.models.common.moe_hf`` (both expert layouts load; ep rank r reads only its
experts). Export writes the released per-expert layout (transformers 5.x loads it and fuses on
load) through the common writer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from mpcore.models.common.decoder_hf import shard_map as decoder_shard_map
from mpcore.models.common.hf_io import Piece
from mpcore.models.common.moe_config import Qwen3MoeConfig, config_from_hf, hf_config_dict
from mpcore.models.common.moe_decoder import Qwen3MoeTransformer
from mpcore.models.common.moe_hf import (
    expert_pieces,
    export_moe,
    load_moe_weights,
    released_experts,
)
from mpcore.parallel.state import ParallelState


def shard_map(cfg: Qwen3MoeConfig, tp: int, rank: int, prefix: str = "model."
              ) -> dict[str, list[Piece]]:
    """Our name -> the HF pieces of tp rank ``rank`` (experts: fused names, all E)."""
    out = decoder_shard_map(cfg, tp, rank, prefix)
    for i in cfg.moe_layers:
        expert_pieces(out, cfg, f"layers.{i}.feed_forward.", f"{prefix}layers.{i}.mlp.")
    return out


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


def export_hf(model: Qwen3MoeTransformer, state: ParallelState, out_dir: str | Path,
              progress: Callable[[int, int], None] | None = None) -> None:
    """``config.json`` + ``model.safetensors`` (released expert layout) in ``out_dir``.
    Collective over the world (module docstring); a barrier at the end."""
    cfg = model.cfg
    export_moe(model, state, out_dir, hf_config_dict(cfg), cfg,
               [shard_map(cfg, state.tp, r) for r in range(state.tp)], released_experts,
               progress=progress)
