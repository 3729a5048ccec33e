"""Qwen3.5 text checkpoints: ``config.json`` <-> ``Qwen35Config``, tensor names, load, export.

Reads ``Qwen3_5ForCausalLM`` (keys ``model.layers.*``), the text family's architecture, and,
as a library call, the text decoder of a released ``Qwen3_5ForConditionalGeneration`` (its
``text_config``; keys ``model.language_model.*``; the vision tower's ``model.visual.*`` is not
read; the registry gives that architecture to ``mpcore.models.qwen3_5_vl``, which reads it whole); v5
(``rope_parameters``) and v4 (top-level ``rope_theta`` / ``partial_rotary_factor``) configs. The
M-RoPE section of a released config is accepted and not used here: on text every position row
is equal, so interleaved M-RoPE is plain RoPE. The multi-token-prediction ``mtp.*`` tensors
(top-level in every layout) are read, per rank sliced, when the model trains them
(``load_hf(..., mtp_loss_weight > 0)``, ``mpcore.models.common.hybrid.mtp``) and exported in the
release's layout; otherwise they are skipped, with the other tensors the model has no use for
(the tower), in one log line. Export writes ``Qwen3_5ForCausalLM``.

Shard map, our parameter -> HF pieces of tp rank r (dim 0 unless noted; ``P`` the prefix):
    layers.i.attention.wqkv.weight       self_attn.q_proj rows of heads r (query and gate rows
                                         per head, 2 D each); k_proj, v_proj rows kv_r
    layers.i.attention.wo.weight         self_attn.o_proj columns r (dim 1)
    layers.i.attention.{q,k}_norm.weight self_attn.{q,k}_norm.weight
    layers.i.linear_attention.w_in.weight  linear_attn.in_proj_qkv rows q_r, k_r, v_r;
                                         in_proj_z rows r; in_proj_b rows r; in_proj_a rows r
    layers.i.linear_attention.conv_weight  linear_attn.conv1d.weight rows q_r, k_r, v_r
    layers.i.linear_attention.{A_log,dt_bias}  linear_attn.{A_log,dt_bias} rows r
    layers.i.linear_attention.norm.norm.weight  linear_attn.norm.weight
    layers.i.linear_attention.out_proj.weight   linear_attn.out_proj columns r (dim 1)
and the embedding, norms, MLP and head as ``mpcore.models.common.decoder_hf``.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from mpcore.models.common.attention import qkv_rows
from mpcore.models.common.hf_check import already_reported
from mpcore.models.common.hf_io import (
    Checkpoint,
    Piece,
    chunk,
    export_by_table,
    fill_from_table,
    read_hf_config,
    whole,
)
from mpcore.models.common.hybrid import mtp
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.hybrid.model import Qwen35Transformer, make_model, materialise
from mpcore.parallel.state import ParallelState

log = logging.getLogger(__name__)
ARCHITECTURES = {"Qwen3_5ForCausalLM": "qwen3_5_text",
                 "Qwen3_5ForConditionalGeneration": "qwen3_5"}
PREFIX = {"Qwen3_5ForCausalLM": "model.", "Qwen3_5ForConditionalGeneration":
          "model.language_model."}


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if len(archs) == 1 and archs[0] in ARCHITECTURES:
        return archs[0]
    if not archs and hf.get("model_type") in ("qwen3_5_text", "qwen3_5"):
        return ("Qwen3_5ForCausalLM" if hf["model_type"] == "qwen3_5_text"
                else "Qwen3_5ForConditionalGeneration")
    raise ValueError(f"{archs or hf.get('model_type')!r} is not a Qwen3.5 checkpoint (the "
                     f"qwen3_5 families read {sorted(ARCHITECTURES)}); load it with its own "
                     f"family (mpcore.models.registry.family_of_hf)")


def text_fields(hf: dict) -> dict:
    """The text decoder's fields (a VL config nests them in ``text_config``; its outer
    ``tie_word_embeddings`` wins, as in transformers 5.x, which writes both)."""
    text = dict(hf.get("text_config") or hf)
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def _reject(text: dict, key: str, allowed, why: str) -> None:
    if text.get(key, allowed) != allowed:
        raise ValueError(f"config.json sets {key}={text[key]!r}; {why} is not supported "
                         f"(only {key}={allowed!r})")


def config_from_hf(source: str | Path | dict) -> Qwen35Config:
    """``Qwen35Config`` of a Qwen3.5 config.json (module docstring); ``ValueError`` naming the
    key for a feature this model does not have, or the architecture for another model."""
    hf = read_hf_config(source)
    _architecture(hf)
    t = text_fields(hf)
    _reject(t, "hidden_act", "silu", "an activation other than silu")
    _reject(t, "attention_bias", False, "attention biases")
    _reject(t, "attn_output_gate", True, "full attention without the output gate")
    rope = t.get("rope_parameters") or {}
    kind = rope.get("rope_type", (t.get("rope_scaling") or {}).get("rope_type", "default"))
    if kind != "default":
        raise ValueError(f"RoPE type {kind!r} is not supported; supported: default")
    heads = t["num_attention_heads"]
    kwargs = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
        num_layers=t["num_hidden_layers"], num_heads=heads,
        num_kv_heads=t.get("num_key_value_heads") or heads,
        intermediate_size=t["intermediate_size"],
        head_dim=t.get("head_dim") or t["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                             t.get("partial_rotary_factor", 0.25))),
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(t.get("tie_word_embeddings", False)),
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        layer_types=tuple(t["layer_types"]) if t.get("layer_types") else None,
        full_attention_interval=t.get("full_attention_interval", 4),
        mtp_num_hidden_layers=t.get("mtp_num_hidden_layers", 0))
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim"):
        if key in t:
            kwargs[key] = t[key]
    return Qwen35Config(**kwargs)


def hf_config_dict(cfg: Qwen35Config) -> dict:
    """A config.json dict that transformers loads as ``Qwen3_5ForCausalLM`` of ``cfg``."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor}
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "attention_bias": False,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope, "layer_types": list(cfg.layer_types),
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        # the exported weights hold mtp.* only when the MTP block was built (trained)
        "mtp_num_hidden_layers": cfg.mtp_num_hidden_layers if cfg.uses_mtp else 0,
    }


