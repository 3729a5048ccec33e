"""Qwen3-VL-MoE configuration (transformers ``models/qwen3_vl_moe``) and its ``config.json``.

The Qwen3-VL model (``mpcore.models.qwen3_vl``: tower, interleaved M-RoPE, DeepStack) whose decoder
is Qwen3-MoE's (``mpcore.models.qwen3_moe``): ``Qwen3VLMoeConfig`` is ``Qwen3VLConfig`` with ``text`` a
``Qwen3MoeConfig``. Its router always renormalises the top-k weights (transformers'
``Qwen3VLMoeTextTopKRouter``; the config has no ``norm_topk_prob``), so ``norm_topk_prob`` is
true. ``config.json`` nests the MoE keys in ``text_config``; read in both forms of Qwen3-VL's,
written in the 5.x form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.hf_io import check_architecture, read_hf_config
from mpcore.models.common.moe_config import Qwen3MoeConfig
from mpcore.models.common.moe_config import config_from_dict as text_config_from_dict
from mpcore.models.common.qwen3_vl.config import ARCH as DENSE_ARCH
from mpcore.models.common.qwen3_vl.config import (
    TOKEN_KEYS,
    Qwen3VLConfig,
    vision_and_tokens_from_dict,
)
from mpcore.models.common.qwen3_vl.config import config_from_hf as dense_config_from_hf
from mpcore.models.common.qwen3_vl.config import hf_config_dict as dense_hf_config_dict

ARCH, MODEL_TYPE = "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")


@dataclass(frozen=True)
class Qwen3VLMoeConfig(Qwen3VLConfig):
    """``Qwen3VLConfig`` whose ``text`` is a ``Qwen3MoeConfig`` with ``norm_topk_prob``."""

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.text, Qwen3MoeConfig) or not self.text.norm_topk_prob:
            raise ValueError("a Qwen3-VL-MoE decoder is a Qwen3MoeConfig with norm_topk_prob "
                             "true (its router always renormalises the top-k weights)")


def with_experts(cfg: Qwen3VLConfig, moe: dict) -> Qwen3VLMoeConfig:
    """``cfg`` with its decoder's MLPs made MoE blocks of ``moe`` (``Qwen3MoeConfig``'s MoE
    fields; ``norm_topk_prob`` true)."""
    moe = dict(moe)
    if moe.get("norm_topk_prob", True) is not True:
        raise ValueError("Qwen3-VL-MoE's router always renormalises the top-k weights; remove "
                         "norm_topk_prob (or set it true)")
    moe["norm_topk_prob"] = True
    if "mlp_only_layers" in moe:
        moe["mlp_only_layers"] = tuple(moe["mlp_only_layers"] or ())
    dense = {f.name: getattr(cfg.text, f.name) for f in dataclasses.fields(ModelConfig)}
    try:
        text = Qwen3MoeConfig(**dense, **moe)
    except TypeError as e:
        raise ValueError(f"the MoE keys are Qwen3MoeConfig's MoE fields: {e}") from None
    return Qwen3VLMoeConfig(text=text, vision=cfg.vision,
                            **{k: getattr(cfg, k) for k in TOKEN_KEYS})


def config_from_dict(d: dict) -> Qwen3VLMoeConfig:
    """The ``Qwen3VLMoeConfig`` of ``dataclasses.asdict(cfg)`` (a checkpoint's meta.json)."""
    vision, rest = vision_and_tokens_from_dict(d)
    return Qwen3VLMoeConfig(text=text_config_from_dict(d["text"]), vision=vision, **rest)


def config_from_hf(source: str | Path | dict) -> Qwen3VLMoeConfig:
    """``Qwen3VLMoeConfig`` of a ``Qwen3VLMoeForConditionalGeneration`` config.json; another
    architecture (dense Qwen3-VL included) raises ``ValueError`` naming it."""
    hf = read_hf_config(source)
    check_architecture(hf, ARCH, MODEL_TYPE, "Qwen3-VL-MoE")
    text = dict(hf.get("text_config") or {})
    text.setdefault("num_experts", text.get("num_local_experts"))  # 5.x writes the latter
    if not text.get("num_experts"):
        raise ValueError("config.json text_config has no num_experts: a dense decoder; load "
                         "it as the qwen3_vl family (Qwen3VLForConditionalGeneration)")
    dense = dense_config_from_hf({**hf, "architectures": [DENSE_ARCH]})
    moe = {k: text[k] for k in MOE_KEYS if k in text}
    return with_experts(dense, moe)


def hf_config_dict(cfg: Qwen3VLMoeConfig) -> dict:
    """The transformers 5.x ``config.json`` dict of ``cfg``."""
    out = dense_hf_config_dict(cfg)
    t = cfg.text
    out.update(architectures=[ARCH], model_type=MODEL_TYPE)
    out["text_config"].update(
        model_type="qwen3_vl_moe_text", num_experts=t.num_experts,
        num_experts_per_tok=t.num_experts_per_tok,
        moe_intermediate_size=t.moe_intermediate_size,
        decoder_sparse_step=t.decoder_sparse_step, mlp_only_layers=list(t.mlp_only_layers),
        router_aux_loss_coef=t.router_aux_loss_coef)
    out["vision_config"]["model_type"] = "qwen3_vl_moe_vision"
    return out
