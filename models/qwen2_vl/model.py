"""Qwen2-VL / Qwen2.5-VL: the shared vision-language model (``mpcore.models.common.vl_model``) over
this family's tower (``mpcore.models.qwen2_vl.tower``) and the plain decoder block; the per-token
inputs come from ``mpcore.models.qwen2_vl.inputs.vl_inputs``."""

from __future__ import annotations

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.vl_model import VisionLanguageModel
from mpcore.models.qwen2_vl.config import VLConfig
from mpcore.models.qwen2_vl.tower import VisionTower
from mpcore.parallel.state import ParallelState


class VLModel(VisionLanguageModel):
    """Qwen2-VL / Qwen2.5-VL (module docstring). Build it with :func:`build_vl_model`."""

    tower_cls = VisionTower


def build_vl_model(cfg: VLConfig, state: ParallelState, *, sequence_parallel: bool = False,
                   cp_mode: str = "none", activation_checkpointing: bool = False,
                   vision_cp: str = "split", device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0,
                   **decoder_options) -> VLModel:
    """Create the model on the meta device, materialise this rank's shards on ``device`` and
    initialise them (the same function at any tp degree for a given ``seed``).
    ``decoder_options``: further keyword arguments of ``Transformer`` (kernel choices)."""
    with torch.device("meta"):
        model = VLModel(cfg, state, sequence_parallel=sequence_parallel, cp_mode=cp_mode,
                        activation_checkpointing=activation_checkpointing, vision_cp=vision_cp,
                        dtype=dtype, **decoder_options)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model
