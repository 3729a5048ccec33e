"""Qwen3-MoE (text): the Qwen3 decoder with sparse mixture-of-experts MLPs."""
