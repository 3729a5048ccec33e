"""The Qwen3-VL model: its vision tower (learned, resampled position grid; DeepStack features),
config and presets, HF names, position inputs and processors' defaults.

A part of four families (qwen3_vl, qwen3_vl_moe, qwen3_5_vl, qwen3_5_vl_moe: the Qwen3.5 VL
models use this tower without DeepStack and this position rule), so it lives under
``models/common``; ``mpcore.models.qwen3_vl`` is the family record over it.
"""
