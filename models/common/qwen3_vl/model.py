"""Qwen3-VL: a vision tower feeding an interleaved M-RoPE Qwen3 decoder, with DeepStack.

Layout, per rank: the L local tokens of this cp rank's share of one packed stream, the per-token
tensors made on the GLOBAL stream by ``mpcore.models.common.qwen3_vl.inputs`` and split together by one
``ContextPlan``: ``input_ids [L]``, ``position_ids [3, L]``, ``labels [L]``, ``vision_rows
[L]`` (tower row of each placeholder, -1 for text). The vision input is the whole micro-batch's
on every cp rank: ``pixel_values [N, patch_dim]``, ``grid_thw [I, 3]`` (images, then videos).

    h = text.tok_embeddings(input_ids)                 # (L or L/tp under SP, hidden)
    rows = visual.rows(pixel_values, grid_thw)         # [R, (1 + K) * hidden], over cp
    main, deep_0 .. deep_K-1 = rows[vision_rows[slots]].split(hidden)
    h[slots] = main                                    # slots: this rank's placeholders
    out = text.decode(h, ..., after_layer)             # after layer k < K: out[slots] += deep_k

The merged rows and the DeepStack features travel as one tensor through
``mpcore.models.common.vision_cp.vision_rows_for_rank``, so they share its guarantees: each cp rank gets
exactly the rows of the placeholders it owns, the gradient of every row is summed over the cp
ranks that used it (the all-gather's backward) and, under sequence parallelism, over the tp
ranks (each adds the rows of its own token slice at ``slots``; the tower is replicated over tp,
so ``copy_to_tp`` sums the row gradients there). A rank without a visual token runs the tower
on a dummy window times zero, adds nothing, and joins every collective.
"""

from __future__ import annotations

import torch

from mpcore.models.common.decoder import init_weights
from mpcore.models.common.qwen3_vl.config import Qwen3VLConfig
from mpcore.models.common.qwen3_vl.vision import Qwen3VisionTower
from mpcore.models.common.vl_model import VisionLanguageModel
from mpcore.parallel.state import ParallelState


class Qwen3VLModel(VisionLanguageModel):
    """The model (module docstring). Build it with :func:`build_model`. The tower's ``rows``
    carry the DeepStack features beside each merged row; ``VisionLanguageModel.forward`` adds
    feature k after decoder layer k."""

    tower_cls = Qwen3VisionTower


def build_model(cfg: Qwen3VLConfig, state: ParallelState, *, sequence_parallel: bool = False,
                cp_mode: str = "none", activation_checkpointing: bool = False,
                vision_cp: str = "split", device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0,
                **decoder_options) -> Qwen3VLModel:
    """Create the model on the meta device, materialise this rank's shards on ``device`` and
    initialise them (the same function at any tp degree for a given ``seed``)."""
    with torch.device("meta"):
        model = Qwen3VLModel(cfg, state, sequence_parallel=sequence_parallel, cp_mode=cp_mode,
                             activation_checkpointing=activation_checkpointing,
                             vision_cp=vision_cp, dtype=dtype, **decoder_options)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model


def num_params(cfg: Qwen3VLConfig, model_cls: type | None = None) -> dict[str, int]:
    """Logical parameter counts: ``total`` (a tied matrix once), ``embedding``, ``head``
    (the embedding when tied) and ``vision`` (tower with its mergers, included in total) of
    ``model_cls`` (default ``Qwen3VLModel``; a variant's model class, e.g. Qwen3-VL-MoE's)."""
    with torch.device("meta"):
        model = (model_cls or Qwen3VLModel)(cfg, ParallelState())  # world of one: logical
    vision = sum(p.numel() for p in model.visual.parameters())
    embedding = model.text.tok_embeddings.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    head = embedding if cfg.text.tie_embeddings else model.text.output.weight.numel()
    return {"total": total, "embedding": embedding, "head": head, "vision": vision}


def flops_per_token(cfg: Qwen3VLConfig, seq_len: int, counts: dict | None = None) -> float:
    """Training FLOPs per token of the decoder (``mpcore.metrics``' convention: 6 per weight
    that multiplies activations, the head included, the input lookup not; plus ``12 * layers *
    heads * head_dim * seq`` of attention). The tower's and DeepStack's work depends on each
    batch's share of visual tokens and is left out (TFLOP/s and MFU are lower bounds).
    ``counts``: ``num_params``' (default: this family's); with ``active`` (a MoE variant: k of
    the E experts of a layer multiply each token) that, not ``total``, is counted."""
    counts = counts or num_params(cfg)
    dense = counts.get("active", counts["total"]) - counts["vision"]
    if not cfg.text.tie_embeddings:
        dense -= counts["embedding"]
    return 6.0 * dense + 12.0 * cfg.text.num_layers * cfg.text.q_size * seq_len
