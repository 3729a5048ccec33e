"""Parameter and FLOP counts of the Qwen3.5 vision-language model: the hybrid decoder's
(``mpcore.models.common.hybrid.counts``) plus the tower's parameters."""

from __future__ import annotations

import torch

from mpcore.models.common.hybrid import counts as text_counts
from mpcore.models.common.hybrid.vl_config import Qwen35VLConfig
from mpcore.models.common.qwen3_vl.vision import Qwen3VisionTower


def tower_params(cfg: Qwen35VLConfig) -> int:
    """The tower's parameters, its merger included (counted on the meta device)."""
    with torch.device("meta"):
        tower = Qwen3VisionTower(cfg.vision)
    return sum(p.numel() for p in tower.parameters())


def num_params(cfg: Qwen35VLConfig) -> dict[str, int]:
    """Logical parameter counts: the decoder's (``mpcore.models.common.hybrid.counts``) plus ``vision``
    (the tower with its merger), included in ``total``."""
    vision = tower_params(cfg)
    text = text_counts.num_params(cfg.text)
    return {**text, "total": text["total"] + vision, "vision": vision}


def flops_per_token(cfg: Qwen35VLConfig, seq_len: int) -> float:
    """The decoder's training FLOPs per token (``mpcore.models.common.hybrid.counts``); the tower's work
    depends on each batch's share of visual tokens and is left out (TFLOP/s and MFU are lower
    bounds, as for the other VL families)."""
    return text_counts.flops_per_token(cfg.text, seq_len)
