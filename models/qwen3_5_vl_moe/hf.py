"""Hugging Face ``Qwen3_5MoeForConditionalGeneration`` checkpoints <-> shards of
``Qwen35VLMoeModel``.

Keys: Qwen3.5 VL's (``mpcore.models.common.hybrid.vl_hf``: ``model.language_model.*``, ``model.visual.*``,
``lm_head.weight`` when untied) with each layer's MLP the Qwen3.5-MoE one
(``mpcore.models.common.hybrid.moe_hf.shard_map`` under ``model.language_model.``: router, shared expert and
its gate, the experts). The released checkpoints (Qwen/Qwen3.5-35B-A3B) and transformers 5.x's
``save_pretrained`` store one tensor per expert; the fused ``experts.gate_up_proj`` /
``down_proj`` load too, found per layer by name, each ep rank reading only its experts
(``mpcore.models.common.moe_hf.load_moe_weights``). The multi-token-prediction ``mtp.*`` (its
MLP a MoE block) is read and exported when trained (``mtp_loss_weight > 0``), else skipped with
one log line. Export writes the released per-expert
layout (``mpcore.models.common.moe_hf.export_moe``), ``config.json`` in the 5.x form.
"""

from __future__ import annotations

from pathlib import Path

from mpcore.models.common import moe_hf
from mpcore.models.common.decoder import init_weights
from mpcore.models.common.hf_io import Piece
from mpcore.models.common.hybrid import vl_hf as dense_hf
from mpcore.models.common.hybrid.hf import with_mtp_weight
from mpcore.models.common.hybrid.moe_hf import full_map as text_shard_map
from mpcore.models.common.hybrid.moe_hf import log_skipped, mtp_experts
from mpcore.models.common.qwen3_vl.hf import TEXT_PREFIX
from mpcore.models.qwen3_5_vl_moe.config import Qwen35VLMoeConfig, config_from_hf, hf_config_dict
from mpcore.models.qwen3_5_vl_moe.model import Qwen35VLMoeModel, make_moe_model
from mpcore.parallel.state import ParallelState


def shard_map(cfg: Qwen35VLMoeConfig, tp: int, rank: int) -> dict[str, list[Piece]]:
    """Our ``Qwen35VLMoeModel`` parameter name -> the HF pieces of tp rank ``rank``'s shard
    (experts: fused names, all E)."""
    return dense_hf.shard_map(cfg, tp, rank, text_shard_map)


def load_hf_model(folder: str | Path, state: ParallelState, *, mtp_loss_weight: float = 0.0,
                  **options) -> tuple[Qwen35VLMoeModel, Qwen35VLMoeConfig]:
    """The model of a checkpoint folder for ``state`` with this rank's shards loaded (tp
    pieces, this ep rank's experts): ``(model, cfg)``; ``options``: ``build_model``'s, no
    seed; ``mtp_loss_weight > 0`` builds and reads the ``mtp.*`` block. Another family's checkpoint, a missing tensor or a shape that disagrees with the
    config raise ``ValueError``."""
    cfg = with_mtp_weight(config_from_hf(folder), mtp_loss_weight, folder)
    device = options.pop("device", "cpu")
    model = make_moe_model(cfg, state, device=device, **options)
    model.to_empty(device=device)
    init_weights(model, 0)  # buffers (rotary tables); every parameter is overwritten below
    table = shard_map(cfg, state.tp, state.tp_rank)
    moe_hf.load_moe_weights(model, folder, state, cfg.text, table, ours="text.",
                            hf=TEXT_PREFIX, extra=_mtp_experts(cfg))
    log_skipped(folder, table, (TEXT_PREFIX, "mtp.") if cfg.uses_mtp else (TEXT_PREFIX,),
                "vision-language model")
    return model, cfg


def export_hf(model: Qwen35VLMoeModel, state: ParallelState, out_dir: str | Path,
              progress=None) -> None:
    """``config.json`` + ``model.safetensors`` (``Qwen3_5MoeForConditionalGeneration``, the
    released per-expert layout) of ``model`` in ``out_dir``; collective over the world."""
    cfg = model.cfg
    maps = [shard_map(cfg, state.tp, r) for r in range(state.tp)]
    moe_hf.export_moe(model, state, out_dir, hf_config_dict(cfg), cfg.text, maps,
                      moe_hf.released_experts, ours="text.", hf=TEXT_PREFIX, progress=progress,
                      extra=_mtp_experts(cfg))


def _mtp_experts(cfg: Qwen35VLMoeConfig) -> tuple[tuple[str, str], ...]:
    """The MTP layer (ours ``text.mtp.*``) as ``moe_hf``'s ``extra`` expert layer."""
    return tuple(("text." + ours, hf) for ours, hf in mtp_experts(cfg.text))
