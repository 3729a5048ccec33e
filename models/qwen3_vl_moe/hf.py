"""Hugging Face Qwen3-VL-MoE checkpoints <-> the shards of ``Qwen3VLMoeModel``.

Keys: Qwen3-VL's (``mpcore.models.common.qwen3_vl.hf``: ``model.language_model.*``, ``model.visual.*``,
``lm_head.weight``) with, in each sparse layer (``mlp`` = ``model.language_model.layers.i.mlp.``):

    text.layers.i.feed_forward.gate.weight   [E, hidden]        {mlp}gate.weight (the router)
    text.layers.i.feed_forward.experts.w13   [E/ep, 2I, hidden] {mlp}experts.gate_up_proj
    text.layers.i.feed_forward.experts.w2    [E/ep, hidden, I]  {mlp}experts.down_proj

Released checkpoints store the fused experts as ``gate_up_proj [E, hidden, 2I]`` and
``down_proj [E, I, hidden]``; transformers transposes them on load (its ``conversion_mapping``
for ``qwen3_vl_moe``) to the ``[E, 2I, H]`` / ``[E, H, I]`` it computes with, and its
``save_pretrained`` (5.24) writes the latter. Loading takes both (the stored shapes say which,
``mpcore.models.common.moe_hf``), each ep rank reading only its experts ``[r E / ep, (r + 1) E / ep)``;
export writes what ``save_pretrained`` writes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.hf_io import Piece
from mpcore.models.common.moe_decoder_hf import shard_map as text_shard_map
from mpcore.models.common.moe_hf import export_moe, fused_experts, load_moe_weights
from mpcore.models.common.qwen3_vl.hf import TEXT_PREFIX, vision_shard_map
from mpcore.models.qwen3_vl_moe.config import Qwen3VLMoeConfig, config_from_hf, hf_config_dict
from mpcore.models.qwen3_vl_moe.model import Qwen3VLMoeModel
from mpcore.parallel.state import ParallelState


def shard_map(cfg: Qwen3VLMoeConfig, tp: int, rank: int) -> dict[str, list[Piece]]:
    """Our ``Qwen3VLMoeModel`` parameter name -> the HF pieces of tp rank ``rank``'s shard."""
    text = text_shard_map(cfg.text, tp, rank, TEXT_PREFIX)
    out = {f"text.{k}": v for k, v in text.items()}
    out.update({f"visual.{k}": v for k, v in vision_shard_map(cfg.vision, tp, rank).items()})
    return out


def load_hf_weights(model: Qwen3VLMoeModel, folder: str | Path, state: ParallelState) -> None:
    """Fill this rank's shards (tp pieces; this ep rank's experts) from the checkpoint."""
    cfg = model.cfg
    load_moe_weights(model, folder, state, cfg.text, shard_map(cfg, state.tp, state.tp_rank),
                     ours="text.", hf=TEXT_PREFIX)


def load_hf_model(folder: str | Path, state: ParallelState, *, device="cpu",
                  dtype: torch.dtype = torch.float32, **kwargs
                  ) -> tuple[Qwen3VLMoeModel, Qwen3VLMoeConfig]:
    """The model of a checkpoint folder for ``state`` with its shards loaded: ``(model, cfg)``;
    ``kwargs``: ``Qwen3VLModel``'s (sequence_parallel, cp_mode, vision_cp, ...)."""
    cfg = config_from_hf(folder)
    with torch.device("meta"):
        model = Qwen3VLMoeModel(cfg, state, dtype=dtype, **kwargs)
    model.to_empty(device=device)
    init_weights(model, 0)  # buffers (rotary tables); every parameter is overwritten below
    load_hf_weights(model, folder, state)
    return model, cfg


def export_hf(model: Qwen3VLMoeModel, state: ParallelState, out_dir: str | Path,
              progress=None) -> None:
    """``config.json`` + ``model.safetensors`` (fused experts, as ``save_pretrained``) in
    ``out_dir``.
    Collective over the world; a barrier at the end."""
    cfg = model.cfg
    export_moe(model, state, out_dir, hf_config_dict(cfg), cfg.text,
               [shard_map(cfg, state.tp, r) for r in range(state.tp)], fused_experts,
               ours="text.", hf=TEXT_PREFIX, progress=progress)
