"""Hugging Face GLM-4V checkpoints <-> tensor-parallel shards of ``Glm4vModel``.

Names are transformers' module layout, which the released GLM-4.1V checkpoints use and 5.x
``save_pretrained`` writes (there is no ``_checkpoint_conversion_mapping`` for glm4v):
``model.language_model.*`` (the decoder), ``model.visual.*`` (the tower), ``lm_head.weight``.
Checkpoints with the older hub prefixes ``model.*`` / ``visual.*`` are read too.

Decoder (``mpcore.models.common.decoder_hf.shard_map`` under ``text.``, with GLM's differences):

    layers.i.attention_norm / attention_out_norm      input_layernorm / post_self_attn_layernorm
    layers.i.ffn_norm / ffn_out_norm                  post_attention_layernorm / post_mlp_layernorm
    layers.i.feed_forward.w13.weight                  mlp.gate_up_proj rows: gate_r, then up_r
                                                      (each half of the fused tensor split over tp)

Tower (under ``visual.``, HF ``model.visual.``): patch_embed.proj.{weight,bias},
post_conv_layernorm, embeddings.position_embedding (whole), blocks.i.{norm1,norm2},
attn.qkv rows q_r; k_r; v_r (bias when attention_bias), attn.proj columns r, mlp gate_r; up_r
and down_proj columns r, post_layernorm, downsample.{weight,bias} (whole), merger.proj (whole),
merger.post_projection_norm.{weight,bias}, merger gate_r; up_r and down_proj columns r.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mpcore.models.common.decoder_hf import shard_map as decoder_shard_map
from mpcore.models.common.hf_io import (
    Checkpoint,
    Piece,
    chunk,
    export_by_table,
    fill_from_table,
    whole,
)
from mpcore.models.glm4v.config import Glm4vConfig, Glm4vVisionConfig, hf_config_dict
from mpcore.parallel.state import ParallelState

TEXT, VISUAL = "model.language_model.", "model.visual."
ALIASES = ((TEXT, "model."), (VISUAL, "visual."))  # module layout name -> older hub name


def _rows(name: str, shape: tuple[int, ...], tp: int, rank: int, part: int = 0,
          parts: int = 1) -> Piece:
    """Rows of tp rank ``rank`` inside part ``part`` of ``parts`` equal row parts."""
    local = shape[0] // parts // tp
    start = part * (shape[0] // parts) + rank * local
    return Piece(name, shape, 0, start, start + local)


def _swiglu(out: dict, ours: str, hf: str, dim: int, inter: int, tp: int, rank: int) -> None:
    out[f"{ours}.w13.weight"] = [_rows(f"{hf}.gate_proj.weight", (inter, dim), tp, rank),
                                 _rows(f"{hf}.up_proj.weight", (inter, dim), tp, rank)]
    out[f"{ours}.w2.weight"] = [chunk(f"{hf}.down_proj.weight", (dim, inter), 1, tp, rank)]


def vision_shard_map(cfg: Glm4vVisionConfig, tp: int, rank: int,
                     prefix: str = VISUAL) -> dict[str, list[Piece]]:
    """Our tower parameter name -> the HF pieces of tp rank ``rank`` (module docstring)."""
    cfg.check_parallel(tp)
    hid, out_dim, m, p = cfg.hidden_size, cfg.out_hidden_size, cfg.spatial_merge_size, prefix
    out = {
        "patch_embed.weight": whole(p + "patch_embed.proj.weight", (
            hid, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)),
        "patch_embed.bias": whole(p + "patch_embed.proj.bias", (hid,)),
        "post_conv_norm.weight": whole(p + "post_conv_layernorm.weight", (hid,)),
        "pos_embed": whole(p + "embeddings.position_embedding.weight",
                           (cfg.grid_side ** 2, hid)),
        "post_norm.weight": whole(p + "post_layernorm.weight", (hid,)),
        "downsample.weight": whole(p + "downsample.weight", (out_dim, hid, m, m)),
        "downsample.bias": whole(p + "downsample.bias", (out_dim,)),
        "merger.proj.weight": whole(p + "merger.proj.weight", (out_dim, out_dim)),
        "merger.norm.weight": whole(p + "merger.post_projection_norm.weight", (out_dim,)),
        "merger.norm.bias": whole(p + "merger.post_projection_norm.bias", (out_dim,)),
    }
    _swiglu(out, "merger.mlp", p + "merger", out_dim, cfg.intermediate_size, tp, rank)
    for i in range(cfg.depth):
        ours, hf = f"layers.{i}.", f"{p}blocks.{i}."
        out[ours + "attention_norm.weight"] = whole(hf + "norm1.weight", (hid,))
        out[ours + "ffn_norm.weight"] = whole(hf + "norm2.weight", (hid,))
        kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
        for kind in kinds:
            shape = (3 * hid, hid) if kind == "weight" else (3 * hid,)
            out[f"{ours}attention.wqkv.{kind}"] = [
                _rows(f"{hf}attn.qkv.{kind}", shape, tp, rank, part, 3) for part in range(3)]
        out[ours + "attention.wo.weight"] = [chunk(hf + "attn.proj.weight", (hid, hid), 1, tp,
                                                   rank)]
        _swiglu(out, ours + "feed_forward", hf + "mlp", hid, out_dim, tp, rank)
    return out


def shard_map(cfg: Glm4vConfig, tp: int, rank: int) -> dict[str, list[Piece]]:
    """Our ``Glm4vModel`` parameter name -> the HF pieces of tp rank ``rank``'s shard."""
    t = cfg.text
    hid, inter = t.hidden_size, t.intermediate_size
    text = decoder_shard_map(t, tp, rank, prefix=TEXT)
    for i in range(t.num_layers):
        ours, hf = f"layers.{i}.", f"{TEXT}layers.{i}."
        text[ours + "attention_out_norm.weight"] = whole(hf + "post_self_attn_layernorm.weight",
                                                         (hid,))
        text[ours + "ffn_out_norm.weight"] = whole(hf + "post_mlp_layernorm.weight", (hid,))
        fused = (hf + "mlp.gate_up_proj.weight", (2 * inter, hid))
        text[ours + "feed_forward.w13.weight"] = [_rows(*fused, tp, rank, part, 2)
                                                  for part in range(2)]
    out = {f"text.{k}": v for k, v in text.items()}
    out.update({f"visual.{k}": v for k, v in vision_shard_map(cfg.vision, tp, rank).items()})
    return out


class _Checkpoint(Checkpoint):
    """A checkpoint folder in the module layout or the older hub one (module docstring)."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self._actual: dict[str, str] = {}  # module-layout name -> name in this checkpoint
        for name in self.files:
            for module, hub in ALIASES:
                if name.startswith(hub) and not name.startswith(module):
                    self._actual.setdefault(module + name[len(hub):], name)

    def read(self, piece: Piece) -> torch.Tensor:
        if piece.name not in self.files and piece.name in self._actual:
            piece = piece._replace(name=self._actual[piece.name])
        return super().read(piece)


@torch.no_grad()
def load_hf_weights(model, folder: str | Path, state: ParallelState) -> None:
    """Fill every parameter of ``model`` with this tp rank's slices of the checkpoint
    (``ValueError`` naming a missing tensor or a shape that disagrees with the config)."""
    fill_from_table(model, _Checkpoint(Path(folder)), shard_map(model.cfg, state.tp,
                                                                state.tp_rank))


@torch.no_grad()
def export_hf(model, state: ParallelState, out_dir: str | Path, progress=None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (module layout) of ``model``.
    Collective over the world: only the tp group of global rank 0 gathers; rank 0 writes."""
    export_by_table(model, state, out_dir, hf_config_dict, shard_map, progress)
