"""Llama 3 / Qwen2 / Qwen3 causal LMs: Hugging Face checkpoint folders <-> the decoder's shards.

The decoder is ``mpcore.models.common.decoder.Transformer``; its tensor names are the hub layout of
``mpcore.models.common.decoder_hf.shard_map`` (``model.*``, ``lm_head``), its ``config.json`` is read and
written by ``mpcore.models.common.hf_config``. Each rank reads only its slices; export gathers over the
tp group of global rank 0, which writes ``config.json`` + ``model.safetensors``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from mpcore.kernels.fp8_linear import check_fp8
from mpcore.models.common.config import ModelConfig
from mpcore.models.common.decoder import Transformer
from mpcore.models.common.decoder_hf import shard_map
from mpcore.models.common.hf_config import config_from_hf, hf_config_dict
from mpcore.models.common.hf_io import Checkpoint, export_by_table, fill_from_table
from mpcore.parallel.state import ParallelState


@torch.no_grad()
def load_hf_weights(model: Transformer, folder: str | Path, state: ParallelState) -> None:
    """Fill every parameter of ``model`` with this tp rank's shard of the checkpoint's tensors.

    Raises ``ValueError`` naming a missing tensor, or a tensor whose shape disagrees with the
    model's config (both shapes in the message), before copying it.
    """
    fill_from_table(model, Checkpoint(Path(folder)),
                    shard_map(model.cfg, state.tp, state.tp_rank))


def load_hf_model(folder: str | Path, state: ParallelState, *, sequence_parallel: bool = False,
                  cp_mode: str = "none", activation_checkpointing: bool = False,
                  attention_backend: str = "auto", fp8: str = "none",
                  device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[Transformer, ModelConfig]:
    """Build the model of a Hugging Face checkpoint folder for ``state`` and load its shards.

    Same keyword arguments as ``build_model`` (no seed: nothing is drawn). Returns
    ``(model, cfg)``.
    """
    check_fp8(fp8, device)
    cfg = config_from_hf(folder)
    with torch.device("meta"):
        model = Transformer(cfg, state, sequence_parallel=sequence_parallel, cp_mode=cp_mode,
                            activation_checkpointing=activation_checkpointing,
                            attention_backend=attention_backend, fp8=fp8, dtype=dtype)
    model.to_empty(device=device)
    model.rope.reset_parameters()
    load_hf_weights(model, folder, state)
    return model, cfg


@torch.no_grad()
def export_hf(model: Transformer, cfg: ModelConfig, state: ParallelState,
              out_dir: str | Path, progress: Callable[[int, int], None] | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` to ``out_dir`` (HF format).

    Collective over the world: call it on every rank. Only the tp group of global rank 0
    gathers (over ``state.tp_group``); rank 0 writes; a barrier then lets every rank read it.
    ``progress(done, total)`` is called after each parameter is gathered.
    """
    export_by_table(model, state, out_dir, hf_config_dict, shard_map, progress, cfg)


