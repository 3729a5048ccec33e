"""Qwen3.5-MoE text checkpoints: ``config.json`` <-> ``Qwen35MoeConfig``, tensor names, load,
export.

Reads ``Qwen3_5MoeForCausalLM`` (keys ``model.layers.*``) and, as a library call, the text
decoder of a released ``Qwen3_5MoeForConditionalGeneration`` (Qwen/Qwen3.5-35B-A3B: nested
``text_config``, keys ``model.language_model.*``; the tower ``model.visual.*`` is skipped with
one log line; the registry gives that architecture to ``mpcore.models.qwen3_5_vl_moe``, which
reads it whole). The multi-token-prediction ``mtp.*`` tensors (top-level in every layout; the
layer's MLP a MoE block, ``mtp.layers.0.mlp.gate`` / ``experts`` / ``shared_expert*``) are read,
per rank sliced, when the model trains them (``load_hf(..., mtp_loss_weight > 0)``) and exported
in the release's layout; otherwise skipped in that one log line. The text fields are read as Qwen3.5's
(``mpcore.models.common.hybrid.hf.config_from_hf``: the same keys, both transformers forms), the shared
expert's width standing in for the dense MLP's; the MoE keys are transformers'
``Qwen3_5MoeTextConfig``'s (its defaults where absent).

Shard map: Qwen3.5's (``mpcore.models.common.hybrid.hf.shard_map``) with each layer's MLP replaced by
(``M`` = ``{prefix}layers.i.mlp.``; every tensor whole on each tp rank):

    feed_forward.gate.weight                [E, hidden]       M gate.weight (the router)
    feed_forward.experts.w13                [E/ep, 2I, hidden] released: M experts.{e}.gate_proj
                                                                ; up_proj (per expert)
                                                              fused: M experts.gate_up_proj
    feed_forward.experts.w2                 [E/ep, hidden, I]  M experts.{e}.down_proj / fused
                                                              M experts.down_proj
    feed_forward.shared_expert.w13          [2S, hidden]      M shared_expert.gate_proj ; up_proj
    feed_forward.shared_expert.w2           [hidden, S]       M shared_expert.down_proj
    feed_forward.shared_expert_gate.weight  [1, hidden]       M shared_expert_gate.weight

Released Qwen3.5-MoE checkpoints store one tensor per expert (transformers 5.x fuses them on
load and splits them again on save: its conversion mapping for ``qwen3_5_moe_text``; the MTP
layer's experts are per expert in Qwen3.5 releases and packed in Qwen3.6's, as Megatron-Bridge's
qwen35_vl_bridge.py reads them); both layouts load, the MTP layer's too, found per layer by name, each ep rank reading only its experts' slices
(``mpcore.models.common.moe_hf.load_moe_weights``). Export writes ``Qwen3_5MoeForCausalLM`` in the
released per-expert layout (``mpcore.models.common.moe_hf.export_moe``).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from mpcore.models.common import moe_hf
from mpcore.models.common.hf_io import Checkpoint, Piece, read_hf_config, whole
from mpcore.models.common.hybrid import mtp
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.hybrid.hf import config_from_hf as dense_config_from_hf
from mpcore.models.common.hybrid.hf import hf_config_dict as dense_hf_config_dict
from mpcore.models.common.hybrid.hf import log_unused, text_fields, with_mtp_weight
from mpcore.models.common.hybrid.hf import shard_map as dense_shard_map
from mpcore.models.common.hybrid.model import materialise
from mpcore.models.common.hybrid.moe_config import Qwen35MoeConfig
from mpcore.models.common.hybrid.moe_model import Qwen35MoeTransformer, make_model
from mpcore.parallel.state import ParallelState

TEXT_ARCH = "Qwen3_5MoeForCausalLM"  # the family's; the registry gives the VL one to qwen3_5_vl_moe
ARCHITECTURES = {"Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
                 "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe"}
PREFIX = {"Qwen3_5MoeForCausalLM": "model.",
          "Qwen3_5MoeForConditionalGeneration": "model.language_model."}
# transformers' Qwen3_5MoeTextConfig defaults (the Qwen3.5-35B-A3B shape)
MOE_DEFAULTS = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001}


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    by_type = {t: a for a, t in ARCHITECTURES.items()}
    arch = archs[0] if len(archs) == 1 else None if archs else by_type.get(hf.get("model_type"))
    if arch not in ARCHITECTURES:
        dense = " (a dense Qwen3.5: load it with the qwen3_5 family)" if any(
            str(a).startswith("Qwen3_5For") for a in archs) else ""
        raise ValueError(f"{archs or hf.get('model_type')!r} is not a Qwen3.5-MoE checkpoint "
                         f"(the qwen3_5_moe family reads {sorted(ARCHITECTURES)}){dense}; load "
                         f"it with its own family (mpcore.models.registry.family_of_hf)")
    return arch


def config_from_hf(source: str | Path | dict) -> Qwen35MoeConfig:
    """``Qwen35MoeConfig`` of a Qwen3.5-MoE config.json (module docstring); ``ValueError``
    naming the key for a feature this model does not have, or the architecture for another
    model (a dense Qwen3.5 included)."""
    hf = read_hf_config(source)
    _architecture(hf)
    t = text_fields(hf)
    moe = {k: t.get(k, v) for k, v in MOE_DEFAULTS.items()}
    if not moe["num_experts"] or not moe["shared_expert_intermediate_size"]:
        raise ValueError("config.json has num_experts or shared_expert_intermediate_size 0; "
                         "every Qwen3.5-MoE layer has routed experts and a shared expert")
    dense = dense_config_from_hf({**t, "architectures": ["Qwen3_5ForCausalLM"],
                                  "intermediate_size": moe.pop("shared_expert_intermediate_size")})
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(Qwen35Config)}
    return Qwen35MoeConfig(**fields, **moe)


def hf_config_dict(cfg: Qwen35MoeConfig) -> dict:
    """A config.json dict that transformers loads as ``Qwen3_5MoeForCausalLM`` of ``cfg``."""
    out = dense_hf_config_dict(cfg)
    out.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
               num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               moe_intermediate_size=cfg.moe_intermediate_size,
               shared_expert_intermediate_size=out.pop("intermediate_size"),
               router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    return out


def shard_map(cfg: Qwen35MoeConfig, tp: int, rank: int, prefix: str = "model."
              ) -> dict[str, list[Piece]]:
    """Our parameter name -> the HF pieces of tp rank ``rank`` (experts: fused names, all E;
    module docstring)."""
    out = dense_shard_map(cfg, tp, rank, prefix)
    h, s = cfg.hidden_size, cfg.intermediate_size
    for i in range(cfg.num_layers):
        ours, mlp = f"layers.{i}.feed_forward.", f"{prefix}layers.{i}.mlp."
        moe_hf.expert_pieces(out, cfg, ours, mlp)
        out[ours + "shared_expert.w13"] = [
            *whole(mlp + "shared_expert.gate_proj.weight", (s, h)),
            *whole(mlp + "shared_expert.up_proj.weight", (s, h))]
        out[ours + "shared_expert.w2"] = whole(mlp + "shared_expert.down_proj.weight", (h, s))
        out[ours + "shared_expert_gate.weight"] = whole(mlp + "shared_expert_gate.weight", (1, h))
    return out


def full_map(cfg: Qwen35MoeConfig, tp: int, rank: int, prefix: str = "model."
             ) -> dict[str, list[Piece]]:
    """``shard_map`` plus the ``mtp.*`` block's pieces when the model has it (``uses_mtp``;
    its MoE feed-forward named as the decoder's, under ``mtp.layers.0.mlp.``)."""
    out = shard_map(cfg, tp, rank, prefix)
    if cfg.uses_mtp:
        out.update(mtp.shard_map(cfg, tp, rank, shard_map))
    return out


