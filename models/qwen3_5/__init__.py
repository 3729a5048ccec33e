"""Qwen3.5 text decoder (``FAMILY``): Gated DeltaNet and gated attention layers on TP/SP/CP."""

from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.qwen3_5.family import FAMILY

__all__ = ["FAMILY", "Qwen35Config"]
