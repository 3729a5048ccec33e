"""Qwen3.5-MoE text decoder (``FAMILY``): Qwen3.5's hybrid layers with sparse MoE blocks."""

from mpcore.models.common.hybrid.moe_config import Qwen35MoeConfig
from mpcore.models.qwen3_5_moe.family import FAMILY

__all__ = ["FAMILY", "Qwen35MoeConfig"]
