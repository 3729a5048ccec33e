"""Qwen3-VL-MoE (transformers ``models/qwen3_vl_moe``): Qwen3-VL's tower, interleaved M-RoPE
and DeepStack over the Qwen3-MoE decoder (router renormalised, experts split over ep)."""
