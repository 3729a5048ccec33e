"""Qwen3.5-MoE vision-language (transformers ``Qwen3_5MoeForConditionalGeneration``,
Qwen/Qwen3.5-35B-A3B): the Qwen3.5 VL model (``mpcore.models.qwen3_5_vl``) whose decoder is the
Qwen3.5-MoE one (``mpcore.models.qwen3_5_moe``: every feed-forward a MoE block with a shared expert,
experts split over ep)."""

from mpcore.models.qwen3_5_vl_moe.config import Qwen35VLMoeConfig
from mpcore.models.qwen3_5_vl_moe.family import FAMILY

__all__ = ["FAMILY", "Qwen35VLMoeConfig"]
