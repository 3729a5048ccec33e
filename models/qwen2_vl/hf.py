"""Hugging Face Qwen2-VL / Qwen2.5-VL checkpoints <-> tensor-parallel shards of ``VLModel``.

The table of ``mpcore.models.common.decoder_hf.shard_map`` (the decoder, under ``text.``) and of
``mpcore.models.qwen2_vl.vision_hf.vision_shard_map`` (the tower, under ``visual.``) says which slices of which
HF tensors each tp rank holds. HF names are those of the hub layout that ``save_pretrained``
writes: ``model.embed_tokens``, ``model.layers.*``, ``model.norm``, ``lm_head``, ``visual.*``.
Checkpoints saved in transformers' module layout (``model.language_model.*``,
``model.visual.*``) are read too. Each rank reads only its slices; export gathers each parameter
over the tp group of global rank 0, which writes ``config.json`` + ``model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.decoder_hf import shard_map
from mpcore.models.common.hf_io import Checkpoint, Piece, export_by_table, fill_from_table
from mpcore.models.qwen2_vl.config import VLConfig, hf_vl_config_dict, vl_config_from_hf
from mpcore.models.qwen2_vl.model import VLModel
from mpcore.models.qwen2_vl.vision_hf import vision_shard_map
from mpcore.parallel.state import ParallelState

# Hub name prefix -> the same tensor's name in transformers' module layout.
ALIASES = (("model.", "model.language_model."), ("visual.", "model.visual."))


def vl_shard_map(cfg: VLConfig, tp: int, rank: int) -> dict[str, list[Piece]]:
    """Our ``VLModel`` parameter name -> the HF pieces of tp rank ``rank``'s shard."""
    out = {f"text.{k}": v for k, v in shard_map(cfg.text, tp, rank).items()}
    out.update({f"visual.{k}": v for k, v in
                vision_shard_map(cfg.vision, tp, rank, prefix="visual.").items()})
    return out


class _VLCheckpoint(Checkpoint):
    """A checkpoint folder whose tensors may use either name layout (module docstring)."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self._actual: dict[str, str] = {}  # hub name -> name in this checkpoint
        for name in self.files:
            for hub, module in ALIASES:
                if name.startswith(module):
                    self._actual.setdefault(hub + name[len(module):], name)

    def read(self, piece: Piece) -> torch.Tensor:
        if piece.name not in self.files and piece.name in self._actual:
            piece = piece._replace(name=self._actual[piece.name])
        return super().read(piece)


@torch.no_grad()
def load_hf_vl_weights(model: VLModel, folder: str | Path, state: ParallelState) -> None:
    """Fill every parameter of ``model`` with this tp rank's shard of the checkpoint's tensors
    (``ValueError`` naming a missing tensor or a shape that disagrees with the config)."""
    fill_from_table(model, _VLCheckpoint(Path(folder)),
                    vl_shard_map(model.cfg, state.tp, state.tp_rank))


def load_hf_vl_model(folder: str | Path, state: ParallelState, *,
                     sequence_parallel: bool = False, cp_mode: str = "none",
                     activation_checkpointing: bool = False, vision_cp: str = "split",
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     **decoder_options) -> tuple[VLModel, VLConfig]:
    """Build the ``VLModel`` of a Qwen2-VL / Qwen2.5-VL checkpoint folder for ``state`` and
    load its shards (``decoder_options``: further ``Transformer`` keyword arguments). Returns
    ``(model, cfg)``; a decoder-only checkpoint raises ``ValueError``
    saying to use ``mpcore.models.load_hf_model``."""
    cfg = vl_config_from_hf(folder)
    with torch.device("meta"):
        model = VLModel(cfg, state, sequence_parallel=sequence_parallel, cp_mode=cp_mode,
                        activation_checkpointing=activation_checkpointing, vision_cp=vision_cp,
                        dtype=dtype, **decoder_options)
    model.to_empty(device=device)
    init_weights(model, 0)  # buffers (rotary tables); every parameter is overwritten below
    load_hf_vl_weights(model, folder, state)
    return model, cfg


@torch.no_grad()
def export_hf_vl(model: VLModel, state: ParallelState, out_dir: str | Path,
                 progress=None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (hub layout) of ``model`` to ``out_dir``.

    Collective over the world: call it on every rank. Only the tp group of global rank 0
    gathers; rank 0 writes; a barrier then lets every rank read it. ``progress(done, total)``
    is called after each parameter is gathered.
    """
    export_by_table(model, state, out_dir, hf_vl_config_dict, vl_shard_map, progress)