def _rows(name: str, shape, parts: list[int], tp: int, rank: int) -> list[Piece]:
    """Rows of shard ``rank`` of each of the consecutive ``parts`` of one HF tensor."""
    out, start = [], 0
    for size in parts:
        local = size // tp
        out.append(Piece(name, shape, 0, start + rank * local, start + (rank + 1) * local))
        start += size
    return out


def _attention(cfg: Qwen35Config, att: str, tp: int, rank: int) -> dict[str, list[Piece]]:
    hid, d = cfg.hidden_size, cfg.head_dim
    q, kv = qkv_rows(cfg, tp, rank)
    return {"wqkv.weight": [Piece(att + "q_proj.weight", (2 * cfg.q_size, hid), 0,
                                  2 * q.start, 2 * q.stop),
                            Piece(att + "k_proj.weight", (cfg.kv_size, hid), 0, kv.start,
                                  kv.stop),
                            Piece(att + "v_proj.weight", (cfg.kv_size, hid), 0, kv.start,
                                  kv.stop)],
            "wo.weight": [chunk(att + "o_proj.weight", (hid, cfg.q_size), 1, tp, rank)],
            "q_norm.weight": whole(att + "q_norm.weight", (d,)),
            "k_norm.weight": whole(att + "k_norm.weight", (d,))}


def _deltanet(cfg: Qwen35Config, lin: str, tp: int, rank: int) -> dict[str, list[Piece]]:
    hid, kd, vd = cfg.hidden_size, cfg.linear_key_size, cfg.linear_value_size
    hv, conv = cfg.linear_num_value_heads, 2 * cfg.linear_key_size + cfg.linear_value_size
    return {
        "w_in.weight": [*_rows(lin + "in_proj_qkv.weight", (conv, hid), [kd, kd, vd], tp, rank),
                        chunk(lin + "in_proj_z.weight", (vd, hid), 0, tp, rank),
                        chunk(lin + "in_proj_b.weight", (hv, hid), 0, tp, rank),
                        chunk(lin + "in_proj_a.weight", (hv, hid), 0, tp, rank)],
        "conv_weight": _rows(lin + "conv1d.weight", (conv, 1, cfg.linear_conv_kernel_dim),
                             [kd, kd, vd], tp, rank),
        "A_log": [chunk(lin + "A_log", (hv,), 0, tp, rank)],
        "dt_bias": [chunk(lin + "dt_bias", (hv,), 0, tp, rank)],
        "norm.norm.weight": whole(lin + "norm.weight", (cfg.linear_value_head_dim,)),
        "out_proj.weight": [chunk(lin + "out_proj.weight", (hid, vd), 1, tp, rank)]}


