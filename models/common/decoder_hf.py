"""The decoder's Hugging Face tensor names: which pieces of which HF tensors each tp rank holds.

For every local parameter of ``mpcore.models.common.decoder.Transformer`` on tp rank r, concatenated
along dim 0 unless noted (``prefix`` is ``model.`` for a causal LM's hub layout):

    tok_embeddings.weight             {prefix}embed_tokens.weight rows of vocab shard r (padded)
    output.weight                     lm_head.weight, same rows (untied only)
    norm.weight                       {prefix}norm.weight
    layers.i.attention_norm.weight    {prefix}layers.i.input_layernorm.weight
    layers.i.ffn_norm.weight          {prefix}layers.i.post_attention_layernorm.weight
    layers.i.attention.wqkv.{weight,bias}  q_proj rows q_r ; k_proj rows kv_r ; v_proj rows kv_r
    layers.i.attention.wo.weight      o_proj.weight columns of shard r (dim 1)
    layers.i.attention.{q,k}_norm.weight   self_attn.{q,k}_norm.weight (Qwen3)
    layers.i.feed_forward.w13.weight  mlp.gate_proj rows r ; mlp.up_proj rows r
    layers.i.feed_forward.w2.weight   mlp.down_proj.weight columns of shard r (dim 1)
"""

from __future__ import annotations

from mpcore.models.common.attention import qkv_rows
from mpcore.models.common.config import ModelConfig
from mpcore.models.common.hf_io import Piece, chunk, whole


def shard_map(cfg: ModelConfig, tp: int, rank: int, prefix: str = "model."
              ) -> dict[str, list[Piece]]:
    """Our parameter name -> the HF pieces of tp rank ``rank``'s shard (module docstring)."""
    hid, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    vocab = (cfg.vocab_size, hid)
    out = {"tok_embeddings.weight": [chunk(f"{prefix}embed_tokens.weight", vocab, 0, tp, rank)],
           "norm.weight": whole(f"{prefix}norm.weight", (hid,))}
    if not cfg.tie_embeddings:
        out["output.weight"] = [chunk("lm_head.weight", vocab, 0, tp, rank)]
    q, kv = qkv_rows(cfg, tp, rank)
    for i in range(cfg.num_layers):
        hf, ours = f"{prefix}layers.{i}.", f"layers.{i}."
        att = hf + "self_attn."
        out[ours + "attention_norm.weight"] = whole(hf + "input_layernorm.weight", (hid,))
        out[ours + "ffn_norm.weight"] = whole(hf + "post_attention_layernorm.weight", (hid,))
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            tail = (hid,) if kind == "weight" else ()
            out[ours + f"attention.wqkv.{kind}"] = [
                Piece(att + f"q_proj.{kind}", (cfg.q_size, *tail), 0, q.start, q.stop),
                Piece(att + f"k_proj.{kind}", (cfg.kv_size, *tail), 0, kv.start, kv.stop),
                Piece(att + f"v_proj.{kind}", (cfg.kv_size, *tail), 0, kv.start, kv.stop)]
        out[ours + "attention.wo.weight"] = [
            chunk(att + "o_proj.weight", (hid, cfg.q_size), 1, tp, rank)]
        if cfg.qk_norm:
            out[ours + "attention.q_norm.weight"] = whole(att + "q_norm.weight", (d,))
            out[ours + "attention.k_norm.weight"] = whole(att + "k_norm.weight", (d,))
        mlp = hf + "mlp."
        out[ours + "feed_forward.w13.weight"] = [
            chunk(mlp + "gate_proj.weight", (inter, hid), 0, tp, rank),
            chunk(mlp + "up_proj.weight", (inter, hid), 0, tp, rank)]
        out[ours + "feed_forward.w2.weight"] = [
            chunk(mlp + "down_proj.weight", (hid, inter), 1, tp, rank)]
    return out