def mtp_experts(cfg: Qwen35MoeConfig) -> tuple[tuple[str, str], ...]:
    """The MTP layer as ``moe_hf``'s ``extra`` expert layer when the model has it."""
    return (("mtp.layers.0.feed_forward.", "mtp.layers.0.mlp."),) if cfg.uses_mtp else ()


def load_hf(folder: str | Path, state: ParallelState, *, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, fp8: str = "none", mtp_loss_weight: float = 0.0,
            **options) -> tuple[Qwen35MoeTransformer, Qwen35MoeConfig]:
    """The model of a Qwen3.5-MoE checkpoint folder for ``state``, each rank reading its
    slices (``build``'s keyword arguments, no seed). ``mtp_loss_weight > 0`` builds and reads
    the ``mtp.*`` block (``ValueError`` naming the folder when the checkpoint has none).
    Returns ``(model, cfg)``."""
    hf = read_hf_config(folder)
    prefix = PREFIX[_architecture(hf)]
    cfg = with_mtp_weight(config_from_hf(hf), mtp_loss_weight, folder)
    model = materialise(make_model, cfg, state, device=device, dtype=dtype, fp8=fp8, **options)
    model.rope.reset_parameters()
    table = full_map(cfg, state.tp, state.tp_rank, prefix)
    moe_hf.load_moe_weights(model, folder, state, cfg, table, hf=prefix,
                            extra=mtp_experts(cfg))
    log_skipped(folder, table, ("mtp.", prefix) if cfg.uses_mtp else (prefix,), "text decoder")
    return model, cfg


def log_skipped(folder: str | Path, table: dict[str, list[Piece]], prefixes: tuple[str, ...],
                what: str) -> None:
    """``log_unused``'s one line for a checkpoint whose experts (``{prefix}layers.i.mlp.
    experts.*`` of each of ``prefixes``, either layout) were read apart from ``table``."""
    ckpt = Checkpoint(Path(folder))
    either = "|".join(re.escape(p) for p in prefixes)
    experts = re.compile(rf"(?:{either})layers\.\d+\.mlp\.experts\.")
    ckpt.files = {n: f for n, f in ckpt.files.items() if not experts.match(n)}
    log_unused(ckpt, table, what)


@torch.no_grad()
def export_hf(model: Qwen35MoeTransformer, state: ParallelState, out_dir: str | Path,
              progress=None) -> None:
    """``config.json`` + ``model.safetensors`` (``Qwen3_5MoeForCausalLM``, released expert
    layout) of ``model`` in ``out_dir``; collective over the world."""
    cfg = model.cfg
    moe_hf.export_moe(model, state, out_dir, hf_config_dict(cfg), cfg,
                      [full_map(cfg, state.tp, r) for r in range(state.tp)],
                      moe_hf.released_experts, progress=progress, extra=mtp_experts(cfg))