def shard_map(cfg: Qwen35Config, tp: int, rank: int, prefix: str = "model."
              ) -> dict[str, list[Piece]]:
    """Our parameter name -> the HF pieces of tp rank ``rank``'s shard (module docstring)."""
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    vocab = (cfg.vocab_size, hid)
    out = {"tok_embeddings.weight": [chunk(f"{prefix}embed_tokens.weight", vocab, 0, tp, rank)],
           "norm.weight": whole(f"{prefix}norm.weight", (hid,))}
    if not cfg.tie_embeddings:
        out["output.weight"] = [chunk("lm_head.weight", vocab, 0, tp, rank)]
    for i, kind in enumerate(cfg.layer_types):
        hf, ours = f"{prefix}layers.{i}.", f"layers.{i}."
        out[ours + "attention_norm.weight"] = whole(hf + "input_layernorm.weight", (hid,))
        out[ours + "ffn_norm.weight"] = whole(hf + "post_attention_layernorm.weight", (hid,))
        if kind == "full_attention":
            mixer = _attention(cfg, hf + "self_attn.", tp, rank)
            out.update({ours + "attention." + k: v for k, v in mixer.items()})
        else:
            mixer = _deltanet(cfg, hf + "linear_attn.", tp, rank)
            out.update({ours + "linear_attention." + k: v for k, v in mixer.items()})
        mlp = hf + "mlp."
        out[ours + "feed_forward.w13.weight"] = [
            chunk(mlp + "gate_proj.weight", (inter, hid), 0, tp, rank),
            chunk(mlp + "up_proj.weight", (inter, hid), 0, tp, rank)]
        out[ours + "feed_forward.w2.weight"] = [
            chunk(mlp + "down_proj.weight", (hid, inter), 1, tp, rank)]
    return out


def full_map(cfg: Qwen35Config, tp: int, rank: int, prefix: str = "model."
             ) -> dict[str, list[Piece]]:
    """``shard_map`` plus the ``mtp.*`` block's pieces when the model has it (``uses_mtp``)."""
    out = shard_map(cfg, tp, rank, prefix)
    if cfg.uses_mtp:
        out.update(mtp.shard_map(cfg, tp, rank, shard_map))
    return out


def log_unused(ckpt: Checkpoint, table: dict[str, list[Piece]], what: str) -> None:
    """One log line naming the checkpoint's tensors that ``table`` (a shard map) does not read,
    counted by kind (``mtp.*``, ``model.visual.*``); ``what``: the model that skips them."""
    used = {p.name for pieces in table.values() for p in pieces}
    unused = sorted(set(ckpt.files) - used)
    if unused and not already_reported(ckpt.folder):  # Family.load's check listed them
        kinds = Counter(".".join(n.split(".")[:2]) if not n.startswith("mtp.") else "mtp"
                        for n in unused)
        log.info("%s: skipping %d tensors the %s does not use (%s)", ckpt.folder,
                 len(unused), what, ", ".join(f"{k}.*: {c}" for k, c in sorted(kinds.items())))


def with_mtp_weight(cfg, weight: float, folder: str | Path):
    """``cfg`` (a checkpoint's ``Qwen35Config``, a subclass, or a VL config holding one)
    trained with MTP weight
    ``weight``; ``ValueError`` naming ``folder`` when the weight is bad, when the checkpoint
    has no MTP layer (or a depth other than 1) and the weight is > 0, or when its config.json
    declares the layer but its weights hold no ``mtp.*`` tensors."""
    try:
        cfg = cfg.with_mtp_weight(weight)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    if cfg.uses_mtp and "mtp.fc.weight" not in Checkpoint(Path(folder)).files:
        raise ValueError(f"{folder}: config.json declares mtp_num_hidden_layers="
                         f"{cfg.mtp_num_hidden_layers} but the weights hold no mtp.* tensors; "
                         f"set model.mtp_loss_weight=0, or use a checkpoint with its MTP weights")
    return cfg


def load_hf(folder: str | Path, state: ParallelState, *, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, fp8: str = "none", mtp_loss_weight: float = 0.0,
            **options) -> tuple[Qwen35Transformer, Qwen35Config]:
    """The model of a Qwen3.5 checkpoint folder for ``state``, each rank reading its slices
    (``build``'s keyword arguments, no seed). ``mtp_loss_weight > 0`` builds and reads the
    ``mtp.*`` block (``ValueError`` when the checkpoint has none). Returns ``(model, cfg)``."""
    hf = read_hf_config(folder)
    prefix = PREFIX[_architecture(hf)]
    cfg = with_mtp_weight(config_from_hf(hf), mtp_loss_weight, folder)
    ckpt = Checkpoint(Path(folder))
    model = materialise(make_model, cfg, state, device=device, dtype=dtype, fp8=fp8, **options)
    model.rope.reset_parameters()
    table = full_map(cfg, state.tp, state.tp_rank, prefix)
    fill_from_table(model, ckpt, table)
    log_unused(ckpt, table, "text decoder")
    return model, cfg


@torch.no_grad()
def export_hf(model: Qwen35Transformer, state: ParallelState, out_dir: str | Path,
              progress=None) -> None:
    """``config.json`` + ``model.safetensors`` (``Qwen3_5ForCausalLM``) of ``model`` in
    ``out_dir``; collective over the world (``mpcore.models.common.hf_io.write_hf``)."""
    export_by_table(model, state, out_dir, hf_config_dict, full_map, progress)
