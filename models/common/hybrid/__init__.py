"""The Qwen3.5 hybrid decoder: Gated DeltaNet and gated attention layers on TP/SP/CP.

A part of four families (qwen3_5, qwen3_5_moe, qwen3_5_vl, qwen3_5_vl_moe), so it lives under
``models/common``: ``config`` (``Qwen35Config``), ``section`` (our YAML keys, a config from
them), ``layers`` / ``deltanet`` / ``kernels`` / ``cp`` (the mixers, the recurrence, its
kernel choice, its CP head split), ``model`` (the decoder), ``hf`` (checkpoints), ``counts``;
and the models built on it: ``moe_*`` (Qwen3.5-MoE: every feed-forward a MoE block with a
shared expert) and ``vl_*`` (Qwen3.5-VL: the Qwen3-VL tower without DeepStack in front).
"""
