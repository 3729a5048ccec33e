"""Parameter and FLOP counts of the decoder (logical: independent of tp).

Per layer: attention ``h * (q + 2 kv) + q * h`` (plus q/k/v biases, plus two head_dim q/k
norms), SwiGLU ``3 * h * inter``, two norms ``2 h``; then the embedding ``V h``, the final norm
``h`` and, untied, the head ``V h``.

Training FLOPs per token: ``6 N`` for the matmuls of the N dense parameters (forward 2N,
backward 4N; the embedding is a lookup and counts only when it is also the head, i.e. tied),
plus attention's score and value matmuls: ``12 * layers * q_size * seq_len`` (forward
``2 * 2 * q_size * seq_len`` per layer, times 3 with the backward). Causal masking halves the
useful part; like nanoGPT and torchtitan we count it whole (MFU is then comparable).
"""

from __future__ import annotations

from mpcore.models.common.config import ModelConfig


def num_params(cfg: ModelConfig) -> dict[str, int]:
    """``total``, ``embedding`` and ``head`` (the embedding when tied) parameter counts."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    if cfg.qkv_bias:
        attn += cfg.q_size + 2 * cfg.kv_size
    if cfg.qk_norm:
        attn += 2 * d
    layer = attn + 3 * h * inter + 2 * h
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    total = embedding + cfg.num_layers * layer + h + head
    return {"total": total, "embedding": embedding, "head": head or embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the decoder at ``seq_len`` (module docstring)."""
    counts = num_params(cfg)
    dense = counts["total"] - (counts["embedding"] if not cfg.tie_embeddings else 0)
    return 6.0 * dense + 12.0 * cfg.num_layers * cfg.q_size * seq_len
