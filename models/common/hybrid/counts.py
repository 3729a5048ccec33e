"""Parameter and FLOP counts of the Qwen3.5 text decoder (logical: independent of tp).

Per full-attention layer: ``h * (2 q + 2 kv) + q * h`` (query and gate rows, k, v, o_proj)
plus the two head_dim QK-norms. Per DeltaNet layer: ``h * (2 Kd + 2 Vd + 2 Hv)`` (in_proj_qkv,
_z, _b, _a), the conv ``(2 Kd + Vd) * K``, ``A_log`` and ``dt_bias`` (``2 Hv``), the gated norm
``Dv`` and ``out_proj`` ``Vd * h``. Every layer: SwiGLU ``3 h inter`` and two norms ``2 h``.
Then the embedding ``V h``, the final norm ``h`` and, untied, the head ``V h``. With
multi-token prediction on (``cfg.uses_mtp``): the MTP block's ``fc`` ``2 h^2``, three norms
``3 h`` and one full-attention layer (``mpcore.models.common.hybrid.mtp``).

Training FLOPs per token: ``6 N`` for the dense matmuls (the embedding counts only when tied,
as the head), plus per full-attention layer ``12 q seq_len`` (as ``mpcore.models.common.counts``) and
per DeltaNet layer the chunked rule, estimated with chunks of C = 64 tokens per value head as
``3 * (4 Dk Dv + 2 C (Dk + Dv))`` (state read and write, intra-chunk scores and mixing; forward
and twice that backward). With MTP on: its matmuls, its attention layer and a second pass
through the shared head (``6 V h``).
"""

from __future__ import annotations

from mpcore.models.common.hybrid.config import Qwen35Config

CHUNK = 64


def num_params(cfg: Qwen35Config) -> dict[str, int]:
    """``total``, ``embedding`` and ``head`` (the embedding when tied) parameter counts."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    kd, vd = cfg.linear_key_size, cfg.linear_value_size
    full = h * (2 * cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 2 * cfg.head_dim
    linear = (h * (2 * kd + 2 * vd + 2 * hv) + (2 * kd + vd) * cfg.linear_conv_kernel_dim
              + 2 * hv + cfg.linear_value_head_dim + vd * h)
    shared = 3 * h * cfg.intermediate_size + 2 * h
    layers = sum((full if t == "full_attention" else linear) + shared for t in cfg.layer_types)
    mtp = 2 * h * h + 3 * h + full + shared if cfg.uses_mtp else 0
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    return {"total": embedding + layers + mtp + h + head, "embedding": embedding,
            "head": head or embedding, "mtp": mtp}


def flops_per_token(cfg: Qwen35Config, seq_len: int) -> float:
    """Training FLOPs per token at ``seq_len`` (module docstring)."""
    counts = num_params(cfg)
    dense = counts["total"] - (counts["embedding"] if not cfg.tie_embeddings else 0)
    if cfg.uses_mtp:  # the shared head runs twice; the MTP layer attends once more
        dense += cfg.vocab_size * cfg.hidden_size
    num_linear = cfg.layer_types.count("linear_attention")  # the MTP layer is full attention
    num_full = cfg.num_layers - num_linear + (1 if cfg.uses_mtp else 0)
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per_head = 3 * (4 * dk * dv + 2 * CHUNK * (dk + dv))
    return (6.0 * dense + 12.0 * num_full * cfg.q_size * seq_len
            + num_linear * cfg.linear_num_value_heads * per_head)
